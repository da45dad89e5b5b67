"""Draft-and-verify speculative decoding as a decoding of the engine (engine/decoding.py).

Per request and step, top to bottom:
  1. plan: the request's drafter proposes a chain d_1..d_k (or grows an EAGLE-2 tree) after its
     last emitted token x_n, whose K/V the target has not written yet; the request's segment of the
     step's forward is [x_n, d_1..d_k] (each row reading its own prefix), or the tree rows under
     the tree's mask;
  2. choose: from the rows' logits, the longest prefix of drafts the target agrees with plus the
     target's own next token (verify.py); the engine reads every request's verdict in one host read;
  3. commit: roll back = the cache keeps x_n and the accepted drafts (a length change; a tree's
     accepted path is moved to consecutive slots of the request's own cache), and the drafter
     consumes the emitted tokens.
Requests speculate side by side in one batch, each with a drafter of its own (`Drafter.fork`); the
step's chains, or trees, are drafted together before step 1 (`begin_step`: a drafter that runs a
model, or the EAGLE head, batches its forwards across the requests). Whether they draft: per request
by the row gate where chains are lookups (n-gram), else per step by the speculation gate.
Greedy output equals full-depth greedy; sampled output has the target's distribution.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..clock import device_time
from ..drafters.base import Draft, Drafter
from ..engine.decoding import FullDepth
from ..engine.runner import Segment
from ..engine.scheduler import Running
from ..engine.sequence import Sequence
from ..model.llama import Transformer
from ..sampling import sample
from .gate import SpeculationGate
from .row_gate import RowGate, Shadow
from .tree import Tree, TreeGrower, TreeShape, compact, tree_inputs
from .verify import accept_tree, verify_chain


@dataclass
class SpecStats:
    """vLLM's speculative-decoding metrics: drafts (steps that drafted), draft tokens, accepted
    tokens, mean acceptance length (tokens per target pass = 1 + accepted / drafts), acceptance
    rate per draft position."""

    positions: int
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    target_passes: int = 0
    draft_seconds: float = 0.0
    accepted_at: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.accepted_at = [0] * self.positions

    def record(self, drafted: int, accepted: int) -> None:
        self.target_passes += 1
        if drafted:
            self.drafts += 1
            self.draft_tokens += drafted
            self.accepted_tokens += accepted
            for j in range(accepted):
                self.accepted_at[j] += 1

    def as_dict(self, decode_seconds: float) -> dict:
        d = max(self.drafts, 1)
        return {
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "target_passes": self.target_passes,
            "mean_accepted_length": round(1 + self.accepted_tokens / d, 4),
            "acceptance_rate": round(self.accepted_tokens / max(self.draft_tokens, 1), 4),
            "acceptance_rate_per_position": [round(a / d, 4) for a in self.accepted_at],
            "draft_time_share": round(self.draft_seconds / decode_seconds, 4) if decode_seconds > 0 else 0.0,
        }


@dataclass
class SpecState:
    """A request's speculation: its drafter, this step's draft (or tree), its counts."""

    drafter: Drafter
    stats: SpecStats
    draft: Draft | None = None
    tree: Tree | None = None
    start: int = 0  # the slot of x_n in this step
    match: int = 0  # the matched suffix of this step's chain (a drafter with free chains)
    shadow: Shadow | None = None  # a chain looked up but not drafted, checked against what comes

    @property
    def plain(self) -> bool:
        """No draft this step: the request runs full depth's row and choice."""
        return self.tree is None and self.draft is None


