"""Draft-and-verify speculative decoding of one request (chains and EAGLE-2 trees).

One step, top to bottom (`SpeculativeDecoder.step`):
  1. draft: the drafter proposes a chain d_1..d_k (or grows a tree) after the last committed
     token x_n, whose K/V the target has not written yet;
  2. verify: one target pass over [x_n, d_1..d_k] (or the tree rows under a tree mask) gives
     the target's choice after every row (and the features an EAGLE head reads);
  3. accept: the longest prefix of drafts the target agrees with, plus the target's own next
     token (verify.py); one host read per step;
  4. roll back: the target's cache keeps x_n and the accepted drafts (a tree's accepted path is
     moved to consecutive slots), the drafter commits the emitted tokens.
Greedy output equals full-depth greedy; sampled output has the target's distribution.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..clock import StageTimer, device_time
from ..drafters.base import Drafter
from ..engine.full_depth import check_fits
from ..engine.sequence import Sequence
from ..model.kv_cache import KVCache
from ..model.llama import StepInputs, Transformer
from ..sampling import sample
from .tree import TreeGrower, TreeShape, compact, tree_inputs
from .verify import accept_tree, verify_chain


def forward_rows(model: Transformer, tokens: torch.Tensor, step: StepInputs, cache: KVCache,
                 feature_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
    """All target layers over rows tokens [1, S]: final hidden states [1, S, H] and the outputs of
    `feature_layers` concatenated in that order ([1, S, W]; None without feature layers)."""
    h = model.embed(tokens)
    wanted = set(feature_layers)
    kept: dict[int, torch.Tensor] = {}
    for i in range(model.cfg.num_layers):
        h = model.layer(i, h, step, cache)
        if i in wanted:
            kept[i] = h
    return h, (torch.cat([kept[i] for i in feature_layers], dim=-1) if feature_layers else None)


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


class SpeculativeDecoder:
    """Decodes one request at a time with `drafter`; chains of `num_tokens`, or trees of `tree`."""

    def __init__(self, model: Transformer, drafter: Drafter, num_tokens: int, tree: TreeShape | None = None,
                 method: str = ""):
        self.model, self.drafter, self.num_tokens, self.method = model, drafter, num_tokens, method
        self.grower = None if tree is None else TreeGrower(tree, model.device)
        self.extra_rows = num_tokens + 1 if tree is None else tree.size + 1
        self.width = model.cfg.vocab_size

    def generate(self, seq: Sequence) -> SpecStats:
        """Decode `seq` to completion."""
        for _ in self.steps(seq):
            pass
        return self.stats

    @torch.inference_mode()
    def steps(self, seq: Sequence) -> Iterator[None]:
        """Decode `seq`, yielding after each draft-verify round (the caller reads the sequence)."""
        model, params, drafter = self.model, seq.params, self.drafter
        check_fits(model, len(seq.prompt_ids), params.max_tokens)
        self.seq = seq
        self.cache = model.new_cache(1, len(seq.prompt_ids) + params.max_tokens + self.extra_rows)
        self.generator = params.make_generator(model.device)
        self.stats = SpecStats(self.num_tokens if self.grower is None else self.grower.shape.depth)
        P = len(seq.prompt_ids)
        t0 = device_time(model.device)
        h, feats = forward_rows(model, torch.tensor([seq.prompt_ids], device=model.device),
                                model.range_inputs(0, P), self.cache, drafter.feature_layers)
        self.cache.length = P
        last = sample(model.logits(h[:, -1]), params, self.generator)  # [1]: x_n, the next row
        first = int(last)
        drafter.begin(seq.prompt_ids + [first], feats)
        t1 = device_time(model.device)
        timer = self.timer = StageTimer(model.device)
        try:
            self.emit([first])
            yield
            while not seq.finished:
                last = self.step(last)
                yield
        finally:  # also when the caller stops early (a closed stream)
            seq.stats.prefill_seconds = t1 - t0
            seq.stats.decode_seconds = device_time(model.device) - t1
            self.stats.draft_seconds = timer.seconds("draft")
            seq.stats.decode_tokens = max(len(seq.output_ids) - 1, 0)  # the first token came from the prefill
            seq.stats.speculative = {"method": self.method, "num_speculative_tokens": self.num_tokens,
                                     "tree": None if self.grower is None else vars(self.grower.shape),
                                     **self.stats.as_dict(seq.stats.decode_seconds)}

    def step(self, last: torch.Tensor) -> torch.Tensor:
        """One draft -> verify -> accept round after the committed token `last` ([1], at slot n);
        returns the new last committed token (a view of the verdict, still on the device)."""
        model, params, cache, drafter = self.model, self.seq.params, self.cache, self.drafter
        n = cache.length
        room = params.max_tokens - len(self.seq.output_ids) - 1  # drafts beyond this could not be emitted
        t = self.timer.start()
        tree = None
        if self.grower is not None and room >= self.grower.shape.depth:
            tree = self.grower.grow(last, drafter)
        if tree is None:
            draft = drafter.draft(min(self.num_tokens, room), params, self.generator, self.width)
        self.timer.stop("draft", t)

        if tree is not None:
            h, feats = forward_rows(model, tree.tokens[None, :], tree_inputs(model, tree, n), cache,
                                    drafter.feature_layers)
            verdict = accept_tree(tree, sample(model.logits(h[0]), params, self.generator))
            D = tree.depth
            accepted, *rest = verdict.tolist()  # the step's one host read: [a, path (D + 1), tokens (D + 1)]
            emitted = rest[D + 1 :][: accepted + 1]
            path = verdict[1 : 2 + accepted]  # tree rows of x_n and the accepted nodes
            compact(cache, n, path)
            drafted, new_last = D, verdict[2 + D + accepted : 3 + D + accepted]
            if feats is not None:
                feats = feats[:, path]
        else:
            k = draft.tokens.shape[0]
            rows = torch.cat([last, draft.tokens])[None, :]
            h, feats = forward_rows(model, rows, model.range_inputs(n, k + 1), cache, drafter.feature_layers)
            logits = model.logits(h[0])  # [k + 1, V]
            verdict = verify_chain(draft.tokens, draft.probs, logits, params, self.generator)
            accepted, *tokens = verdict.tolist()  # the step's one host read
            emitted = tokens[: accepted + 1]
            cache.length = n + accepted + 1  # keep x_n and the accepted drafts; later slots are overwritten
            drafted, new_last = k, verdict[1 + accepted : 2 + accepted]
            if feats is not None:
                feats = feats[:, : accepted + 1]
        self.stats.record(drafted, accepted)
        drafter.commit(emitted, accepted, feats)
        self.emit(emitted)
        return new_last

    def emit(self, tokens: list[int]) -> None:
        for token in tokens:
            self.seq.append(token)
            if self.seq.finished:
                return
