"""The scheduler: waiting and running requests, and which of them run in the next step.

A request is checked when it is added (empty prompt, context, the cache pool's size): one that can
never run ends at once with finish_reason "error" and its message, and nobody else sees it. A
waiting request is admitted, in arrival order, when a running slot (`max_num_seqs`), the step's
token budget (`max_num_batched_tokens`: one row per decoding request plus the prompt rows of the
step) and a run of cache blocks are free; otherwise it waits. Its first run holds its prompt, the
draft rows of one step and up to FIRST_ROOM new tokens; before each step a run grows to hold what
the step writes (kv_manager.py). Where it cannot, the newest running request is parked: its rows
leave the pool exactly as they are, and it comes back, before any newcomer, when blocks come free,
so memory shapes only when a request's tokens come, never which (vLLM's preemption, by swapping).
Parked rows take host memory up to `swap_space` bytes; a request whose parking would pass it ends
with finish_reason "error" instead (vLLM's answer when its swap space runs out).

Prefix caching: a finished request's prompt rows stay in the pool (kv_manager.py), and a newcomer whose
prompt starts with the same whole blocks starts its prefill after them, leaving at least
MIN_PROMPT_PART rows to prefill, as a chunked prefill's next part would (the same arithmetic).

Chunked prefill: a prompt longer than `prefill_chunk` tokens is prefilled a part at a time, one part
a step, so that a long prompt does not stop everyone else's decoding for the whole of its prefill.
The parts depend on the prompt alone (scheduling.py's `prompt_part_end`), never on what shares the
step, and none is shorter than 32 rows: every part then runs the arithmetic the whole prompt would
(on the C++ layer each row's numbers do not depend on where its part starts), so chunking changes
no token. A part waits for a later step when the budget is spent; at least one runs each step.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..model.kv_cache import ContextLengthError, KVCache
from .kv_manager import KVCacheManager
from .prefix_cache import BLOCK_SIZE, block_hashes
from .scheduling import MIN_PROMPT_PART, prompt_part_end
from .sequence import Sequence

FIRST_ROOM = 256  # new tokens a request's first run holds; more as it decodes (a requested max_tokens is a bound, not a reservation)


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
    prefill_done: int = 0  # prompt tokens whose K/V the steps so far have written (chunked prefill)
    prompt_features: list[torch.Tensor] = field(default_factory=list)  # earlier parts' features (EAGLE)
    prefill_since: float = 0.0
    last: int = -1  # the last emitted token, whose K/V the next step writes
    state: Any = None  # the decoding's per-request state (a drafter, speculation stats, this step's draft)
    decode_since: float = 0.0
    decoded_until: float = 0.0  # the end of its last step's forward (its decode time ends there, not at retiring)
    first_tokens: int = 0  # what the forward that ended its prefill emitted (counted as the prefill's)
    admitted: int = 0  # admission order: the newest running request is parked first
    parked: tuple[torch.Tensor, ...] | None = None  # its run's contents while out of the pool (KVCacheManager.park)


class Scheduler:
    def __init__(self, kv: KVCacheManager, context_limit: int, extra_rows: int, max_num_seqs: int,
                 max_num_batched_tokens: int, prefill_chunk: int, prefill_length: Callable[[Sequence], int],
                 swap_space: int, prefix_caching: bool):
        """prefill_length: how many prompt tokens a request's prefill runs (its decoding's rule); swap_space:
        bytes of host memory parked requests may take; prefix_caching: whether prompts start from cached rows."""
        self.kv, self.context_limit, self.extra_rows, self.swap_space = kv, context_limit, extra_rows, swap_space
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.prefill_chunk, self.prefill_length = prefill_chunk, prefill_length
        self.prefix_caching = prefix_caching
        self.prompt_keys: dict[str, list[int]] = {}  # request id -> its prompt's block_hashes (prefix caching)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Running] = []
        self.parked: list[Running] = []  # out of the pool until blocks come free, oldest admitted first
        self.admissions = 0
        self.failed: list[Sequence] = []  # ended at add_request; returned by the next step
        self.unparkable: list[Running] = []  # ended with an error where parking would pass swap_space
        self._tried_at = (-1, 0)  # (kv.releases, running) when parked requests last tried to come back

    def check(self, seq: Sequence) -> None:
        """Raise ValueError if the request can never run here."""
        needed = check_fits(self.context_limit, len(seq.prompt_ids), seq.params.max_tokens) + self.extra_rows
        if needed > self.kv.capacity:
            raise ValueError(f"the request needs {needed} cache slots but the KV cache holds {self.kv.capacity} "
                             f"tokens; lower max_tokens or raise kv_cache_memory (--kv-cache-memory)")

    def room(self, prompt_len: int) -> int:
        """The most new tokens a request with this prompt could ever be given here: the rest of the
        context, as far as the KV cache holds it beside the decoding's extra rows."""
        return min(self.context_limit, self.kv.capacity - self.extra_rows) - prompt_len

    def add(self, seq: Sequence) -> None:
        """Queue a request; one that can never run, or whose id is in flight already, ends at once with an
        error (returned by `retire`): the cache's blocks and the engine thread's handles go by request id."""
        if runnable(seq, self.check, self.failed) and runnable(seq, self._new_id, self.failed):
            self.waiting.append(seq)
            if self.prefix_caching:  # once, not at each step it waits
                self.prompt_keys[seq.request_id] = block_hashes(seq.prompt_ids[: self.prefill_length(seq)])

    def _new_id(self, seq: Sequence) -> None:
        rid = seq.request_id
        if (any(s.request_id == rid for s in self.waiting)
                or any(r.seq.request_id == rid for r in self.running + self.parked)):
            raise ValueError(f"request_id {rid!r} is already in flight; give every request its own id")

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.parked or self.failed or self.unparkable)

    def part(self, r: Running) -> tuple[int, int]:
        """The prompt tokens [start, end) of a request's next prefill part."""
        return r.prefill_done, prompt_part_end(r.prefill_done, self.prefill_length(r.seq), self.prefill_chunk)

    def slots(self, seq: Sequence, new_tokens: int) -> int:
        """Cache slots a request needs once it has `new_tokens` tokens (with its decoding's draft rows)."""
        return len(seq.prompt_ids) + min(new_tokens, seq.params.max_tokens) + self.extra_rows

    def schedule(self) -> list[Running]:
        """The requests of the next step: the decoding ones (each run grown to hold the step's rows),
        parked ones that fit again, those in the middle of their prefill whose next part fits the budget,
        then, while nobody is parked, newcomers admitted in order while theirs fits."""
        self._make_room()
        self._bring_back()
        budget = self.max_num_batched_tokens - sum(r.prefilled for r in self.running)
        batch, prefills = [], 0
        for r in self.running:
            if not r.prefilled:
                start, end = self.part(r)
                if prefills and end - start > budget:
                    continue  # its next part waits for a step with room
                budget, prefills = budget - (end - start), prefills + 1
            batch.append(r)
        while self.waiting and not self.parked and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = self.prefill_length(seq)
            keys = self.prompt_keys.get(seq.request_id)
            prefix = self.kv.prefixes.match(seq.prompt_ids, keys, n - MIN_PROMPT_PART) if keys else None
            start = prefix[1] * BLOCK_SIZE if prefix else 0
            rows = prompt_part_end(start, n, self.prefill_chunk) - start
            if prefills and rows > budget:  # at least one prompt part runs a step
                break
            cache = self.kv.allocate(seq.request_id, self.slots(seq, FIRST_ROOM), prefix)
            if cache is None and prefix is not None:  # perhaps room only without the cached prompt
                start, prefix = 0, None
                cache = self.kv.allocate(seq.request_id, self.slots(seq, FIRST_ROOM))
            if cache is None:  # waits for blocks to come free (first come, first served)
                break
            self.waiting.popleft()
            budget, prefills = budget - rows, prefills + 1
            seq.stats.scheduled_time, seq.stats.cached_tokens = time.monotonic(), start
            r = Running(seq, cache, seq.params.make_generator(cache.k.device), prefill_done=start,
                        admitted=self.admissions)
            self.admissions += 1
            self.running.append(r)
            batch.append(r)
        return batch

    def _make_room(self) -> None:
        """Grow every decoding request's run, oldest first, to hold its next step's rows; where one cannot
        grow, park the newest running request (perhaps itself) and try again; where its rows would pass the
        swap space, it ends with an error instead."""
        short = [r for r in self.running if r.prefilled and self._need(r) > r.cache.max_len]  # most steps: none
        for r in sorted(short, key=lambda x: x.admitted):
            while r.parked is None and not r.seq.finished and not self.kv.grow(r.seq.request_id, r.cache, self._size(r)):
                if self._move_next_run(r):
                    continue
                newest = max(self.running, key=lambda x: x.admitted)
                written = max(newest.cache.length, newest.prefill_done)  # a prompt's parts so far, mid-prefill
                self.running = [x for x in self.running if x is not newest]
                if self._parked_bytes() + self.kv.park_bytes(newest.cache, written) > self.swap_space:
                    newest.seq.fail(f"the KV cache (kv_cache_memory, --kv-cache-memory) is full and parking this "
                                    f"request's {written} tokens would pass swap_space (--swap-space, "
                                    f"{self.swap_space / 2**30:g} GiB of host memory); raise either or lower max_tokens")
                    self.prompt_keys.pop(newest.seq.request_id, None)
                    self.kv.free(newest.seq.request_id)  # its blocks now, for the run that could not grow
                    self.unparkable.append(newest)
                    continue
                newest.parked = self.kv.park(newest.seq.request_id, newest.cache, written)
                self.parked = sorted(self.parked + [newest], key=lambda x: x.admitted)

    def _move_next_run(self, r: Running) -> bool:
        """Move the running request whose run follows `r`'s to free blocks elsewhere, if any are long enough:
        `r` then grows in place. (Parking the newest instead, then bringing it straight back into those
        blocks, copied its rows to host memory and back: 38 + 6 ms for 2,048 SmolLM2 slots.)"""
        first, held = self.kv.owned[r.seq.request_id]
        after = next((x for x in self.running if self.kv.owned[x.seq.request_id][0] == first + held), None)
        return after is not None and self.kv.relocate(after.seq.request_id, after.cache)

    def _parked_bytes(self) -> int:
        return sum(t.nbytes for r in self.parked for t in r.parked)

    def _need(self, r: Running) -> int:
        """The slots a decoding request's next step may write up to: from its cache length on, its token and
        draft rows (and one slot of slack), never past all it can write (prompt + max_tokens + draft rows)."""
        full = self.slots(r.seq, r.seq.params.max_tokens)
        return min(full, max(self.slots(r.seq, len(r.seq.output_ids) + 1), r.cache.length + self.extra_rows + 2))

    def _size(self, r: Running) -> int:
        """The slots a decoding request's run is to hold before its next step: room for the step's rows,
        and where the run must grow for them, room for as many new tokens again (runs double: moves are rare)."""
        need = self._need(r)
        if need <= r.cache.max_len:
            return need
        return max(need, self.slots(r.seq, 2 * (r.cache.max_len - len(r.seq.prompt_ids) - self.extra_rows)))

    def _bring_back(self) -> None:
        """Parked requests back in the pool, oldest first, each whose run fits while slots are free (one that
        does not fit yet does not hold back the others; newcomers wait until every parked one is back)."""
        if (self.kv.releases, len(self.running)) == self._tried_at:  # nothing came free since the last try
            return
        self._tried_at = self.kv.releases, len(self.running)
        for r in list(self.parked):
            if len(self.running) >= self.max_num_seqs:
                return
            size = self._size(r) if r.prefilled else self.slots(r.seq, FIRST_ROOM)
            if self.kv.restore(r.seq.request_id, r.cache, r.parked, size):
                r.parked = None
                self.parked = [x for x in self.parked if x is not r]
                self.running.append(r)

    def retire(self) -> tuple[list[Sequence], list[Running]]:
        """The requests that ended since the last call: those refused at add_request, those that could
        not be parked, and the running ones that finished, which leave the batch and give their blocks back."""
        failed, self.failed = self.failed, []
        unparkable, self.unparkable = self.unparkable, []  # their blocks went back when they ended
        done = [r for r in self.running if r.seq.finished]
        if done:
            self.running = [r for r in self.running if not r.seq.finished]
            for r in done:
                self._free(r)
        return failed, unparkable + done

    def _free(self, r: Running) -> None:
        """Give a finished request's blocks back: with prefix caching its prompt rows stay as a cached prompt;
        those of one that went wrong are zeroed (KVCacheManager.free)."""
        keys = self.prompt_keys.pop(r.seq.request_id, None)
        if r.seq.finish_reason == "error":
            self.kv.free(r.seq.request_id, zero=True)
        elif keys:
            self.kv.keep(r.seq.request_id, r.seq.prompt_ids[: r.prefill_done], keys)
        else:
            self.kv.free(r.seq.request_id)

    def abort(self, seq: Sequence) -> Running | None:
        """Take `seq` out, waiting or running (it finishes as "abort"; its blocks come free now).
        Returns its running state, if it was running."""
        running = next((r for r in self.running + self.parked if r.seq is seq), None)
        if running is not None:
            self.running = [r for r in self.running if r is not running]
            self.parked = [r for r in self.parked if r is not running]
            running.parked = None
            self.prompt_keys.pop(seq.request_id, None)
            self.kv.free(seq.request_id)  # nothing kept: a step that raised aborts requests its parts never wrote
        elif any(s is seq for s in self.waiting):  # by identity: equal prompts and parameters compare equal
            self.waiting = deque(s for s in self.waiting if s is not seq)
            self.prompt_keys.pop(seq.request_id, None)
        seq.abort()
        return running
