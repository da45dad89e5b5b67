"""The engine: requests in, one step at a time (shaped like vLLM's LLMEngine).

`add_request` queues a Sequence; `step()` advances the running batch by one decode step (a
full-depth step of every row, an early-exit pass, or one draft-verify round) and returns
the sequences that finished in it. Full depth batches continuously: a request added while a
full-depth batch runs joins it at the next step, and finished requests leave it (each row keeps
its own SamplingParams). Lossy one-token early exit decodes the waiting requests as one batch
(no newcomers until it ends); speculative decoding and lossless early exit take one request at
a time. `LLM.generate` and `LLM.stream` are loops over `step()` in the caller's thread.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Protocol, runtime_checkable

from .sequence import Sequence


@runtime_checkable
class ContinuousBatch(Protocol):
    """What a batched decoder returns (full_depth.FullDepthBatch): an iterator of steps that takes
    newcomers and lets a request go between steps."""

    def __next__(self) -> None: ...

    def add(self, seqs: list[Sequence]) -> None: ...

    def drop(self, seq: Sequence) -> None: ...

    def close(self) -> None: ...


class Scheduler:
    """Waiting requests, in arrival order, and how the next batch is formed from them."""

    def __init__(self) -> None:
        self.waiting: deque[Sequence] = deque()

    def next_batch(self, batched: bool) -> list[Sequence]:
        """The oldest request alone, or with `batched` every waiting one."""
        if not batched:
            return [self.waiting.popleft()]
        batch, self.waiting = list(self.waiting), deque()
        return batch


class Engine:
    """Steps the decoder chosen at admission over the scheduler's batches.

    decode(batch): the decoder's steps over a new batch (every waiting request where batched()
    holds, else the oldest): a generator yielding after each step (engine/early_exit.py,
    spec/speculative.py), or a ContinuousBatch (engine/full_depth.py) that later requests join
    while batched() still holds.
    running: the requests in the running batch that have not finished."""

    def __init__(self, decode: Callable[[list[Sequence]], Iterator[None]], batched: Callable[[], bool]):
        self.decode, self.batched = decode, batched
        self.scheduler = Scheduler()
        self.running: list[Sequence] = []
        self._steps: Iterator[None] | None = None
        self._batch: ContinuousBatch | None = None  # the running batch, when it takes newcomers

    def add_request(self, seq: Sequence) -> None:
        self.scheduler.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.scheduler.waiting)

    def step(self) -> list[Sequence]:
        """One step of the running batch (admitting waiting requests into it, or forming the next
        batch if none runs); returns the sequences that finished in it."""
        if not self.running:
            if not self.scheduler.waiting:
                return []
            batched = self.batched()
            batch = self.scheduler.next_batch(batched)
            self._steps = self.decode(batch)
            self._batch = self._steps if isinstance(self._steps, ContinuousBatch) else None
            self.running = batch
        elif self.scheduler.waiting and self._batch is not None and self.batched():
            newcomers = self.scheduler.next_batch(True)
            self._batch.add(newcomers)  # refuses them all, before any work, if one does not fit
            self.running += newcomers
        try:
            done = next(self._steps, StopIteration) is StopIteration
        except BaseException:
            self._close()  # a decoder that raised is done: its requests cannot go on
            raise
        finished = [s for s in self.running if s.finished]
        if finished:
            self.running = [s for s in self.running if not s.finished]
        if done or not self.running:
            self._close()
        return finished

    def abort(self, seq: Sequence) -> None:
        """Drop a request (a closed stream), which finishes as "abort": a continuous batch lets it go
        and runs on; another batch of several keeps its row, idle, to its end; a request decoding
        alone stops."""
        if any(s is seq for s in self.running):
            seq.finish_reason = seq.finish_reason or "abort"
            if len(self.running) == 1:
                self._close()
                return
            if self._batch is not None:
                self._batch.drop(seq)
            self.running = [s for s in self.running if s is not seq]
        else:  # by identity: two requests with the same prompt and parameters compare equal
            self.scheduler.waiting = deque(s for s in self.scheduler.waiting if s is not seq)

    def _close(self) -> None:
        if self._steps is not None:
            self._steps.close()  # runs the decoder's own bookkeeping: its timing and stats
        self.running, self._steps, self._batch = [], None, None
