"""Speculative early-exit decoding (SpecEE) of one request: the decode loop.

Per pass: the drafter proposes k speculative tokens for each row; the layers run one by one,
and after each scheduled layer the exit controller decides whether the pass leaves there
(exit/controller.py). A pass is one row (the last token: one-token early exit) or, with
`num_draft_tokens`, the last token and a drafted chain verified in the same pass (SpecEE's
exits inside speculative decoding); the accepted drafts and the next token come from the
exit layer's argmax, or the last layer's. The KV policy (exit/kv_policy.py: skip, propagate,
recompute) decides what the skipped layers' cache holds and which carried rows join the pass.
In lossless mode (recompute), rows that complete the last layer verify the tokens emitted
before them, and a wrong one is rolled back (exit/lossless.py).
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch

from ..clock import StageTimer, device_time
from ..drafters.base import Draft, Drafter
from ..exit.bank import PredictorBank
from ..exit.controller import ExitController
from ..exit.kv_policy import POLICY_CLASSES, join_rows
from ..exit.lossless import LosslessVerifier
from ..exit.scheduler import ExitPayoff, TwoLevelScheduler
from ..exit.stats import ExitStats
from ..model.llama import Transformer
from ..sampling import probabilities
from ..spec.speculative import SpecStats
from ..spec.verify import verify_chain
from .full_depth import check_fits, prefill
from .sequence import Sequence

KVPolicyName = Literal["skip", "propagate", "recompute"]
KV_POLICIES = tuple(POLICY_CLASSES)


@dataclass(frozen=True)
class EarlyExitConfig:
    """How early exit runs. `bank`/`draft` name files; the LLM resolves them.

    draft: a draft model directory, or "ngram" for the training-free prompt-lookup drafter.
    bank: a predictor bank directory; None calibrates one (and caches it) on first use.
    max_pending: most carried rows (recompute) or unverified positions (lossless) before a
    forced full-depth step; threshold_scale multiplies the bank's thresholds' distance from 1
    (above 1 = lower thresholds, more exits; below 1 = fewer), for sweeps. num_draft_tokens:
    0 decodes one token per pass; N > 0 drafts N tokens with the same drafter and verifies them
    in the pass (speculative decoding with exits; `LLM` sets it from `speculative_config`).
    check_cost: a predictor check's cost in target-layer equivalents (measured in the decode loop on
    CPU: 0.18-0.34 on SmolLM2-135M, 0.19-0.31 on Qwen2.5-Coder-1.5B, 0.41-0.51 on the reference
    model); a scheduled layer whose exits save less per check stops being checked
    (exit/scheduler.py ExitPayoff); 0 checks every scheduled layer.
    """

    draft: str | None = None
    bank: str | None = None
    k: int = 4
    kv_policy: KVPolicyName = "recompute"
    mode: Literal["lossy", "lossless"] = "lossy"
    offline_size: int | None = None
    online_window: int = 4
    online_radius: int = 1
    max_pending: int = 8
    threshold_scale: float = 1.0
    num_draft_tokens: int = 0
    check_cost: float = 0.2

    def __post_init__(self) -> None:
        if self.kv_policy not in KV_POLICIES:
            raise ValueError(f"kv_policy must be one of {', '.join(KV_POLICIES)}, got {self.kv_policy!r}")
        if self.mode not in ("lossy", "lossless"):
            raise ValueError(f"mode must be 'lossy' or 'lossless', got {self.mode!r}")
        if self.mode == "lossless" and self.kv_policy != "recompute":
            raise ValueError("lossless mode needs kv_policy='recompute' (the carried rows are what verifies)")
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")
        if self.max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {self.max_pending}")
        if self.threshold_scale <= 0:
            raise ValueError(f"threshold_scale must be > 0, got {self.threshold_scale}")
        if self.num_draft_tokens < 0:
            raise ValueError(f"num_draft_tokens must be >= 0, got {self.num_draft_tokens}")
        if not self.check_cost >= 0:
            raise ValueError(f"check_cost must be >= 0, got {self.check_cost}")

    def thresholds(self, bank: PredictorBank) -> list[float]:
        return [1.0 - (1.0 - t) * self.threshold_scale if t != float("inf") else t for t in bank.thresholds]


@dataclass
class TeacherForcedStep:
    predicted: int  # what early exit emitted at this position
    target: int  # the token fed instead (the full model's, for agreement)
    exit_layer: int
    logprob: float  # log-probability of `target` under the distribution early exit used


class TeacherForcing:
    """A token source for DecodeRun: note what early exit chose, feed the given continuation instead."""

    def __init__(self, continuation: list[int]):
        self.continuation, self.records = continuation, []

    def __call__(self, index: int, predicted: int, exit_layer: int, logits: torch.Tensor) -> int:
        target = self.continuation[index]
        logprob = float(torch.log_softmax(logits[-1].float(), dim=-1)[target])
        self.records.append(TeacherForcedStep(predicted, target, exit_layer, logprob))
        return target


class EarlyExitDecoder:
    """Decodes one request at a time; built once per (model, drafter, bank, config)."""

    def __init__(self, model: Transformer, drafter: Drafter, bank: PredictorBank, config: EarlyExitConfig):
        if bank.k != drafter.k:
            raise ValueError(f"predictor bank was trained with k={bank.k} speculative tokens, drafter gives k={drafter.k}")
        if bank.num_layers != model.cfg.num_layers:
            raise ValueError(f"predictor bank has {bank.num_layers} layers, model has {model.cfg.num_layers}")
        self.model, self.drafter, self.config = model, drafter, config
        self.bank = bank.to(model.device, torch.float32)  # features and MLPs run in float32 (exit/features.py)
        self.thresholds = config.thresholds(bank)
        offline = bank.offline_layers if config.offline_size is None else bank.ranked_layers[: config.offline_size]
        self.offline_layers = list(offline)
        L = model.cfg.num_layers
        # shared by the requests this decoder serves: what paid in one pass is the best guess for the next
        self.payoff = ExitPayoff(L, config.check_cost, ExitPayoff.prior_from(bank.summary, L))

    def new_scheduler(self) -> TwoLevelScheduler:
        c = self.config
        return TwoLevelScheduler(self.model.cfg.num_layers, self.offline_layers, self.thresholds,
                                 c.online_window, c.online_radius, self.payoff)

    def generate(self, seq: Sequence, exits: ExitController | None = None) -> "DecodeRun":
        """Decode `seq` to completion; returns the run (its cache and stats, for inspection).
        `exits` replaces the predictors (tests inject exit.controller.ForcedExits)."""
        run = DecodeRun(self, seq, exits)
        for _ in run.steps():
            pass
        return run

    def steps(self, seq: Sequence) -> Iterator[None]:
        """Decode `seq`, yielding after each step (the caller reads the sequence)."""
        return DecodeRun(self, seq).steps()

    @torch.inference_mode()
    def teacher_forced(self, seq: Sequence, continuation: list[int],
                       exits: ExitController | None = None) -> list[TeacherForcedStep]:
        """Run early exit over a fixed continuation: at each position record what early exit would
        have emitted (and the log-probability of the given token under the distribution it used),
        then feed the given token. `seq` must be greedy with max_tokens == len(continuation)."""
        if self.config.mode == "lossless":
            raise ValueError("teacher forcing measures lossy early exit; lossless mode is exact by construction")
        teacher = TeacherForcing(continuation)
        for _ in DecodeRun(self, seq, exits, teacher).steps():
            pass
        return teacher.records


class DecodeRun:
    """The state of one request's decode: cache, KV policy, exit controller, unverified tokens, stats."""

    def __init__(self, dec: EarlyExitDecoder, seq: Sequence, exits: ExitController | None = None,
                 teacher: TeacherForcing | None = None):
        self.dec, self.seq, self.teacher = dec, seq, teacher
        self.model, self.drafter, self.num_layers = dec.model, dec.drafter, dec.model.cfg.num_layers
        self.params = seq.params
        self.generator = self.params.make_generator(self.model.device)
        self.stats = ExitStats(self.num_layers)
        self.spec_stats = SpecStats(dec.config.num_draft_tokens) if dec.config.num_draft_tokens else None
        self.timer = StageTimer(self.model.device)  # the drafter's share
        self.scheduler = dec.new_scheduler()
        self.exit = exits or ExitController(self.model, dec.bank, dec.thresholds)
        self.verifier = LosslessVerifier(self) if dec.config.mode == "lossless" else None
        self.history: list[int] = list(seq.prompt_ids)  # prompt + emitted (verified or not)
        self.next_ids: torch.Tensor | None = None  # history[-1] on the device, when it came from there
        self.no_draft = Draft(torch.empty(0, dtype=torch.long, device=self.model.device))

    @property
    def unverified(self) -> list:
        return self.verifier.unverified if self.verifier else []

    def emit(self, token: int, exit_layer: int, ids: torch.Tensor | None = None,
             draft_probs: torch.Tensor | None = None) -> None:
        """Append the next token (ids: the same on device, when at hand); unverified if it exited
        in lossless mode."""
        self.history.append(token)
        self.next_ids = None if ids is None else ids.view(1, 1)  # None: built from history[-1] when needed
        self.stats.exit_histogram[exit_layer] += 1
        self.scheduler.record(exit_layer)
        if self.verifier is not None and exit_layer < self.num_layers - 1:
            self.verifier.hold(token, exit_layer, draft_probs)
        else:
            self.seq.append(token)

    def done(self) -> bool:
        if self.seq.finished:
            return True
        if not self.unverified:
            return False
        # unverified tokens count toward the limits; the final flush settles them
        last = self.unverified[-1].token
        at_eos = last in self.seq.eos_ids and not self.params.ignore_eos
        return at_eos or len(self.seq.output_ids) + len(self.unverified) >= self.params.max_tokens

    # ---- the request ----------------------------------------------------------------------
    @torch.inference_mode()
    def steps(self) -> Iterator[None]:
        """Decode the request, yielding after each pass or flush."""
        seq, model = self.seq, self.model
        check_fits(model, len(seq.prompt_ids), self.params.max_tokens)
        extra = self.dec.config.num_draft_tokens + 1
        self.cache = model.new_cache(1, len(seq.prompt_ids) + self.params.max_tokens + extra)
        self.kv = POLICY_CLASSES[self.dec.config.kv_policy](model, self.cache)
        t0 = device_time(model.device)
        # All but the last prompt token at full depth; the last one is the first early-exit pass,
        # so the first generated token can exit too (it is all a multiple-choice answer has).
        if len(seq.prompt_ids) > 1:
            prefill(model, self.cache, [seq.prompt_ids[:-1]])
        self.drafter.reset(seq.prompt_ids, self.params.max_tokens)  # sizes a draft model's cache
        t1 = device_time(model.device)
        try:
            while True:
                if self.done():
                    if not self.unverified or not self.flush():
                        break
                    yield
                    continue
                self.step()
                yield
        finally:  # also when the caller stops early (a closed stream)
            seq.stats.prefill_seconds = t1 - t0
            seq.stats.decode_seconds = device_time(model.device) - t1
            seq.stats.decode_tokens = len(seq.output_ids)  # the first token came from a decode pass too
            s, e = self.stats, self.exit
            s.predictor_calls, s.exits_rejected = e.predictor_calls, e.rejected
            s.drafter_seconds = self.timer.seconds("drafter")
            s.predictor_seconds, s.verify_seconds = e.timer.seconds("predictors"), e.timer.seconds("verification")
            seq.stats.early_exit = s.as_dict(seq.stats.decode_seconds, self.verifier is not None)
            c = self.dec.config
            seq.stats.early_exit.update(kv_policy=c.kv_policy, mode=c.mode, offline_layers=self.dec.offline_layers,
                                        online_window=c.online_window, online_radius=c.online_radius)
            if self.spec_stats is not None:
                self.spec_stats.draft_seconds = s.drafter_seconds
                method = "ngram" if self.drafter.fingerprint.startswith("ngram") else "draft_model"
                seq.stats.speculative = {"method": method, "num_speculative_tokens": c.num_draft_tokens,
                                         **self.spec_stats.as_dict(seq.stats.decode_seconds)}

    def draft(self, checking: bool) -> Draft:
        """The pass's draft chain (none without speculation); when a layer will be checked, every
        row's speculative tokens go to the exit controller."""
        drafter = self.drafter
        if len(drafter.history) < len(self.history):  # the drafter lags by the tokens emitted since
            drafter.extend(self.history[len(drafter.history):])
        room = self.params.max_tokens - len(self.seq.output_ids) - len(self.unverified) - 1
        n = min(self.dec.config.num_draft_tokens, room)
        draft = self.no_draft if n <= 0 else drafter.draft(n, self.params, self.generator, self.model.cfg.vocab_size)
        if checking:
            candidates = drafter.propose()[None] if n <= 0 else drafter.row_candidates(draft)
            self.exit.begin_pass(candidates, draft.tokens, len(self.history) - len(self.seq.prompt_ids))
        return draft

    def step(self) -> None:
        """Feed the last emitted token (at slot n) and the drafts after it through the model until
        the pass exits; emit the accepted drafts and the next token."""
        model, stats, L = self.model, self.stats, self.num_layers
        n = len(self.history) - 1
        owed = len(self.unverified) if self.verifier else len(self.kv.pending)
        forced = owed >= self.dec.config.max_pending  # this pass runs every layer
        stats.forced_full += forced
        check = self.exit.layers(self.scheduler)
        checking = not forced and True in check  # else no candidates are needed (a draft model's extra step)
        t = self.timer.start()
        draft = self.draft(checking)
        R = draft.tokens.shape[0] + 1  # the pass's own rows: x_n and its drafts
        self.timer.stop("drafter", t)

        waiting = self.kv.begin_step(n, R)  # carried rows, joined at their resume layers (older slots first)
        active = list(range(n, n + R))
        if self.next_ids is None:
            self.next_ids = torch.tensor([self.history[-1:]], device=model.device)
        h = model.embed(self.next_ids if R == 1 else torch.cat([self.next_ids.view(1), draft.tokens]).view(1, R))
        step_in = model.range_inputs(n, R)
        self.cache.length = n + R
        masked = self.kv.masks_layers
        for i in range(L):
            if waiting and waiting[0].resume == i:
                h, active = join_rows(waiting, i, h, active)
                step_in = model.range_inputs(active[0], len(active))
            if masked:
                step_in = self.kv.layer_inputs(i, step_in, n)
            h_in, h = h, model.layer(i, h, step_in, self.cache)
            if not checking or not check[i]:
                continue
            hit = self.exit.try_exit(i, h_in[0, -R:], h[0, -R:])
            self.scheduler.observe(i, hit is not None)
            if hit is not None:
                stats.exits_accepted += 1
                tokens, ids = self.choose(hit.logits, draft, i, hit.tokens, hit.ids)
                kept = len(active) - R + len(tokens)  # carried rows, x_n and the accepted drafts
                self.kv.after_exit(i, h[:, :kept], active[:kept], model.range_inputs(active[0], kept))
                self.cache.length = n + len(tokens)
                self.emit_pass(tokens, ids, i, hit.logits, R - 1)
                return
        self.kv.after_full_depth(active)
        if self.verifier is not None:  # the carried rows verify what they emitted
            logits = model.logits(h[0])  # [rows, V]
            stats.deep_passes += len(active) > R
            if not self.verifier.verify(active[:-R], logits[:-R], at_bound=forced):
                return
            logits = logits[-R:]
        else:
            logits = model.logits(h[0, -R:])
        tokens, ids = self.choose(logits, draft, L - 1)
        self.cache.length = n + len(tokens)
        self.emit_pass(tokens, ids, L - 1, logits, R - 1)

    def choose(self, logits: torch.Tensor, draft: Draft, layer: int, greedy_tokens: list[int] | None = None,
               greedy_ids: torch.Tensor | None = None) -> tuple[list[int], torch.Tensor | None]:
        """The tokens a pass leaving after `layer` emits from its rows' logits [r, V] (the accepted
        drafts and the next token; one host read) and the last one on the device. greedy_tokens:
        already decided (an exit's argmaxes). A teacher's continuation replaces them from its
        first difference."""
        if greedy_tokens is not None and self.params.greedy:
            tokens, ids = greedy_tokens, greedy_ids
        else:
            verdict = verify_chain(draft.tokens, draft.probs, logits, self.params, self.generator)
            accepted, *rest = verdict.tolist()
            tokens, ids = rest[: accepted + 1], verdict[1 + accepted : 2 + accepted]
        if self.teacher is not None:
            base = len(self.history) - len(self.seq.prompt_ids)
            for j, token in enumerate(tokens):
                target = self.teacher(base + j, token, layer, logits[j:j + 1])
                if target != token:
                    return tokens[:j] + [target], None
        return tokens, ids

    def emit_pass(self, tokens: list[int], ids: torch.Tensor | None, exit_layer: int, logits: torch.Tensor,
                  drafted: int) -> None:
        """Emit a pass's tokens (the last one's id on the device); an EOS ends them. In lossless
        mode an exited pass's tokens are held with the exit layer's distributions (sampling)."""
        held_probs = None
        if self.verifier is not None and not self.params.greedy and exit_layer < self.num_layers - 1:
            held_probs = probabilities(logits[: len(tokens)], self.params)
        emitted = len(tokens)
        for j, token in enumerate(tokens):
            self.emit(token, exit_layer, ids if j == emitted - 1 else None, None if held_probs is None else held_probs[j:j + 1])
            if self.seq.finished or (token in self.seq.eos_ids and not self.params.ignore_eos):
                emitted = j + 1
                break
        matched = min(len(tokens) - 1, emitted)  # accepted drafts among the emitted tokens
        if self.spec_stats is not None:
            self.spec_stats.record(drafted, matched)
        if drafted:
            self.drafter.commit(tokens[:emitted], matched)

    def flush(self) -> bool:
        """Complete the carried rows without a new token, to verify the last unverified tokens.
        Returns True if decoding must continue (a rollback replaced a token)."""
        model = self.model
        waiting = self.kv.begin_step(len(self.history) - 1)
        if not waiting:
            return False
        self.stats.deep_passes += 1
        h, active = None, []
        for i in range(waiting[0].resume, self.num_layers):
            if waiting and waiting[0].resume == i:
                h, active = join_rows(waiting, i, h, active)
                step_in = model.range_inputs(active[0], len(active))
            h = model.layer(i, h, step_in, self.cache)
        self.kv.after_full_depth(active)
        ok = self.verifier.verify(active, model.logits(h[0]), at_bound=True)
        return not ok and not self.seq.finished
