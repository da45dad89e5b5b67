"""The engine: requests in, one step at a time (shaped like vLLM's LLMEngine, nano-vllm's split).

    step():
        batch = scheduler.schedule()               # running requests + newcomers that fit
        segments = [plan(r) for r in batch]        # a part of a prompt, or the rows its decoding adds
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
from ..sampling import NONFINITE_TOKEN, greedy, sample
from .cuda_graphs import DecodeGraphs
from .decoding import FullDepth
from .kv_manager import KVCacheManager, parse_kv_budget
from .runner import ModelRunner, Segment
from .scheduler import Running, Scheduler
from .scheduling import (DEFAULT_MAX_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, DEFAULT_PREFILL_CHUNK, DEFAULT_SWAP_SPACE,
                         check_scheduling, swap_space_bytes)
from .sequence import Sequence


class Engine:
    def __init__(self, model: Transformer, decoding: FullDepth | None = None, kv_cache_memory: int | str | None = None,
                 max_num_seqs: int = DEFAULT_MAX_NUM_SEQS, max_num_batched_tokens: int = DEFAULT_MAX_BATCHED_TOKENS,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, kv: KVCacheManager | None = None,
                 swap_space: float = DEFAULT_SWAP_SPACE, enable_prefix_caching: bool = True):
        """max_num_batched_tokens: rows a step runs (a step with prompt parts may pass it by one part);
        prefill_chunk: the prompt tokens a step prefills of one request (0: whole prompts); kv: an earlier
        engine's pool, taken over where it fits (KVCacheManager.reusing); swap_space: GiB of host memory
        for requests parked out of a full pool (scheduler.py); enable_prefix_caching: prompts start from
        earlier prompts' cached rows (kv_manager.py), except where the decoding reads the prompt's
        features (EAGLE), which cached rows do not have."""
        check_scheduling(max_num_seqs, max_num_batched_tokens, prefill_chunk)
        swap_bytes = swap_space_bytes(swap_space)
        self.model = model
        self.decoding = decoding or FullDepth(model)
        self.kv = KVCacheManager.reusing(kv, model.cfg, model.device, model.kv_dtype,
                                         parse_kv_budget(kv_cache_memory, model.cfg, model.kv_dtype,
                                                         self.decoding.extra_rows))
        self.runner = ModelRunner(model, DecodeGraphs(model, self.kv) if model.device.type == "cuda" else None)
        self.scheduler = Scheduler(self.kv, model.cfg.context_limit, self.decoding.extra_rows, max_num_seqs,
                                   max_num_batched_tokens, prefill_chunk, self.decoding.prefill_length, swap_bytes,
                                   enable_prefix_caching and not self.decoding.feature_layers)

    def check(self, seq: Sequence) -> None:
        """Raise ValueError if the request can never run (empty, longer than the context or the cache)."""
        self.scheduler.check(seq)

    def room(self, prompt_len: int) -> int:
        """The most new tokens a request with a prompt this long could ever be given (context and cache)."""
        return self.scheduler.room(prompt_len)

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

    def num_running(self) -> int:
        """Requests its steps decode now (the scheduler's running ones; the others it holds wait)."""
        return len(self.scheduler.running)

    def num_parked(self) -> int:
        """Running requests parked out of the KV pool until blocks come free (scheduler.py)."""
        return len(self.scheduler.parked)

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """One step of every running request (newcomers: their prefill); returns those that finished."""
        batch = self.scheduler.schedule()
        if batch:
            t0 = device_time(self.model.device)
            decoding = sum(r.prefilled for r in batch)
            self.decoding.begin_step(batch, bool(self.scheduler.waiting or self.scheduler.parked))
            plans = [self._plan(r, t0) for r in batch]
            h, features, rows = self.runner.forward([s for p in plans for s in p], self.decoding.feature_layers)
            emitted = self._commit(batch, *self._deciding(plans, rows), h, features)
            if decoding == len(batch):  # a pure decode step measures the decoding (no prefill inside)
                self.decoding.end_step(emitted, device_time(self.model.device) - t0)
        failed, done = self.scheduler.retire()
        for r in done:
            self._settle(r)
        return failed + [r.seq for r in done]

    def _plan(self, r: Running, t0: float) -> list[Segment]:
        """A request's segments, the last of which decides its tokens: a running request's rows; the
        next part of its prefill (the scheduler's), whose last row gives its first token when it ends
        the prompt, or, where the decoding's first pass takes the prompt's last token (lossy early
        exit), the prefill's last part and that pass in the same forward (each layer writes the
        prefill's K/V before the pass reads them)."""
        if r.prefilled:
            return [self.decoding.plan(r)]
        start, end = self.scheduler.part(r)
        if not r.prefill_since:  # its first part (after any cached prompt rows)
            r.prefill_since = t0
        prefill = [Segment(torch.tensor(r.seq.prompt_ids[start:end], device=self.model.device), r.cache,
                           self.model.range_inputs(start, end - start, prompt=True))] if end > start else []
        r.prefill_done, n = end, self.decoding.prefill_length(r.seq)
        if end < n or n == len(r.seq.prompt_ids):  # more parts to come, or the last row gives the first token
            return prefill
        self._start(r, [], None)
        return prefill + [self.decoding.plan(r)]

    @staticmethod
    def _deciding(plans: list[list[Segment]], rows: list[int]) -> tuple[list[int], list[int]]:
        """Per request, where its deciding segment's final rows start in the forward's output, and how many."""
        firsts, counts, offset, k = [], [], 0, 0
        for plan in plans:
            offset += sum(rows[k : k + len(plan) - 1])
            k += len(plan)
            firsts.append(offset)
            counts.append(rows[k - 1])
            offset += rows[k - 1]
        return firsts, counts

    def _commit(self, batch: list[Running], firsts: list[int], rows: list[int], h: torch.Tensor,
                features: torch.Tensor | None) -> int:
        """Choose every request's tokens from its rows' logits (a newcomer: its prompt's last row)
        with one LM-head call and one host read, then commit them; returns how many tokens were
        emitted. A request whose rows left the forward early (an exit) already has its verdict."""
        picks = []
        for r, offset, n in zip(batch, firsts, rows):
            if not n:
                pick = range(0)
            elif r.prefilled:
                pick = self.decoding.picks(r, n)
            else:  # a prefill's part: the prompt's last row gives the first token
                pick = range(n - 1, n) if r.prefill_done == len(r.seq.prompt_ids) else range(0)
            picks.append(range(offset + pick.start, offset + pick.stop))
        logits = self.model.logits(self._rows(h, picks)) if any(picks) else None
        verdicts = self._verdicts(batch, picks, logits)
        now = device_time(self.model.device)
        total = 0
        for r, first, n, verdict in zip(batch, firsts, rows, verdicts):
            feats = None if features is None else features[first : first + n]
            if NONFINITE_TOKEN in verdict:  # NaN or Inf logits: the request ends with an error, no one else does
                r.seq.append(NONFINITE_TOKEN)
                continue
            if r.prefilled:
                first = not r.seq.output_ids  # a lossy first pass that rode on its prompt's last part
                emitted = self.decoding.commit(r, verdict, feats)
            elif r.prefill_done < len(r.seq.prompt_ids):  # a part of its prompt: its K/V written, no token yet
                if feats is not None:
                    r.prompt_features.append(feats)
                continue
            else:
                first, emitted = True, verdict
                if r.prompt_features:
                    feats = torch.cat([*r.prompt_features, feats])
                self._start(r, verdict, feats)
            for token in emitted:
                r.seq.append(token)
                if r.seq.finished:
                    break
            if first:  # the prefill (all its parts) ends with this forward; decoding is timed from here
                r.seq.stats.prefill_seconds, r.decode_since = now - r.prefill_since, now
                r.first_tokens = len(r.seq.output_ids)  # its first tokens: the output was empty before
            r.decoded_until = now
            if emitted:
                r.last = emitted[-1]
            total += len(emitted)
        return total

    def _verdicts(self, batch: list[Running], picks: list[range], logits: torch.Tensor | None) -> list[list[int]]:
        """Every request's verdict as host ints, all read at once (the step's one host read). A greedy
        plain row's token is its argmax, from one call over every row of the step, not one a request;
        the others come from the decoding's `choose` (a prefill's last row: `sample`)."""
        takes = [len(pick) == 1 and (self.decoding.takes_argmax(r) if r.prefilled else r.seq.params.greedy)
                 for r, pick in zip(batch, picks)]
        best = greedy(logits) if any(takes) else None
        chosen, row = [], 0  # per request: its row of `best`, a device tensor, or host ints already
        for r, pick, argmax in zip(batch, picks, takes):
            own = None if logits is None or argmax else logits[row : row + len(pick)]
            if argmax:
                chosen.append(row)
            elif r.prefilled:
                chosen.append(self.decoding.choose(r, own))
            else:
                chosen.append(sample(own, r.seq.params, r.generator) if len(pick) else [])
            row += len(pick)
        on_device = ([] if best is None else [best]) + [v for v in chosen if isinstance(v, torch.Tensor)]
        read = torch.cat(on_device) if len(on_device) > 1 else on_device[0] if on_device else None
        values = [] if read is None else read.tolist()
        verdicts, at = [], 0 if best is None else best.shape[0]
        for v in chosen:
            if isinstance(v, int):
                verdicts.append([values[v]])
            elif isinstance(v, torch.Tensor):
                verdicts.append(values[at : at + v.shape[0]])
                at += v.shape[0]
            else:
                verdicts.append(v)
        return verdicts

    @staticmethod
    def _rows(h: torch.Tensor, picks: list[range]) -> torch.Tensor:
        """The rows of h the picks name, in order: a view where they run on without a gap (every
        request's rows, a decode step: each cold torch call after the layers cost 15-40 us), else a gather."""
        spans = [p for p in picks if p]
        if all(a.stop == b.start for a, b in zip(spans, spans[1:])):
            return h[spans[0].start : spans[-1].stop]
        return h.index_select(0, torch.cat([torch.arange(p.start, p.stop) for p in spans]).to(h.device))

    def _start(self, r: Running, first: list[int], features: torch.Tensor | None) -> None:
        """The request's prefill is done (its first token, if the prefill gave one); its decoding starts."""
        r.prefilled = True
        r.last = first[0] if first else r.seq.prompt_ids[-1]
        r.cache.length = self.decoding.prefill_length(r.seq)
        self.decoding.start(r, features)

    def _settle(self, r: Running) -> None:
        """A finished request's decode timing and its decoding's stats."""
        stats = r.seq.stats
        if r.prefilled:
            stats.decode_seconds = r.decoded_until - r.decode_since
            stats.decode_tokens = len(r.seq.output_ids) - r.first_tokens
            stats.speculative = self.decoding.stats(r, stats.decode_seconds)
