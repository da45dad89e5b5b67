"""The scheduler: waiting and running requests, and which of them run in the next step.

A request is checked when it is added (empty prompt, context, the cache pool's size): one that can
never run ends at once with finish_reason "error" and its message, and nobody else sees it. A
waiting request is admitted, in arrival order, when a running slot (`max_num_seqs`), the step's
token budget (`max_num_batched_tokens`: prompt rows of newcomers plus one row per running request)
and a run of cache blocks are free; otherwise it waits. Admission reserves all the cache the
request can use, so a running request never stalls for memory.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from ..model.kv_cache import ContextLengthError, KVCache
from .kv_manager import KVCacheManager
from .sequence import Sequence


def check_fits(context_limit: int, prompt_len: int, max_tokens: int) -> int:
    """Cache length a request needs; a clear error if it exceeds the model's context."""
    if prompt_len == 0:
        raise ValueError("empty prompt: at least one token is needed")
    needed = prompt_len + max_tokens
    if needed > context_limit:
        raise ContextLengthError(
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {needed} exceeds the model's "
            f"context of {context_limit} tokens; shorten the prompt or lower max_tokens")
    return needed


def runnable(seq: Sequence, check, failed: list[Sequence]) -> bool:
    """Whether `check(seq)` passes; if not, the request ends with its error and joins `failed`."""
    try:
        check(seq)
    except ValueError as e:
        seq.fail(str(e))
        failed.append(seq)
        return False
    return True


@dataclass
class Running:
    """A running request: its sequence, its cache (a run of pool blocks), and its decoding state."""

    seq: Sequence
    cache: KVCache
    generator: torch.Generator | None
    prefilled: bool = False
    last: int = -1  # the last emitted token, whose K/V the next step writes
    state: Any = None  # the decoding's per-request state (a drafter, speculation stats, this step's draft)
    decode_since: float = 0.0


class Scheduler:
    def __init__(self, kv: KVCacheManager, context_limit: int, extra_rows: int, max_num_seqs: int,
                 max_num_batched_tokens: int):
        self.kv, self.context_limit, self.extra_rows = kv, context_limit, extra_rows
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Running] = []
        self.failed: list[Sequence] = []  # ended at add_request; returned by the next step

    def check(self, seq: Sequence) -> None:
        """Raise ValueError if the request can never run here."""
        needed = check_fits(self.context_limit, len(seq.prompt_ids), seq.params.max_tokens) + self.extra_rows
        if needed > self.kv.capacity:
            raise ValueError(f"the request needs {needed} cache slots but the KV cache holds {self.kv.capacity} "
                             f"tokens; lower max_tokens or raise kv_cache_memory (--kv-cache-memory)")

    def add(self, seq: Sequence) -> None:
        """Queue a request; one that can never run ends at once with an error (returned by `retire`)."""
        if runnable(seq, self.check, self.failed):
            self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.failed)

    def schedule(self) -> list[Running]:
        """The requests of the next step: the running ones, then newcomers admitted in order."""
        budget = self.max_num_batched_tokens - len(self.running)
        admitted = 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if admitted and len(seq.prompt_ids) > budget:  # one newcomer always fits a step
                break
            cache = self.kv.allocate(seq.request_id, len(seq.prompt_ids) + seq.params.max_tokens + self.extra_rows)
            if cache is None:  # waits for blocks to come free (first come, first served)
                break
            self.waiting.popleft()
            seq.stats.scheduled_time = time.monotonic()
            self.running.append(Running(seq, cache, seq.params.make_generator(cache.k.device)))
            budget -= len(seq.prompt_ids)
            admitted += 1
        return self.running

    def retire(self) -> tuple[list[Sequence], list[Running]]:
        """The requests that ended since the last call: those refused at add_request, and the running
        ones that finished, which leave the batch and give their blocks back."""
        failed, self.failed = self.failed, []
        done = [r for r in self.running if r.seq.finished]
        if done:
            self.running = [r for r in self.running if not r.seq.finished]
            for r in done:
                self.kv.free(r.seq.request_id)
        return failed, done

    def abort(self, seq: Sequence) -> Running | None:
        """Take `seq` out, waiting or running (it finishes as "abort"; its blocks come free now).
        Returns its running state, if it was running."""
        running = next((r for r in self.running if r.seq is seq), None)
        if running is not None:
            self.running = [r for r in self.running if r is not running]
            self.kv.free(seq.request_id)
        else:  # by identity: two requests with the same prompt and parameters compare equal
            self.waiting = deque(s for s in self.waiting if s is not seq)
        if not seq.finished:
            seq.finish_reason = "abort"
            seq.stats.finish_time = time.monotonic()
        return running
