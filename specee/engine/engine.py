"""The engine: requests in, one step at a time (shaped like vLLM's LLMEngine).

`add_request` queues a Sequence; `step()` advances the running batch by one decode step (a
full-depth step of every row, one early-exit token, or one draft-verify round) and returns
the sequences that finished in it. The scheduler forms a batch when nothing runs: full depth
takes every waiting request (each row keeps its own SamplingParams); early exit and
speculative decoding decide per token and take one request at a time. `LLM.generate` and
`LLM.stream` are loops over `step()` in the caller's thread.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from .sequence import Sequence


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

    decode(batch): a generator yielding after each step of the batch (engine/full_depth.py,
    engine/early_exit.py, spec/speculative.py); batched(): whether that decoder takes batches."""

    def __init__(self, decode: Callable[[list[Sequence]], Iterator[None]], batched: Callable[[], bool]):
        self.decode, self.batched = decode, batched
        self.scheduler = Scheduler()
        self.running: list[Sequence] = []
        self._steps: Iterator[None] | None = None

    def add_request(self, seq: Sequence) -> None:
        self.scheduler.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.scheduler.waiting)

    def step(self) -> list[Sequence]:
        """One step of the running batch (admitting the next one if none runs); returns the
        sequences that finished in it."""
        if not self.running:
            if not self.scheduler.waiting:
                return []
            self.running = self.scheduler.next_batch(self.batched())
            self._steps = self.decode(self.running)
        before = [s.finished for s in self.running]
        done = next(self._steps, StopIteration) is StopIteration
        finished = [s for s, was in zip(self.running, before) if s.finished and not was]
        if done or all(s.finished for s in self.running):
            self._close()
        return finished

    def abort(self, seq: Sequence) -> None:
        """Drop a request (a closed stream): a running batch that holds it stops decoding."""
        if seq in self.running:
            self._close()
        elif seq in self.scheduler.waiting:
            self.scheduler.waiting.remove(seq)

    def _close(self) -> None:
        if self._steps is not None:
            self._steps.close()  # runs the decoder's finally: its timing and stats
        self.running, self._steps = [], None
