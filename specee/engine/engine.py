"""The engine: requests in, one step at a time (shaped like vLLM's LLMEngine, nano-vllm's split).

    step():
        batch = scheduler.schedule()               # running requests + newcomers that fit
        segments = [plan(r) for r in batch]        # a newcomer's prompt, or the rows its decoding adds
        h, features = runner.forward(segments)     # one ragged forward over every request's rows
        verdicts = choose(batch, h)                # sample / accept drafts; one host read for all
        commit(batch, verdicts)                    # cache lengths (rollback), drafters, stop checks
        return scheduler.retire()                  # finished requests leave, their blocks come free

Every request decodes with the LLM's decoding (engine/decoding.py: full depth, or speculative
decoding's chains and trees), each with its own sampling parameters, generator and drafter, and
joins or leaves between steps without touching anyone else's cache (engine/kv_manager.py).
A request whose prompt does not fit ends with an error at `add_request`, seen by no one else.
"""
from __future__ import annotations

import torch

from ..clock import device_time
from ..model.llama import Transformer
from ..sampling import NONFINITE_TOKEN, sample
from .decoding import FullDepth
from .kv_manager import KVCacheManager, parse_kv_budget
from .runner import ModelRunner, Segment
from .scheduler import Running, Scheduler
from .sequence import Sequence

DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_MAX_BATCHED_TOKENS = 8192


class Engine:
    def __init__(self, model: Transformer, decoding: FullDepth | None = None, kv_cache_memory: int | str | None = None,
                 max_num_seqs: int = DEFAULT_MAX_NUM_SEQS, max_num_batched_tokens: int = DEFAULT_MAX_BATCHED_TOKENS):
        if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs (--max-num-seqs) must be a positive integer, got {max_num_seqs!r}")
        self.model = model
        self.decoding = decoding or FullDepth(model)
        self.runner = ModelRunner(model)
        self.kv = KVCacheManager(model.cfg, model.device, model.dtype,
                                 parse_kv_budget(kv_cache_memory, model.cfg, model.dtype))
        self.scheduler = Scheduler(self.kv, model.cfg.context_limit, self.decoding.extra_rows, max_num_seqs,
                                   max_num_batched_tokens)

    def check(self, seq: Sequence) -> None:
        """Raise ValueError if the request can never run (empty, longer than the context or the cache)."""
        self.scheduler.check(seq)

    def add_request(self, seq: Sequence) -> None:
        """Queue a request; one that can never run ends at the next step with finish_reason "error"."""
        self.scheduler.add(seq)

    def abort(self, seq: Sequence) -> None:
        """Drop a request (a closed stream, a client gone): it finishes as "abort" and its blocks come free."""
        running = self.scheduler.abort(seq)
        if running is not None:
            self._settle(running)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """One step of every running request (newcomers: their prefill); returns those that finished."""
        batch = self.scheduler.schedule()
        if batch:
            t0 = device_time(self.model.device)
            decoding = sum(r.prefilled for r in batch)
            self.decoding.begin_step(decoding)
            segments = [self._plan(r) for r in batch]
            h, features = self.runner.forward(segments, self.decoding.feature_layers)
            emitted = self._commit(batch, segments, h, features, t0)
            if decoding == len(batch):  # a pure decode step measures the decoding (no prefill inside)
                self.decoding.end_step(emitted, device_time(self.model.device) - t0)
        failed, done = self.scheduler.retire()
        for r in done:
            self._settle(r)
        return failed + [r.seq for r in done]

    def _plan(self, r: Running) -> Segment:
        if r.prefilled:
            return self.decoding.plan(r)
        ids = torch.tensor(r.seq.prompt_ids, device=self.model.device)
        return Segment(ids, r.cache, self.model.range_inputs(0, len(r.seq.prompt_ids)))

    def _commit(self, batch: list[Running], segments: list[Segment], h: torch.Tensor,
                features: torch.Tensor | None, t0: float) -> int:
        """Choose every request's tokens from its rows' logits (a newcomer: its prompt's last row) with
        one LM-head call and one host read, then commit them; returns how many tokens were emitted."""
        firsts, picks, offset = [], [], 0
        for r, seg in zip(batch, segments):
            n = seg.tokens.shape[0]
            firsts.append(offset)
            picks.append(torch.arange(offset, offset + n) if r.prefilled else torch.tensor([offset + n - 1]))
            offset += n
        index = torch.cat(picks).to(h.device)
        logits = self.model.logits(h.index_select(0, index))
        verdicts, at = [], 0
        for r, pick in zip(batch, picks):
            rows = logits[at : at + len(pick)]
            at += len(pick)
            verdicts.append(self.decoding.choose(r, rows) if r.prefilled else sample(rows, r.seq.params, r.generator))
        sizes = [v.shape[0] for v in verdicts]
        values = torch.cat(verdicts).tolist()  # the step's one host read
        now = device_time(self.model.device)
        at = total = 0
        for r, seg, first, size in zip(batch, segments, firsts, sizes):
            verdict, at = values[at : at + size], at + size
            rows = slice(first, first + seg.tokens.shape[0])
            feats = None if features is None else features[rows]
            if NONFINITE_TOKEN in verdict:  # NaN or Inf logits: the request ends with an error, no one else does
                r.seq.append(NONFINITE_TOKEN)
                continue
            if r.prefilled:
                emitted = self.decoding.commit(r, verdict, feats)
            else:  # the prefill's token; the decoding starts from it
                r.prefilled, r.last, emitted = True, verdict[0], verdict
                r.cache.length = len(r.seq.prompt_ids)
                r.seq.stats.prefill_seconds = now - t0
                r.decode_since = now
                self.decoding.start(r, feats)
            for token in emitted:
                r.seq.append(token)
                if r.seq.finished:
                    break
            r.last = emitted[-1]
            total += len(emitted)
        return total

    def _settle(self, r: Running) -> None:
        """A finished request's decode timing and its decoding's stats."""
        stats = r.seq.stats
        if r.prefilled:
            stats.decode_seconds = device_time(self.model.device) - r.decode_since
            stats.decode_tokens = max(len(r.seq.output_ids) - 1, 0)  # the first token came from the prefill
            stats.speculative = self.decoding.stats(r, stats.decode_seconds)
