"""Speculative early exit (SpecEE) as a decoding of the engine (engine/decoding.py).

Per request and step:
  1. plan: the request's drafter proposes its speculative tokens (and, with `num_draft_tokens`, a
     draft chain verified in the same pass: SpecEE's exits inside speculative decoding); its
     segment is [x_n, d_1..d_m] with early exit's hooks (`ExitPass`). The request's two-level
     schedule (exit/scheduler.py) says after which layers its predictors are asked;
  2. the runner's forward (engine/runner.py): carried rows join at the layers they resume from and
     skip's holes mask each layer (exit/kv_policy.py); after a checked layer the exit controller
     (exit/controller.py) decides whether the request's token is settled: **this is where a token
     exits**. The request then leaves the forward; the others run on;
  3. choose: a request that ran every layer gets its verdict from the final logits (the accepted
     drafts and the next token; in lossless mode also the full model's judgement of the tokens its
     carried rows emitted earlier, exit/lossless.py);
  4. commit: the tokens are emitted (lossless mode holds exited ones until verified, and rolls back
     at a wrong one), the cache keeps x_n and the accepted drafts (a length change), the drafter
     and the schedule learn.
Each request has its own drafter, schedule, predictors' state and KV policy over its own cache, so
its output depends only on the request and the model, whatever it is batched with.
"""
from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field

import torch

from ..clock import StageTimer
from ..drafters.base import Draft, Drafter
from ..exit.bank import PredictorBank
from ..exit.config import EarlyExitConfig
from ..exit.controller import ExitController, ExitHit
from ..exit.kv_policy import POLICY_CLASSES, KVPolicy, Pending, join_rows
from ..exit.lossless import LosslessVerifier
from ..exit.scheduler import ExitPayoff, TwoLevelScheduler
from ..exit.stats import ExitStats
from ..model.llama import Transformer
from ..model.step_inputs import StepInputs
from ..speculative.speculative import SpecStats
from ..speculative.verify import verify_chain
from .decoding import FullDepth
from .runner import Segment
from .scheduler import FIRST_ROOM, Running
from .sequence import Sequence
from .teacher import TeacherForcedStep, TeacherForcing


@dataclass
class ExitState:
    """A request's early exit: its drafter, schedule, predictors, KV policy, history (prompt +
    emitted tokens, verified or not), lossless verifier and stats; and this step's pass."""

    drafter: Drafter
    scheduler: TwoLevelScheduler
    exit: ExitController
    kv: KVPolicy
    history: list[int]
    stats: ExitStats
    timer: StageTimer
    verifier: LosslessVerifier | None = None
    spec: SpecStats | None = None
    teacher: TeacherForcing | None = None
    step: "ExitPass | None" = None

    @property
    def unverified(self) -> list:
        return self.verifier.unverified if self.verifier else []

    @property
    def cache(self):
        return self.kv.cache


@dataclass
class ExitPass:
    """One request's pass through a step's forward (the runner's LayerHooks): rows [x_n, drafts] at
    slots n..n+R-1, carried rows joining by resume layer, the layers checked."""

    state: ExitState
    n: int
    R: int
    draft: Draft
    checks: list[bool] | None  # None: no layer is checked (a forced full-depth pass, or a flush)
    waiting: list[Pending]
    forced: bool
    active: list[int] = field(default_factory=list)  # the slots of the segment's rows, in order
    hit: ExitHit | None = None
    events: tuple[set[int], set[int]] = field(init=False)

    def __post_init__(self) -> None:
        self.active = list(range(self.n, self.n + self.R))
        joins = {p.resume for p in self.waiting}
        L = len(self.state.exit.thresholds)
        before = set(range(L)) if self.state.kv.masks_layers else joins
        self.events = (before, {i for i, on in enumerate(self.checks or ()) if on})

    def before_layer(self, i: int, h: torch.Tensor, step: StepInputs) -> tuple[torch.Tensor, StepInputs]:
        model = self.state.kv.model
        if self.waiting and self.waiting[0].resume == i:
            h, self.active = join_rows(self.waiting, i, h if h.shape[1] else None, self.active)
            step = model.range_inputs(self.active[0], len(self.active))
        if self.state.kv.masks_layers:
            step = self.state.kv.layer_inputs(i, step, self.n)
        return h, step

    def after_layer(self, i: int, h_in: torch.Tensor, h: torch.Tensor) -> Generator[torch.Tensor, list[int], bool]:
        """Whether the request's token leaves after layer i: the exit controller decides, with the
        device reads it yields (the runner serves every request's at once)."""
        st, R = self.state, self.R
        hit = yield from st.exit.check(i, h_in[0, -R:], h[0, -R:])
        st.scheduler.observe(i, hit is not None)
        if hit is None:
            return False
        st.stats.exits_accepted += 1
        kept = len(self.active) - R + len(hit.tokens)  # carried rows, x_n and the accepted drafts
        st.kv.after_exit(i, h[:, :kept], self.active[:kept])
        self.hit = hit
        return True


