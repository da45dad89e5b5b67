"""Speculative early-exit decoding (SpecEE) of one request, with a selectable KV policy and
an optional lossless mode.

Per token: the drafter proposes k speculative tokens; at each scheduled layer the exit
predictor reads the k-token features; when it fires, one full LM head at that layer
confirms that its argmax is among the speculative tokens, and the token leaves the model.

KV policies for the layers an exited token skipped (see ../shared/notes/early-exit-kv.md):
- skip: leave the holes; deeper layers attend only to the slots they hold.
- propagate: write the skipped layers' K/V from the exit hidden state (CALM).
- recompute: carry the exited token's remaining layers along as extra rows in the next
  token's forward, so every K/V entry equals the full model's before anyone reads it.

Lossless mode (on top of recompute): when a carried row completes the last layer, the full
model's prediction for the next position is known; the emitted token is accepted (greedy:
equal argmax; sampling: speculative-sampling acceptance with the exit layer's distribution
as the draft) or replaced, and everything after it is rolled back. Only verified tokens
reach the Sequence, so only verified text is streamed.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch

from ..drafters.base import Drafter
from ..exit.bank import PredictorBank
from ..exit.features import exit_features, spec_rows
from ..exit.scheduler import TwoLevelScheduler
from ..model.llama import Transformer
from ..sampling import probabilities, sample
from .full_depth import check_fits, prefill
from .sequence import Sequence

KVPolicy = Literal["skip", "propagate", "recompute"]
KV_POLICIES = ("skip", "propagate", "recompute")


@dataclass(frozen=True)
class EarlyExitConfig:
    """How early exit runs. `bank`/`draft` name files; the LLM resolves them.

    draft: a draft model directory, or "ngram" for the training-free prompt-lookup drafter.
    bank: a predictor bank directory; None calibrates one (and caches it) on first use.
    max_pending: most carried rows (recompute) or unverified positions (lossless) before a
    forced full-depth step; threshold_scale multiplies the bank's thresholds' distance from 1
    (above 1 = lower thresholds, more exits; below 1 = fewer), for sweeps.
    """

    draft: str | None = None
    bank: str | None = None
    k: int = 4
    kv_policy: KVPolicy = "recompute"
    mode: Literal["lossy", "lossless"] = "lossy"
    offline_size: int | None = None
    online_window: int = 4
    online_radius: int = 1
    max_pending: int = 8
    threshold_scale: float = 1.0

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

    def thresholds(self, bank: PredictorBank) -> list[float]:
        return [1.0 - (1.0 - t) * self.threshold_scale if t != float("inf") else t for t in bank.thresholds]


def mean_layers_run(histogram: list[int]) -> float | None:
    """Mean layers run per step from an exit histogram (entry i: steps that left after layer i)."""
    steps = sum(histogram)
    return sum((i + 1) * c for i, c in enumerate(histogram)) / steps if steps else None


@dataclass
class ExitStats:
    num_layers: int
    exit_histogram: list[int] = field(init=False)  # decode steps per layer left at (last = full)
    predictor_calls: int = 0
    exits_accepted: int = 0
    exits_rejected: int = 0  # predictor fired, but the layer's argmax was not a speculative token
    forced_full: int = 0
    drafter_seconds: float = 0.0
    predictor_seconds: float = 0.0
    verify_seconds: float = 0.0
    # lossless mode
    deep_passes: int = 0
    verified_positions: int = 0
    rollbacks: int = 0
    rollbacks_at_bound: int = 0  # found by a forced full-depth step (max_pending reached) or the final flush
    discarded_tokens: int = 0

    def __post_init__(self) -> None:
        self.exit_histogram = [0] * self.num_layers

    def as_dict(self, decode_seconds: float, lossless: bool) -> dict:
        steps = sum(self.exit_histogram)
        share = (lambda s: round(s / decode_seconds, 4) if decode_seconds > 0 else 0.0)
        d = {
            "decode_steps": steps,
            "mean_exit_layer": round(mean_layers_run(self.exit_histogram), 3) if steps else float(self.num_layers),
            "num_layers": self.num_layers,
            "exit_histogram": list(self.exit_histogram),
            "predictor_calls": self.predictor_calls,
            "predictor_layers_per_token": round(self.predictor_calls / steps, 3) if steps else 0.0,
            "exits_accepted": self.exits_accepted,
            "exits_rejected": self.exits_rejected,
            "forced_full_depth": self.forced_full,
            "time_share": {"drafter": share(self.drafter_seconds), "predictors": share(self.predictor_seconds),
                           "verification": share(self.verify_seconds)},
        }
        if lossless:
            d["lossless"] = {
                "deep_passes": self.deep_passes,  # full-depth passes that completed carried rows
                "verified_positions": self.verified_positions,
                "verified_per_deep_pass": round(self.verified_positions / max(self.deep_passes, 1), 3),
                "rollbacks": self.rollbacks,
                "rollbacks_at_bound": self.rollbacks_at_bound,
                "discarded_tokens": self.discarded_tokens,
            }
        return d


@dataclass
class TeacherForcedStep:
    predicted: int  # what early exit emitted at this position
    target: int  # the token fed instead (the full model's, for agreement)
    exit_layer: int
    logprob: float  # log-probability of `target` under the distribution early exit used


@dataclass
class Pending:
    """A row that still owes layers resume..L-1 (recompute policy)."""

    slot: int
    resume: int
    hidden: torch.Tensor  # [1, 1, H]: its output of layer resume-1


@dataclass
class Unverified:
    """An emitted token not yet checked against the full model (lossless mode)."""

    token: int
    draft_probs: torch.Tensor | None  # the exit layer's distribution q (sampling only)


class EarlyExitDecoder:
    """Decodes one request at a time; built once per (model, drafter, bank, config)."""

    def __init__(self, model: Transformer, drafter: Drafter, bank: PredictorBank, config: EarlyExitConfig):
        if bank.k != drafter.k:
            raise ValueError(f"predictor bank was trained with k={bank.k} speculative tokens, drafter gives k={drafter.k}")
        if bank.num_layers != model.cfg.num_layers:
            raise ValueError(f"predictor bank has {bank.num_layers} layers, model has {model.cfg.num_layers}")
        self.model, self.drafter, self.bank, self.config = model, drafter, bank, config
        self.thresholds = config.thresholds(bank)
        offline = bank.offline_layers if config.offline_size is None else bank.ranked_layers[: config.offline_size]
        self.offline_layers = list(offline)

    def new_scheduler(self) -> TwoLevelScheduler:
        c = self.config
        return TwoLevelScheduler(self.model.cfg.num_layers, self.offline_layers, self.thresholds,
                                 c.online_window, c.online_radius)

    def generate(self, seq: Sequence, force_exit: Callable[[int, int], bool] | None = None) -> "DecodeRun":
        """Decode `seq` to completion; returns the run (its cache and stats, for inspection).
        `force_exit(step, layer)`, for tests, replaces the predictor (it is asked at every layer
        but the last, whatever the schedule)."""
        run = DecodeRun(self, seq, force_exit)
        for _ in run.steps():
            pass
        return run

    def steps(self, seq: Sequence) -> Iterator[None]:
        """Decode `seq`, yielding after each step (the caller reads the sequence)."""
        return DecodeRun(self, seq, None).steps()

    @torch.inference_mode()
    def teacher_forced(self, seq: Sequence, continuation: list[int],
                       force_exit: Callable[[int, int], bool] | None = None) -> list[TeacherForcedStep]:
        """Run early exit over a fixed continuation: at each position record what early exit would
        have emitted (and the log-probability of the given token under the distribution it used),
        then feed the given token. `seq` must be greedy with max_tokens == len(continuation)."""
        if self.config.mode == "lossless":
            raise ValueError("teacher forcing measures lossy early exit; lossless mode is exact by construction")
        run = DecodeRun(self, seq, force_exit)
        run.teacher = continuation
        for _ in run.steps():
            pass
        return run.records


class DecodeRun:
    """The state of one request's decode: cache, pending rows, unverified tokens, stats."""

    def __init__(self, dec: EarlyExitDecoder, seq: Sequence, force_exit):
        self.dec, self.seq, self.force_exit = dec, seq, force_exit
        self.model, self.cfg = dec.model, dec.model.cfg
        self.policy, self.lossless = dec.config.kv_policy, dec.config.mode == "lossless"
        self.params = seq.params
        self.generator = self.params.make_generator(self.model.device)
        self.stats = ExitStats(self.cfg.num_layers)
        self.scheduler = dec.new_scheduler()
        self.pending: list[Pending] = []
        self.unverified: list[Unverified] = []
        self.history: list[int] = list(seq.prompt_ids)  # prompt + emitted (verified or not)
        self.teacher: list[int] | None = None
        self.records: list[TeacherForcedStep] = []

    # ---- emission -------------------------------------------------------------------------
    def emit(self, token: int, draft_probs: torch.Tensor | None = None, verified: bool = True) -> None:
        self.history.append(token)
        if verified:
            self.seq.append(token)
        else:
            self.unverified.append(Unverified(token, draft_probs))

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
        """Decode the request, yielding after each step or flush."""
        seq, model = self.seq, self.model
        check_fits(model, len(seq.prompt_ids), self.params.max_tokens)
        self.cache = model.new_cache(1, len(seq.prompt_ids) + self.params.max_tokens + 1)
        t0 = time.perf_counter()
        # All but the last prompt token at full depth; the last one is the first early-exit step,
        # so the first generated token can exit too (it is all a multiple-choice answer has).
        if len(seq.prompt_ids) > 1:
            prefill(model, self.cache, [seq.prompt_ids[:-1]])
        self.dec.drafter.reset(seq.prompt_ids, self.params.max_tokens)  # sizes a draft model's cache
        t1 = time.perf_counter()
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
            seq.stats.decode_seconds = time.perf_counter() - t1
            seq.stats.decode_tokens = len(seq.output_ids)  # the first token came from a decode step too
            seq.stats.early_exit = self.stats.as_dict(seq.stats.decode_seconds, self.lossless)
            c = self.dec.config
            seq.stats.early_exit.update(kv_policy=self.policy, mode=c.mode, offline_layers=self.dec.offline_layers,
                                        online_window=c.online_window, online_radius=c.online_radius)

    def step(self) -> None:
        """Feed the last emitted token (at slot n) through the model; emit the next one."""
        model, cfg, cache, stats = self.model, self.cfg, self.cache, self.stats
        L, n = cfg.num_layers, len(self.history) - 1
        token = self.history[-1]

        t = time.perf_counter()
        drafter = self.dec.drafter
        if len(drafter.history) < len(self.history):  # the drafter lags by the tokens emitted since
            drafter.extend(self.history[len(drafter.history):])
        spec = drafter.propose()
        rows = spec_rows(model, spec)
        stats.drafter_seconds += time.perf_counter() - t

        limit = len(self.unverified) if self.lossless else len(self.pending)
        forced = limit >= self.dec.config.max_pending
        stats.forced_full += forced
        schedule = self.scheduler.layers()
        thresholds = self.dec.thresholds
        spec_list: list[int] | None = None

        # rows of this step: joined pending rows first (older slots), the current token last
        waiting = sorted(self.pending, key=lambda p: (p.resume, p.slot))
        active: list[int] = [n]
        h = model.embed(torch.tensor([[token]], device=model.device))
        step_in = self.step_inputs(active)
        if self.policy == "skip":
            cache.filled[:, 0, n] = True  # own slot readable; unmarked past the exit below
        cache.length = n + 1
        exit_layer, next_token, draft_probs = L - 1, None, None
        for i in range(L):
            if waiting and waiting[0].resume == i:
                h, active = self.join(waiting, i, h, active)
                step_in = self.step_inputs(active)
            elif self.policy == "skip":
                step_in.mask = cache.filled[i, :, None, None, : n + 1]
            h_in = h
            h = model.layer(i, h, step_in, cache)
            if forced or i == L - 1 or (self.force_exit is None and not schedule[i]):
                continue
            t = time.perf_counter()
            stats.predictor_calls += 1
            if self.force_exit is not None:
                fire = self.force_exit(len(self.seq.output_ids) + len(self.unverified), i)
            else:
                feats = exit_features(model, h_in[:, -1], h[:, -1], rows)
                fire = self.dec.bank.prob(i, feats).item() > thresholds[i]
            t2 = time.perf_counter()
            stats.predictor_seconds += t2 - t
            if not fire:
                continue
            logits = model.logits(h[:, -1])
            choice = int(logits.argmax(dim=-1))
            if spec_list is None:
                spec_list = spec.tolist()
            if choice in spec_list:
                exit_layer, used_logits = i, logits
                if self.params.greedy:
                    next_token = choice
                else:
                    draft_probs = probabilities(logits, self.params)
                    next_token = int(torch.multinomial(draft_probs, 1, generator=self.generator))
                stats.exits_accepted += 1
                stats.verify_seconds += time.perf_counter() - t2
                break
            stats.exits_rejected += 1
            stats.verify_seconds += time.perf_counter() - t2

        stats.exit_histogram[exit_layer] += 1
        self.scheduler.record(exit_layer)
        if self.policy != "skip":  # skip marked every layer of slot n above
            cache.filled[: exit_layer + 1, 0, n] = True
        if exit_layer < L - 1:
            self.after_exit(exit_layer, h, active, step_in)
            if self.teacher is not None:
                next_token = self.record(next_token, exit_layer, used_logits)
            self.emit(next_token, draft_probs, verified=not self.lossless)
            return
        # full depth: every carried row joined (resume layers are <= L-1) and completed
        self.pending = []
        if len(active) > 1:
            cache.filled[:, 0, active[0]:n] = True
        if self.lossless:
            final_logits = model.logits(h[0])  # [rows, V]: the carried rows verify what they emitted
            stats.deep_passes += len(active) > 1
            if not self.verify(active[:-1], final_logits[:-1], at_bound=forced):
                return
            last = final_logits[-1:]
        else:
            last = model.logits(h[:, -1])
        next_token = int(sample(last, self.params, self.generator))
        if self.teacher is not None:
            next_token = self.record(next_token, L - 1, last)
        self.emit(next_token)

    def record(self, predicted: int, exit_layer: int, logits: torch.Tensor) -> int:
        """Teacher forcing: note what early exit chose here, then continue with the given token."""
        target = self.teacher[len(self.history) - len(self.seq.prompt_ids)]
        logprob = float(torch.log_softmax(logits[-1].float(), dim=-1)[target])
        self.records.append(TeacherForcedStep(predicted, target, exit_layer, logprob))
        return target

    @staticmethod
    def join(waiting: list[Pending], layer: int, h: torch.Tensor | None, active: list[int]):
        """Prepend the carried rows that resume at `layer` (older slots, so slot order holds)."""
        group = []
        while waiting and waiting[0].resume == layer:
            group.append(waiting.pop(0))
        parts = [p.hidden for p in group] + ([] if h is None else [h])
        return torch.cat(parts, dim=1), [p.slot for p in group] + active

    def step_inputs(self, active: list[int]):
        """Inputs for rows at `active` slots: causal over slots (no holes under propagate/recompute)."""
        assert active[-1] - active[0] + 1 == len(active), "active rows are a contiguous run of slots"
        return self.model.range_inputs(active[0], len(active))

    def after_exit(self, e: int, h: torch.Tensor, active: list[int], step_in) -> None:
        """Fill (or don't) the layers the exited rows skipped, per the KV policy."""
        model, cache, L = self.model, self.cache, self.cfg.num_layers
        n = active[-1]
        if self.policy == "skip":
            cache.filled[e + 1:, 0, n] = False
        elif self.policy == "propagate":
            for j in range(e + 1, L):
                model.project_kv(j, h, step_in, cache)
            cache.filled[:, 0, active[0]:n + 1] = True
        else:  # recompute: every row of this step resumes at e + 1
            cache.filled[: e + 1, 0, active[0]:n] = True
            carried = [Pending(slot, e + 1, h[:, j:j + 1]) for j, slot in enumerate(active)]
            self.pending = [p for p in self.pending if p.slot not in active] + carried

    # ---- lossless mode ------------------------------------------------------------------------
    def verify(self, slots: list[int], final_logits: torch.Tensor, at_bound: bool) -> bool:
        """Check the unverified tokens that the completed rows predicted; roll back at a mismatch.

        Row at slot s predicts history[s + 1]. Returns False if it rolled back.
        """
        for row, slot in enumerate(slots):
            pos = slot + 1
            assert pos == len(self.history) - len(self.unverified), "carried rows out of order"
            item = self.unverified[0]
            accepted, replacement = self.accept(final_logits[row:row + 1], item)
            if accepted:
                self.unverified.pop(0)
                self.stats.verified_positions += 1
                self.seq.append(item.token)
                if self.seq.finished:
                    return False
                continue
            self.stats.rollbacks_at_bound += at_bound
            self.rollback(pos, replacement)
            return False
        return True

    def accept(self, final_logits: torch.Tensor, item: Unverified) -> tuple[bool, int]:
        if self.params.greedy:
            best = int(final_logits.argmax(dim=-1))
            return best == item.token, best
        p = probabilities(final_logits, self.params)[0]
        q = item.draft_probs[0]
        ratio = (p[item.token] / q[item.token]).clamp(max=1.0)
        if float(torch.rand((), generator=self.generator, device=p.device)) < float(ratio):
            return True, item.token
        residual = (p - q).clamp(min=0)
        total = residual.sum()
        residual = p if float(total) <= 0 else residual / total
        return False, int(torch.multinomial(residual, 1, generator=self.generator))

    def rollback(self, pos: int, replacement: int) -> None:
        """history[pos] was wrong: drop it and everything after, emit the full model's token."""
        self.stats.rollbacks += 1
        self.stats.discarded_tokens += len(self.history) - pos
        del self.history[pos:]
        self.unverified.clear()
        self.pending.clear()
        self.cache.truncate(pos)
        self.dec.drafter.truncate(pos)
        self.emit(replacement)

    def flush(self) -> bool:
        """Complete the carried rows without a new token, to verify the last unverified tokens.

        Returns True if decoding must continue (a rollback replaced a token)."""
        model, cache, L = self.model, self.cache, self.cfg.num_layers
        waiting = sorted(self.pending, key=lambda p: (p.resume, p.slot))
        if not waiting:
            return False
        self.stats.deep_passes += 1
        h, active = None, []
        for i in range(waiting[0].resume, L):
            if waiting and waiting[0].resume == i:
                h, active = self.join(waiting, i, h, active)
                step_in = self.step_inputs(active)
            h = model.layer(i, h, step_in, cache)
        cache.filled[:, 0, active[0]:active[-1] + 1] = True
        self.pending = []
        ok = self.verify(active, model.logits(h[0]), at_bound=True)
        return not ok and not self.seq.finished