class SpeculativeDecoding(FullDepth):
    """Chains of `num_tokens` drafts, or trees of `tree`, from forks of `drafter`."""

    def __init__(self, model: Transformer, drafter: Drafter, num_tokens: int, tree: TreeShape | None = None,
                 method: str = "", gated: bool = True):
        """gated: the row gate picks each step's drafts where chains are free lookups (n-gram chains),
        else a SpeculationGate decides per step whether to draft (False: every step drafts)."""
        super().__init__(model)
        self.drafter, self.num_tokens, self.method = drafter, num_tokens, method
        self.grower = None if tree is None else TreeGrower(tree, model.device)
        self.extra_rows = num_tokens + 1 if tree is None else tree.size + 1
        self.feature_layers = drafter.feature_layers
        self.width = model.cfg.vocab_size
        by_row = gated and tree is None and drafter.free_chains
        self.row_gate = RowGate(drafter.min_ngram, drafter.max_ngram, num_tokens) if by_row else None
        self.gate = SpeculationGate() if gated and not by_row else None
        self.drafting = True  # `plan` drafts this step's requests (the speculation gate's choice)
        self.pending, self.draft_seconds = 0, 0.0  # this step's tokens the drafters ran first, and drafting's time
        self.drafted_any = False  # some request of this step has a draft token (a tree or a non-empty chain)

    def begin_step(self, batch: list[Running], waiting: bool = False) -> None:
        """The row gate's drafts; or the speculation gate's choice for this batch size, then every
        decoding request's tree, or chain, in one call of the drafter (a drafter that runs a model
        batches its forwards across the requests). waiting: whether requests wait for a slot."""
        decoding = [r for r in batch if r.prefilled]
        if self.row_gate is not None:
            self.drafting = False  # `plan` drafts nothing: the row gate chose the drafts here
            return self.draft_rows(decoding, waiting) if decoding else None
        self.pending = sum(r.state.drafter.pending() for r in decoding) if self.gate is not None else 0
        # a step of prefills alone is not the gate's: it counted towards batch 1's next try
        self.drafting = bool(decoding) and (self.gate is None or self.gate.begin_step(len(decoding), self.pending))
        self.draft_seconds, self.drafted_any = 0.0, False
        if not self.drafting:
            return
        ready = [r for r in decoding if self.room(r) > 0]
        if len(decoding) < 2 or not ready:
            return
        t0 = device_time(self.model.device)
        deep = [r for r in ready if self.room(r) >= self.grower.shape.depth] if self.grower is not None else []
        if deep:
            roots = torch.tensor([r.last for r in deep], device=self.model.device)
            for r, tree in zip(deep, self.grower.grow(roots, self.drafter, [r.state.drafter for r in deep])):
                r.state.tree = tree
        chains = [r for r in ready if r.state.tree is None]  # or whose drafter had no room for a tree
        if chains:
            drafts = self.drafter.draft_all([r.state.drafter for r in chains],
                                            [min(self.num_tokens, self.room(r)) for r in chains],
                                            [r.seq.params for r in chains], [r.generator for r in chains], self.width)
            for r, draft in zip(chains, drafts):
                r.state.draft = draft
        self.charge_drafting(ready, t0)

    def draft_rows(self, decoding: list[Running], waiting: bool) -> None:
        """The drafts the row gate finds paying; a request whose chain it looked up and did not draft
        keeps that chain as a shadow, to learn from."""
        t0, self.draft_seconds = device_time(self.model.device), 0.0
        rooms = [self.room(r) for r in decoding]

        def look(i: int) -> tuple[int, list[int]]:
            drafter = decoding[i].state.drafter
            ids = drafter.chain(min(self.num_tokens, rooms[i]))
            return (drafter.match if ids else 0), ids

        drafts = self.row_gate.choose(rooms, waiting, look)
        if not self.row_gate.looked:
            return
        for i, (match, ids) in self.row_gate.looked.items():
            st = decoding[i].state
            if drafts[i]:
                if st.shadow is not None:  # what it checked counts; its evidence from here on is the draft's
                    self.row_gate.settle(st.shadow)
                    st.shadow = None
                st.match = match
                st.draft = Draft(torch.tensor(drafts[i], dtype=torch.long, device=self.model.device), ids=drafts[i])
            elif ids and st.shadow is None:
                st.shadow = Shadow(match, ids)
        self.charge_drafting(decoding, t0)

    def charge_drafting(self, requests: list[Running], t0: float) -> None:
        """This step's drafting time, since t0, shared among the requests it drafted for."""
        self.draft_seconds = device_time(self.model.device) - t0
        for r in requests:
            r.state.stats.draft_seconds += self.draft_seconds / len(requests)

    @staticmethod
    def room(r: Running) -> int:
        """Drafts the request could still emit after this step's own token."""
        return r.seq.params.max_tokens - len(r.seq.output_ids) - 1

    def end_step(self, tokens: int, seconds: float) -> None:
        # a drafting step in which no request drafted a token (no n-gram match, or each at its last
        # token) is a plain step and says nothing about drafts: counted as drafting's, 8 requests
        # ending together made drafts look cheap (the next batch drafted at a loss for 12 steps),
        # and steps without a match diluted what drafts pay at one request; a try lasts until a
        # step that drafted is measured
        if self.row_gate is not None:  # the rows' cost: a first lookup indexes a whole prompt (1 ms a 1,000 tokens)
            self.row_gate.end_step(seconds - self.draft_seconds)
        elif self.gate is not None and (self.drafted_any or not self.drafting):
            if self.drafting:
                self.gate.drafted(self.pending, self.draft_seconds)
            self.gate.end_step(tokens, seconds)

    def generate(self, seq: Sequence) -> dict:
        """Decode one request to completion on an engine of its own (tests, benchmarks); returns its
        speculation stats."""
        from ..engine.engine import Engine

        engine = Engine(self.model, self, kv_cache_memory=len(seq.prompt_ids) + seq.params.max_tokens + self.extra_rows)
        engine.add_request(seq)
        while engine.has_unfinished():
            engine.step()
        if seq.error:
            raise ValueError(seq.error)
        return seq.stats.speculative

    def start(self, r: Running, features: torch.Tensor | None) -> None:
        drafter = self.drafter.fork()
        drafter.begin(r.seq.prompt_ids + [r.last], None if features is None else features[None])
        r.state = SpecState(drafter, SpecStats(self.num_tokens if self.grower is None else self.grower.shape.depth))

    def plan(self, r: Running) -> Segment:
        st, params, model = r.state, r.seq.params, self.model
        st.start = n = r.cache.length
        room = self.room(r) if self.drafting else 0  # no drafts: full depth's row
        last = torch.tensor([r.last], device=model.device)
        if st.plain and room > 0:  # not drafted with the others in begin_step
            t0 = device_time(model.device)
            if self.grower is not None and room >= self.grower.shape.depth:
                st.tree = self.grower.grow(last, st.drafter, [st.drafter])[0]
            if st.tree is None:
                st.draft = st.drafter.draft(min(self.num_tokens, room), params, r.generator, self.width)
            seconds = device_time(model.device) - t0
            st.stats.draft_seconds += seconds
            self.draft_seconds += seconds
        if st.draft is not None and not st.draft.tokens.shape[0]:
            st.draft = None  # an empty chain (no n-gram match): no draft, full depth's row and choice
        if st.plain:  # full depth's own row (FullDepth.plan's, with the tensor made above)
            return Segment(last, r.cache, model.range_inputs(n, 1))
        self.drafted_any = True
        if st.tree is not None:
            return Segment(st.tree.tokens, r.cache, tree_inputs(model, st.tree, n))
        return Segment(torch.cat([last, st.draft.tokens]), r.cache, model.range_inputs(n, st.draft.tokens.shape[0] + 1))

    def takes_argmax(self, r: Running) -> bool:
        return r.state.plain and r.seq.params.greedy

    def choose(self, r: Running, logits: torch.Tensor) -> torch.Tensor:
        st = r.state
        if st.plain:
            return super().choose(r, logits)  # [t_0]
        if st.tree is not None:  # [a, path (D + 1), tokens (D + 1)]
            return accept_tree(st.tree, sample(logits, r.seq.params, r.generator))
        return verify_chain(st.draft.tokens, st.draft.probs, logits, r.seq.params, r.generator)  # [a, t_0..t_k]

    def commit(self, r: Running, verdict: list[int], features: torch.Tensor | None) -> list[int]:
        st, n = r.state, r.state.start
        accepted = 0 if st.plain else verdict[0]
        if st.plain:  # [t_0]
            emitted, drafted = super().commit(r, verdict, features), 0
        elif st.tree is not None:
            D = st.tree.depth
            path = verdict[1 : 2 + accepted]  # tree rows of x_n and the accepted nodes
            compact(r.cache, n, torch.tensor(path, device=self.model.device))
            emitted, drafted = verdict[2 + D :][: accepted + 1], D
            if features is not None:
                features = features[path]
        else:
            r.cache.length = n + accepted + 1  # keep x_n and the accepted drafts; later slots are overwritten
            emitted, drafted = verdict[1 : 2 + accepted], st.draft.tokens.shape[0]
            if features is not None:
                features = features[: accepted + 1]
        st.stats.record(drafted, accepted)
        if self.row_gate is not None and drafted:
            self.row_gate.acceptance.record(st.match, drafted, accepted)
        if st.shadow is not None:
            st.shadow = self.row_gate.follow(st.shadow, emitted)
        st.drafter.commit(emitted, accepted, None if features is None else features[None])
        st.draft = st.tree = None
        return emitted

    def stats(self, r: Running, decode_seconds: float) -> dict | None:
        if r.state is None:
            return None
        return {"method": self.method, "num_speculative_tokens": self.num_tokens,
                "tree": None if self.grower is None else vars(self.grower.shape),
                **r.state.stats.as_dict(decode_seconds)}