class EarlyExitDecoding(FullDepth):
    """Early exit with `drafter`'s speculative tokens and `bank`'s predictors, as `config` says.
    exits: makes each request's exit controller (tests inject exit.controller.ForcedExits)."""

    def __init__(self, model: Transformer, drafter: Drafter, bank: PredictorBank, config: EarlyExitConfig,
                 exits: Callable[[], ExitController] | None = None):
        if bank.k != drafter.k:
            raise ValueError(f"predictor bank was trained with k={bank.k} speculative tokens, drafter gives k={drafter.k}")
        if bank.num_layers != model.cfg.num_layers:
            raise ValueError(f"predictor bank has {bank.num_layers} layers, model has {model.cfg.num_layers}")
        super().__init__(model)
        self.drafter, self.config = drafter, config
        self.bank = bank.to(model.device, torch.float32)  # features and MLPs run in float32 (exit/features.py)
        self.thresholds = config.thresholds(bank)
        offline = bank.offline_layers if config.offline_size is None else bank.ranked_layers[: config.offline_size]
        self.offline_layers = list(offline)
        self.prior = ExitPayoff.prior_from(bank.summary, model.cfg.num_layers)
        self.make_exits = exits or (lambda: ExitController(model, self.bank, self.thresholds))
        self.extra_rows = config.num_draft_tokens + 1
        self.lossless = config.mode == "lossless"
        self.overrides: dict[str, tuple] = {}  # request id -> (exits, teacher) of `generate` / `teacher_forced`

    # ---- one request on an engine of its own (tests, the quality benchmark) -----------------------
    def generate(self, seqs: Sequence | list[Sequence],
                 exits: Callable[[], ExitController] | list[Callable[[], ExitController]] | None = None,
                 teacher: TeacherForcing | None = None) -> ExitState | list[ExitState]:
        """Decode `seqs` to completion, batched; returns each request's ExitState (one, for one).
        exits: the maker of every request's exit controller, or one maker per request."""
        from .engine import Engine

        batch = [seqs] if isinstance(seqs, Sequence) else seqs
        makers = exits if isinstance(exits, list) else [exits] * len(batch)
        states: dict[str, ExitState] = {}
        for s, make in zip(batch, makers):
            self.overrides[s.request_id] = (make, teacher, states)
        engine = Engine(self.model, self, kv_cache_memory=sum(len(s.prompt_ids) + s.params.max_tokens
                                                              + self.extra_rows + 16 for s in batch))
        for s in batch:
            engine.add_request(s)
        while engine.has_unfinished():
            engine.step()
        for s in batch:
            if s.error:
                raise ValueError(s.error)
        out = [states[s.request_id] for s in batch]
        return out[0] if isinstance(seqs, Sequence) else out

    def teacher_forced(self, seq: Sequence, continuation: list[int]) -> list[TeacherForcedStep]:
        """What early exit would emit at each position of a fixed continuation (and the
        log-probability of the given token under the distribution it used), fed the given token."""
        if self.lossless:
            raise ValueError("teacher forcing measures lossy early exit; lossless mode is exact by construction")
        teacher = TeacherForcing(continuation)
        self.generate(seq, teacher=teacher)
        return teacher.records

    # ---- the decoding ---------------------------------------------------------------------
    def prefill_length(self, seq: Sequence) -> int:
        """Lossy: all but the last prompt token, whose pass is the first early-exit pass (the first
        token can exit too: it is all a multiple-choice answer has). Lossless: the whole prompt, so
        its first token and every K/V entry are full depth's own (a shorter prefill rounds
        differently, which parted lossless from full depth at near-ties)."""
        return len(seq.prompt_ids) - (0 if self.lossless else 1)

    def start(self, r: Running, features: torch.Tensor | None) -> None:
        c, model = self.config, self.model
        exits, teacher, states = self.overrides.pop(r.seq.request_id, (None, None, None))
        drafter = self.drafter.fork()
        # a draft model's cache: the prompt and the first tokens the target's run holds; it doubles as it fills
        # (sized for max_tokens, 7 server requests without max_tokens held 2,047 slots each outside the pool)
        drafter.reset(r.seq.prompt_ids, min(r.seq.params.max_tokens, FIRST_ROOM))
        payoff = ExitPayoff(model.cfg.num_layers, c.check_cost, self.prior)
        scheduler = TwoLevelScheduler(model.cfg.num_layers, self.offline_layers, self.thresholds,
                                      c.online_window, c.online_radius, payoff)
        r.state = st = ExitState(drafter, scheduler, (exits or self.make_exits)(),
                                 POLICY_CLASSES[c.kv_policy](model, r.cache, model.range_inputs),
                                 list(r.seq.prompt_ids), ExitStats(model.cfg.num_layers), StageTimer(model.device),
                                 spec=SpecStats(c.num_draft_tokens) if c.num_draft_tokens else None, teacher=teacher)
        if self.lossless:
            st.verifier = LosslessVerifier(st, model.cfg.num_layers)
            r.cache.filled[:, :, : len(r.seq.prompt_ids)] = True
            st.history.append(r.last)
            self.count(st, model.cfg.num_layers - 1)
        else:
            r.cache.filled[:, :, : len(r.seq.prompt_ids) - 1] = True
        if states is not None:
            states[r.seq.request_id] = st

    def plan(self, r: Running) -> Segment:
        st, model, c = r.state, self.model, self.config
        n = len(st.history) - 1  # the slot of the last emitted token, whose K/V this pass writes
        if self.flushing(r):  # complete the carried rows without a new token, to verify the last ones
            waiting = st.kv.begin_step(n + 1, 0)
            st.step = ExitPass(st, n + 1, 0, Draft(model.slot_ids[:0]), None, waiting, True)
            st.stats.deep_passes += 1
            return Segment(model.slot_ids[:0], r.cache, model.range_inputs(n + 1, 1), st.step)
        owed = len(st.unverified) if st.verifier else len(st.kv.pending)
        forced = owed >= c.max_pending  # this pass runs every layer
        st.stats.forced_full += forced
        check = st.exit.layers(st.scheduler)
        checking = not forced and True in check  # else no candidates are needed (a draft model's extra step)
        t = st.timer.start()
        draft = self.draft(r, checking)
        st.timer.stop("drafter", t)
        R = draft.tokens.shape[0] + 1
        waiting = st.kv.begin_step(n, R)  # carried rows, joined at their resume layers (older slots first)
        st.step = ExitPass(st, n, R, draft, check if checking else None, waiting, forced)
        r.cache.length = n + R
        tokens = torch.cat([model.slot_ids.new_tensor(st.history[-1:]), draft.tokens])
        return Segment(tokens, r.cache, model.range_inputs(n, R), st.step)

    def flushing(self, r: Running) -> bool:
        """Whether the unverified tokens already reach the request's end (lossless): an EOS, or max_tokens."""
        st, params = r.state, r.seq.params
        if not st.unverified:
            return False
        at_eos = st.unverified[-1].token in r.seq.eos_ids and not params.ignore_eos
        return at_eos or len(r.seq.output_ids) + len(st.unverified) >= params.max_tokens

    def draft(self, r: Running, checking: bool) -> Draft:
        """The pass's draft chain (none without speculation); when a layer will be checked, every
        row's speculative tokens go to the exit controller."""
        st, params = r.state, r.seq.params
        if len(st.drafter.history) < len(st.history):  # the drafter lags by the tokens emitted since it drafted
            st.drafter.extend(st.history[len(st.drafter.history):])
        room = params.max_tokens - len(r.seq.output_ids) - len(st.unverified) - 1
        n = min(self.config.num_draft_tokens, room)
        draft = (Draft(self.model.slot_ids[:0]) if n <= 0
                 else st.drafter.draft(n, params, r.generator, self.model.cfg.vocab_size))
        if checking:
            candidates = st.drafter.propose()[None] if n <= 0 else st.drafter.row_candidates(draft)
            st.exit.begin_pass(candidates, draft.tokens, len(st.history) - len(r.seq.prompt_ids))
        return draft

    def picks(self, r: Running, rows: int) -> range:
        """Rows whose final logits the verdict needs: lossless, the carried rows too (they verify)."""
        return range(rows) if self.lossless else range(rows - r.state.step.R, rows)

    def takes_argmax(self, r: Running) -> bool:
        return False  # its verdict also judges carried rows or comes from an exit

    def choose(self, r: Running, logits: torch.Tensor | None) -> torch.Tensor | list[int]:
        """Exited: [a, tokens...] already read by the controller. Full depth: the carried rows'
        judgements (lossless), then the chain's verdict [a, t_0..t_m]."""
        st, p = r.state, r.state.step
        if p.hit is not None:
            return [len(p.hit.tokens) - 1, *p.hit.tokens]
        carried = logits.shape[0] - p.R  # lossless: the rows that completed and verify
        judged = st.verifier.judge(logits[:carried], r.seq.params, r.generator) if carried else None
        own = logits[carried:]
        if st.teacher is not None:
            st.teacher.logits = own
        if p.R == 0:
            return judged
        verdict = verify_chain(p.draft.tokens, p.draft.probs, own, r.seq.params, r.generator)
        return verdict if judged is None else torch.cat([judged, verdict])

    def commit(self, r: Running, verdict: list[int], features: torch.Tensor | None) -> list[int]:
        st, p, L = r.state, r.state.step, self.model.cfg.num_layers
        emitted: list[int] = []
        if p.hit is None:
            st.kv.after_full_depth(p.active)
            if st.verifier is not None:
                carried = len(p.active) - p.R
                st.stats.deep_passes += carried > 0 and p.R > 0
                emitted, ok = st.verifier.settle(verdict, carried, at_bound=p.forced or p.R == 0)
                if not ok or p.R == 0:
                    return emitted
                verdict = verdict[carried:]
        if p.R == 0:
            return emitted
        accepted, tokens = verdict[0], verdict[1 : 2 + verdict[0]]
        layer = L - 1 if p.hit is None else p.hit.layer
        if st.teacher is not None:
            tokens = self.teach(r, tokens, layer)
        r.cache.length = p.n + len(tokens)
        count = len(tokens)
        for j, token in enumerate(tokens):
            st.history.append(token)
            self.count(st, layer)
            if st.verifier is not None and layer < L - 1:
                st.verifier.hold(token, layer)
            else:
                emitted.append(token)
            if token in r.seq.eos_ids and not r.seq.params.ignore_eos:
                count = j + 1
                break
        matched = min(len(tokens) - 1, count, accepted)  # accepted drafts among the emitted tokens
        if st.spec is not None:
            st.spec.record(p.R - 1, matched)
        if p.R > 1:
            st.drafter.commit(tokens[:count], matched)
        return emitted

    @staticmethod
    def count(st: ExitState, layer: int) -> None:
        st.stats.exit_histogram[layer] += 1
        st.scheduler.record(layer)

    def teach(self, r: Running, tokens: list[int], layer: int) -> list[int]:
        """A teacher's continuation replaces the pass's tokens from their first difference."""
        st, p = r.state, r.state.step
        logits = p.hit.logits if p.hit is not None else st.teacher.logits
        base = len(st.history) - len(r.seq.prompt_ids)
        for j, token in enumerate(tokens):
            target = st.teacher(base + j, token, layer, logits[j : j + 1])
            if target != token:
                return tokens[:j] + [target]
        return tokens

    def stats(self, r: Running, decode_seconds: float) -> dict | None:
        """The request's exit stats (and speculation's, with a draft chain); they go to
        `RequestStats.early_exit` / `.speculative` (the engine files the speculative part)."""
        st, c = r.state, self.config
        if st is None:
            return None
        s, e = st.stats, st.exit
        s.predictor_calls, s.exits_rejected = e.predictor_calls, e.rejected
        s.drafter_seconds = st.timer.seconds("drafter")
        s.predictor_seconds, s.verify_seconds = e.timer.seconds("predictors"), e.timer.seconds("verification")
        r.seq.stats.early_exit = {**s.as_dict(decode_seconds, st.verifier is not None), "kv_policy": c.kv_policy,
                                  "mode": c.mode, "offline_layers": self.offline_layers,
                                  "online_window": c.online_window, "online_radius": c.online_radius}
        if st.spec is None:
            return None
        st.spec.draft_seconds = s.drafter_seconds
        method = "ngram" if self.drafter.fingerprint.startswith("ngram") else "draft_model"
        return {"method": method, "num_speculative_tokens": c.num_draft_tokens, **st.spec.as_dict(decode_seconds)}
