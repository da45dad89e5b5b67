"""The engine of the early-exit modes, which do not run on the batched engine core yet
(engine/engine.py); same interface: add_request, step, abort, has_unfinished.

Lossy one-token early exit decodes the waiting requests as one batch (no newcomers until it
ends); lossless early exit and exits inside verification take one request at a time
(engine/early_exit.py). A request that can never run ends at `add_request` with an error.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from .scheduler import check_fits, runnable
from .sequence import Sequence


class ExclusiveEngine:
    """Steps the early-exit decoder over one batch of waiting requests at a time.

    decode(batch): a generator yielding after each pass over a new batch (every waiting request
    where batched() holds, else the oldest)."""

    def __init__(self, decode: Callable[[list[Sequence]], Iterator[None]], batched: Callable[[], bool],
                 context_limit: int):
        self.decode, self.batched, self.context_limit = decode, batched, context_limit
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.failed: list[Sequence] = []  # ended at add_request; returned by the next step
        self._steps: Iterator[None] | None = None

    def check(self, seq: Sequence) -> None:
        check_fits(self.context_limit, len(seq.prompt_ids), seq.params.max_tokens)

    def add_request(self, seq: Sequence) -> None:
        if runnable(seq, self.check, self.failed):
            self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting or self.failed)

    def step(self) -> list[Sequence]:
        """One pass of the running batch (forming the next batch if none runs); returns the
        sequences that finished in it."""
        finished, self.failed = self.failed, []
        if not self.running:
            if not self.waiting:
                return finished
            if self.batched():
                self.running, self.waiting = list(self.waiting), deque()
            else:
                self.running = [self.waiting.popleft()]
            self._steps = self.decode(self.running)
        try:
            done = next(self._steps, StopIteration) is StopIteration
        except Exception as e:  # a decoder that raised is done: its requests end with the error
            for s in self.running:
                s.fail(f"{type(e).__name__}: {e}")
            finished += self.running
            self._close()
            return finished
        finished += [s for s in self.running if s.finished]
        self.running = [s for s in self.running if not s.finished]
        if done or not self.running:
            self._close()
        return finished

    def abort(self, seq: Sequence) -> None:
        """Drop a request (finishes as "abort"): a batch of several keeps its row, idle, to its end;
        a request decoding alone stops."""
        if any(s is seq for s in self.running):
            seq.finish_reason = seq.finish_reason or "abort"
            if len(self.running) == 1:
                self._close()
                return
            self.running = [s for s in self.running if s is not seq]
        else:  # by identity: two requests with the same prompt and parameters compare equal
            self.waiting = deque(s for s in self.waiting if s is not seq)

    def _close(self) -> None:
        if self._steps is not None:
            self._steps.close()  # runs the decoder's own bookkeeping: its timing and stats
        self.running, self._steps = [], None
