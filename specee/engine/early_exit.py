"""Speculative early-exit decoding (SpecEE): the decode loop.

Per pass: the drafter proposes k speculative tokens for each row; the layers run one by one,
and after each scheduled layer the exit controller decides whether the pass leaves there
(exit/controller.py). A pass is the last token of each request of a batch (one-token early
exit; requests are left-padded so their last tokens share a cache slot) or, with
`num_draft_tokens`, one request's last token and a drafted chain verified in the same pass
(SpecEE's exits inside speculative decoding); the accepted drafts and the next token come
from the exit layer's argmax, or the last layer's. The KV policy (exit/kv_policy.py: skip, propagate,
recompute) decides what the skipped layers' cache holds and which carried rows join the pass.
In lossless mode (recompute), rows that complete the last layer verify the tokens emitted
before them, and a wrong one is rolled back (exit/lossless.py). Lossless mode, chains and
teacher forcing take one request at a time (a rollback moves one request's slots).
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..clock import StageTimer, device_time
from ..drafters.base import Draft, Drafter
from ..exit.bank import PredictorBank
from ..exit.config import EarlyExitConfig
from ..exit.controller import ExitController
from ..exit.kv_policy import POLICY_CLASSES, join_rows
from ..exit.lossless import LosslessVerifier
from ..exit.scheduler import ExitPayoff, TwoLevelScheduler
from ..exit.stats import ExitStats
from ..model.llama import StepInputs, Transformer
from ..sampling import RowSampler, SamplingParams, probabilities
from ..speculative.speculative import SpecStats
from ..speculative.verify import verify_chain
from .full_depth import prefill
from .scheduler import check_fits
from .sequence import Sequence
from .teacher import TeacherForcedStep, TeacherForcing


class EarlyExitDecoder:
    """Decodes requests with early exit; built once per (model, drafter, bank, config)."""

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

    @property
    def batches(self) -> bool:
        """Whether requests share passes: lossy one-token exits do; lossless mode and chains take
        one request at a time."""
        return self.config.mode == "lossy" and self.config.num_draft_tokens == 0

    def new_scheduler(self) -> TwoLevelScheduler:
        c = self.config
        return TwoLevelScheduler(self.model.cfg.num_layers, self.offline_layers, self.thresholds,
                                 c.online_window, c.online_radius, self.payoff)

    def generate(self, seqs: Sequence | list[Sequence], exits: ExitController | None = None) -> "DecodeRun":
        """Decode `seqs` (one request, or a batch where `batches`) to completion; returns the run (its
        cache and stats, for inspection). `exits` replaces the predictors (tests inject
        exit.controller.ForcedExits)."""
        run = DecodeRun(self, [seqs] if isinstance(seqs, Sequence) else seqs, exits)
        for _ in run.steps():
            pass
        return run

    def steps(self, seqs: list[Sequence]) -> Iterator[None]:
        """Decode `seqs` together, yielding after each pass (the caller reads the sequences)."""
        return DecodeRun(self, seqs).steps()

    @torch.inference_mode()
    def teacher_forced(self, seq: Sequence, continuation: list[int],
                       exits: ExitController | None = None) -> list[TeacherForcedStep]:
        """Run early exit over a fixed continuation: at each position record what early exit would
        have emitted (and the log-probability of the given token under the distribution it used),
        then feed the given token. `seq` must be greedy with max_tokens == len(continuation)."""
        if self.config.mode == "lossless":
            raise ValueError("teacher forcing measures lossy early exit; lossless mode is exact by construction")
        teacher = TeacherForcing(continuation)
        for _ in DecodeRun(self, [seq], exits, teacher).steps():
            pass
        return teacher.records


@dataclass
class Request:
    """One request of a run: a row of the batch."""

    seq: Sequence
    drafter: Drafter
    generator: torch.Generator | None
    history: list[int]  # prompt + emitted (verified or not)
    pad: int = 0  # cache slots before its prompt (left padding: the batch's last tokens share a slot)

    def catch_up_drafter(self) -> None:
        """The drafter lags by the tokens emitted since it last drafted."""
        if len(self.drafter.history) < len(self.history):
            self.drafter.extend(self.history[len(self.drafter.history):])


class DecodeRun:
    """The state of one decode: the batch's cache, KV policy, exit controller and schedule; per
    request its history and drafter; the unverified tokens (lossless) and the stats."""

    def __init__(self, dec: EarlyExitDecoder, seqs: list[Sequence], exits: ExitController | None = None,
                 teacher: TeacherForcing | None = None):
        if len(seqs) > 1 and not (dec.batches and teacher is None):
            raise ValueError("lossless mode, chains and teacher forcing decode one request at a time")
        self.dec, self.teacher = dec, teacher
        self.model, self.num_layers = dec.model, dec.model.cfg.num_layers
        device = self.model.device
        self.requests = [Request(s, dec.drafter if len(seqs) == 1 else dec.drafter.fork(),
                                 s.params.make_generator(device), list(s.prompt_ids)) for s in seqs]
        self.sampler = RowSampler([s.params for s in seqs], [r.generator for r in self.requests], device)
        self.idle = torch.zeros(len(seqs), dtype=torch.bool, device=device)  # finished requests (batches)
        self.pads: torch.Tensor | None = None  # each request's left padding, when a batch has several
        self.stats = ExitStats(self.num_layers)
        self.spec_stats = SpecStats(dec.config.num_draft_tokens) if dec.config.num_draft_tokens else None
        self.timer = StageTimer(device)  # the drafter's share
        self.scheduler = dec.new_scheduler()
        self.exit = exits or ExitController(self.model, dec.bank, dec.thresholds)
        self.verifier = LosslessVerifier(self) if dec.config.mode == "lossless" else None
        self.next_ids: torch.Tensor | None = None  # [B, 1]: the last tokens on the device, when they came from there
        self.no_draft = Draft(torch.empty(0, dtype=torch.long, device=device))

    # the request of the one-request modes (lossless, chains, teacher forcing)
    @property
    def seq(self) -> Sequence:
        return self.requests[0].seq

    @property
    def history(self) -> list[int]:
        return self.requests[0].history

    @property
    def drafter(self) -> Drafter:
        return self.requests[0].drafter

    @property
    def params(self) -> SamplingParams:
        return self.requests[0].seq.params

    @property
    def generator(self) -> torch.Generator | None:
        return self.requests[0].generator

    @property
    def unverified(self) -> list:
        return self.verifier.unverified if self.verifier else []

    def slot(self) -> int:
        """The cache slot of the last emitted token (the same for every request)."""
        r = self.requests[0]
        return r.pad + len(r.history) - 1

    def inputs(self, start: int, count: int) -> StepInputs:
        """Step inputs of the rows at slots start..start+count-1, each reading the slots up to its
        own: for one request RoPE rows are views of the tables; a batch reads through its padding mask."""
        if self.pads is None:
            return self.model.range_inputs(start, count)
        slots = self.cache.slot_ids[start:start + count]
        # a finished request riding along can pass the model's context: its rows are discarded
        positions = (slots[None, :] - self.pads[:, None]).clamp_(max=self.model.cfg.max_position_embeddings - 1)
        end = start + count
        return self.model.step_inputs(positions, slots, self.cache.attention_mask(0, slots, end), end)

    def emit(self, token: int, exit_layer: int, draft_probs: torch.Tensor | None = None, row: int = 0) -> None:
        """Append the next token of request `row`; unverified if it exited in lossless mode."""
        r = self.requests[row]
        r.history.append(token)
        self.next_ids = None  # built from the histories unless the pass sets it from the device
        if r.seq.finished:  # a finished request of a batch rides along until the batch ends, uncounted
            return
        self.stats.exit_histogram[exit_layer] += 1
        if len(self.requests) == 1:  # a batch's schedule learns once per pass (emit_pass)
            self.scheduler.record(exit_layer)
        if self.verifier is not None and exit_layer < self.num_layers - 1:
            self.verifier.hold(token, exit_layer, draft_probs)
        else:
            r.seq.append(token)
            if r.seq.finished:
                self.mark_finished(row)

    def mark_finished(self, row: int) -> None:
        """Request `row` finished (or was aborted): its row no longer holds up a batch's exits."""
        self.finished_at[row] = device_time(self.model.device)
        self.idle[row] = True

    def done(self) -> bool:
        if all(r.seq.finished for r in self.requests):
            return True
        if not self.unverified:
            return False
        # unverified tokens count toward the limits; the final flush settles them
        last = self.unverified[-1].token
        at_eos = last in self.seq.eos_ids and not self.params.ignore_eos
        return at_eos or len(self.seq.output_ids) + len(self.unverified) >= self.params.max_tokens

    # ---- the requests ---------------------------------------------------------------------
    @torch.inference_mode()
    def steps(self) -> Iterator[None]:
        """Decode the requests, yielding after each pass or flush."""
        model, seqs = self.model, [r.seq for r in self.requests]
        for s in seqs:
            check_fits(model.cfg.context_limit, len(s.prompt_ids), s.params.max_tokens)
        # All but the last prompt token at full depth; the last one is the first early-exit pass,
        # so the first generated token can exit too (it is all a multiple-choice answer has).
        # Lossless mode prefills the whole prompt instead: its first token, and every K/V entry, are
        # then those of full-depth decoding (the same prefill call: a shorter one, or a one-row pass,
        # rounds differently, which parted lossless from full depth at near-ties on 14-18 of 100 prompts).
        self.whole_prefill = whole = self.verifier is not None
        width = max(len(s.prompt_ids) for s in seqs) - (0 if whole else 1)
        for r in self.requests:
            r.pad = width + (0 if whole else 1) - len(r.seq.prompt_ids)
        extra = self.dec.config.num_draft_tokens + 1
        self.cache = model.new_cache(len(seqs), width + 1 + max(s.params.max_tokens for s in seqs) + extra)
        if len(seqs) > 1:
            self.pads = torch.tensor([r.pad for r in self.requests], device=model.device)
        self.kv = POLICY_CLASSES[self.dec.config.kv_policy](model, self.cache, self.inputs)
        self.finished_at: dict[int, float] = {}  # row -> when its request finished
        t0 = device_time(model.device)
        if width:
            h = prefill(model, self.cache, [s.prompt_ids if whole else s.prompt_ids[:-1] for s in seqs])
        for r in self.requests:
            r.drafter.reset(r.seq.prompt_ids, r.seq.params.max_tokens)  # sizes a draft model's cache
        if whole:
            self.emit(int(self.sampler(model.logits(h))[0]), self.num_layers - 1)
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
            self.settle_stats(t0, t1, device_time(model.device))

    def settle_stats(self, t0: float, t1: float, end: float) -> None:
        """Each request's timing, exit and speculation stats (the exit stats are the run's: a batch's
        counts cover its requests' tokens, its time shares the batch's decode time)."""
        s, e, c = self.stats, self.exit, self.dec.config
        s.predictor_calls, s.exits_rejected = e.predictor_calls, e.rejected
        s.drafter_seconds = self.timer.seconds("drafter")
        s.predictor_seconds, s.verify_seconds = e.timer.seconds("predictors"), e.timer.seconds("verification")
        for row, r in enumerate(self.requests):
            st = r.seq.stats
            st.prefill_seconds = t1 - t0
            st.decode_seconds = self.finished_at.get(row, end) - t1
            st.decode_tokens = len(r.seq.output_ids) - self.whole_prefill  # a lossless prefill gave the first
            st.early_exit = s.as_dict(end - t1, self.verifier is not None)
            st.early_exit.update(kv_policy=c.kv_policy, mode=c.mode, offline_layers=self.dec.offline_layers,
                                 online_window=c.online_window, online_radius=c.online_radius,
                                 batch_size=len(self.requests))
        if self.spec_stats is not None:
            self.spec_stats.draft_seconds = s.drafter_seconds
            method = "ngram" if self.drafter.fingerprint.startswith("ngram") else "draft_model"
            self.seq.stats.speculative = {"method": method, "num_speculative_tokens": c.num_draft_tokens,
                                          **self.spec_stats.as_dict(self.seq.stats.decode_seconds)}

    def draft(self, checking: bool) -> Draft:
        """The pass's draft chain (none without speculation or in a batch); when a layer will be
        checked, every row's speculative tokens go to the exit controller."""
        for r in self.requests:
            r.catch_up_drafter()
        token_index = len(self.history) - len(self.seq.prompt_ids)
        if len(self.requests) > 1:  # one row per request
            for row, r in enumerate(self.requests):
                if r.seq.finished and row not in self.finished_at:  # aborted since the last pass
                    self.mark_finished(row)
            if checking:
                candidates = torch.stack([r.drafter.propose() for r in self.requests])
                self.exit.begin_pass(candidates, None, token_index, self.idle)
            return self.no_draft
        drafter = self.drafter
        room = self.params.max_tokens - len(self.seq.output_ids) - len(self.unverified) - 1
        n = min(self.dec.config.num_draft_tokens, room)
        draft = self.no_draft if n <= 0 else drafter.draft(n, self.params, self.generator, self.model.cfg.vocab_size)
        if checking:
            candidates = drafter.propose()[None] if n <= 0 else drafter.row_candidates(draft)
            self.exit.begin_pass(candidates, draft.tokens, token_index)
        return draft

    def step(self) -> None:
        """Feed each request's last emitted token (at slot n) and, for one request, the drafts after
        it through the model until the pass exits; emit the accepted drafts and the next tokens."""
        model, stats, L = self.model, self.stats, self.num_layers
        n = self.slot()
        owed = len(self.unverified) if self.verifier else len(self.kv.pending)
        forced = owed >= self.dec.config.max_pending  # this pass runs every layer
        stats.forced_full += forced
        check = self.exit.layers(self.scheduler)
        checking = not forced and True in check  # else no candidates are needed (a draft model's extra step)
        t = self.timer.start()
        draft = self.draft(checking)
        R = draft.tokens.shape[0] + 1  # a request's own rows: x_n and its drafts
        self.timer.stop("drafter", t)

        waiting = self.kv.begin_step(n, R)  # carried rows, joined at their resume layers (older slots first)
        active = list(range(n, n + R))
        if self.next_ids is None:
            self.next_ids = torch.tensor([r.history[-1:] for r in self.requests], device=model.device)
        h = model.embed(self.next_ids if R == 1 else torch.cat([self.next_ids.view(1), draft.tokens]).view(1, R))
        step_in = self.inputs(n, R)
        self.cache.length = n + R
        masked = self.kv.masks_layers
        for i in range(L):
            if waiting and waiting[0].resume == i:
                h, active = join_rows(waiting, i, h, active)
                step_in = self.inputs(active[0], len(active))
            if masked:
                step_in = self.kv.layer_inputs(i, step_in, n)
            h_in, h = h, model.layer(i, h, step_in, self.cache)
            if not checking or not check[i]:
                continue
            hit = self.exit.try_exit(i, h_in[:, -R:].flatten(0, 1), h[:, -R:].flatten(0, 1))
            self.scheduler.observe(i, hit is not None)
            if hit is not None:
                stats.exits_accepted += 1
                tokens, ids = self.choose(hit.logits, draft, i, hit.tokens, hit.ids)
                kept = len(active) - R + len(tokens[0])  # carried rows, x_n and the accepted drafts
                self.kv.after_exit(i, h[:, :kept], active[:kept])
                self.cache.length = n + len(tokens[0])
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
            logits = model.logits(h[:, -R:].flatten(0, 1))
        tokens, ids = self.choose(logits, draft, L - 1)
        self.cache.length = n + len(tokens[0])
        self.emit_pass(tokens, ids, L - 1, logits, R - 1)

    def choose(self, logits: torch.Tensor, draft: Draft, layer: int, greedy_tokens: list[int] | None = None,
               greedy_ids: torch.Tensor | None = None) -> tuple[list[list[int]], torch.Tensor | None]:
        """The tokens each request emits from a pass leaving after `layer`, from the rows' logits
        [r, V] (one request's chain, or a batch's requests): the accepted drafts and the next token
        (one host read), and the last ones on the device. greedy_tokens: already decided (an exit's
        argmaxes). A teacher's continuation replaces them from its first difference."""
        if len(self.requests) > 1:
            if greedy_tokens is None or not self.sampler.greedy:
                greedy_ids = self.sampler(logits)
                greedy_tokens = greedy_ids.tolist()
            return [[t] for t in greedy_tokens], greedy_ids
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
                    return [tokens[:j] + [target]], None
        return [tokens], ids

    def emit_pass(self, tokens: list[list[int]], ids: torch.Tensor | None, exit_layer: int, logits: torch.Tensor,
                  drafted: int) -> None:
        """Emit a pass's tokens per request (the last ones' ids on the device); an EOS ends them. In
        lossless mode an exited pass's tokens are held with the exit layer's distributions (sampling)."""
        if len(self.requests) > 1:
            for row, (token,) in enumerate(tokens):
                self.emit(token, exit_layer, row=row)
            self.scheduler.record(exit_layer)
            self.next_ids = None if ids is None else ids.view(-1, 1)
            return
        (tokens,) = tokens
        held_probs = None
        if self.verifier is not None and not self.params.greedy and exit_layer < self.num_layers - 1:
            held_probs = probabilities(logits[: len(tokens)], self.params)
        emitted = len(tokens)
        for j, token in enumerate(tokens):
            self.emit(token, exit_layer, None if held_probs is None else held_probs[j:j + 1])
            if self.seq.finished or (token in self.seq.eos_ids and not self.params.ignore_eos):
                emitted = j + 1
                break
        if emitted == len(tokens) and ids is not None:
            self.next_ids = ids.view(1, 1)
        matched = min(len(tokens) - 1, emitted)  # accepted drafts among the emitted tokens
        if self.spec_stats is not None:
            self.spec_stats.record(drafted, matched)
        if drafted:
            self.drafter.commit(tokens[:emitted], matched)

    def flush(self) -> bool:
        """Complete the carried rows without a new token, to verify the last unverified tokens.
        Returns True if decoding must continue (a rollback replaced a token)."""
        model = self.model
        waiting = self.kv.begin_step(self.slot())
        if not waiting:
            return False
        self.stats.deep_passes += 1
        h, active = None, []
        for i in range(waiting[0].resume, self.num_layers):
            if waiting and waiting[0].resume == i:
                h, active = join_rows(waiting, i, h, active)
                step_in = self.inputs(active[0], len(active))
            h = model.layer(i, h, step_in, self.cache)
        self.kv.after_full_depth(active)
        ok = self.verifier.verify(active, model.logits(h[0]), at_bound=True)
        return not ok and not self.seq.finished
