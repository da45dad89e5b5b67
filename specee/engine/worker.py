"""The engine thread: one background thread owns `Engine.step()`; any thread submits and aborts.

Only this thread touches the engine (`add_request`, `step`, `abort`): `submit` and `abort` queue
commands to it. After each step every live request gets a `Delta` (its new token ids and text) on
its own sink: a thread-safe queue for plain threads, or a callback run on an event loop (`loop_sink`:
the server's, or an asyncio queue's `put_nowait`). A request whose validation, admission or step raises
ends with `seq.fail(message)`; the thread itself never dies from a request.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from .sequence import RequestOutput, Sequence
from .threads import ThreadPolicy, release_openmp_pool

log = logging.getLogger(__name__)
IN_FLIGHT = "requests are in flight on this LLM: change its decoding, scheduling or KV cache between requests"


@dataclass
class Delta:
    """What one request produced since its last delta; `output` is set on the last one."""

    request_id: str
    token_ids: list[int]
    text: str
    output: RequestOutput | None = None
    tag: object = None  # the submitter's label (a choice index), so one sink can serve several requests

    @property
    def finished(self) -> bool:
        return self.output is not None


def loop_sink(loop: asyncio.AbstractEventLoop, callback: Callable[[Delta], None]) -> Callable[[Delta], None]:
    """A sink that calls `callback` with each delta on the event loop `loop` (the engine thread only queues
    the call): an asyncio queue's `put_nowait`, or the server's per-request bookkeeping."""
    return lambda delta: loop.call_soon_threadsafe(callback, delta)


class RequestHandle:
    """One submitted request as its consumer sees it. Iterating it (in any thread) yields its
    deltas until the last; with a custom sink, the sink gets them instead."""

    def __init__(self, seq: Sequence, sink: Callable[[Delta], None] | None, tag: object):
        self.seq, self.tag = seq, tag
        self.request_id = seq.request_id
        self.exception: BaseException | None = None  # what made it fail, when something raised
        self._queue: queue.SimpleQueue[Delta] = queue.SimpleQueue()
        self.sink = sink or self._queue.put
        self._sent_ids = 0
        self.done = threading.Event()

    def __iter__(self) -> Iterator[Delta]:
        while True:
            delta = self._queue.get()
            yield delta
            if delta.finished:
                return

    def result(self, timeout: float | None = None) -> RequestOutput:
        """The finished output (blocks until the request ends)."""
        if not self.done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        return self.seq.output()

    def _emit(self) -> bool:
        """Hand the consumer what is new (the engine thread, or the submitting one once the thread has
        stopped); True once the request has ended."""
        seq = self.seq
        ids = seq.output_ids[self._sent_ids:]
        self._sent_ids += len(ids)
        text = seq.take_stream_delta()
        if not (ids or text or seq.finished):
            return False
        try:
            self.sink(Delta(self.request_id, ids, text, seq.output() if seq.finished else None, self.tag))
        except Exception:  # noqa: BLE001 -- a consumer gone (its event loop closed) must not end the thread
            log.exception("specee engine: could not deliver to request %s", self.request_id)
        if seq.finished:
            self.done.set()
        return seq.finished


class EngineThread:
    """Runs `engine.step()` in a daemon thread while requests are in flight, sleeping otherwise.

    Each request is checked (`engine.check`) on this thread before `add_request`, so one that
    cannot run fails alone. Every submitted request goes to the engine at the next step; the
    engine's scheduler decides when it runs (`max_num_seqs`, the KV-cache budget)."""

    def __init__(self, engine, name: str = "specee-engine"):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: deque[RequestHandle] = deque()  # submitted, not yet given to the engine
        self._running: dict[str, RequestHandle] = {}  # given to the engine, not yet ended
        self._stopping = False
        self._lock = threading.Lock()  # orders submits against the thread's end (`_stopped`)
        self._stopped = False
        self._handles: list[RequestHandle] = []  # submitted ones, the ended pruned at each submit (`busy`)
        # what this thread decodes with (torch's count is per OS thread): the LLM's ThreadPolicy, asked
        # before each step, where an automatic one measures again once due (a machine that turns busy
        # while a server runs, or during a long generate); None: torch's default
        self.threads: ThreadPolicy | None = None
        self._applied_threads: int | None = None
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    # ---- any thread ---------------------------------------------------------------------
    def submit(self, seq: Sequence, sink: Callable[[Delta], None] | None = None, tag: object = None) -> RequestHandle:
        return self.submit_all([seq], sink, [tag])[0]

    def submit_all(self, seqs: list[Sequence], sink: Callable[[Delta], None] | None = None,
                   tags: list[object] | None = None) -> list[RequestHandle]:
        """Requests that reach the engine together: the step that admits one admits all that fit (a
        batch submitted one by one could start its first step with only the first request)."""
        release_openmp_pool()  # this thread's idle OpenMP threads would slow the engine thread's
        handles = [RequestHandle(seq, sink, tag) for seq, tag in zip(seqs, tags or [None] * len(seqs))]
        with self._lock:
            if not self._stopped:
                self._handles = [h for h in self._handles if not h.done.is_set()] + handles
                self._commands.put(("submit", handles))
                return handles
        for handle in handles:  # the thread has ended (LLM.close()): they end as the ones in flight did
            handle.seq.abort()
            handle._emit()
        return handles

    @property
    def busy(self) -> bool:
        """Whether a submitted request has not ended yet."""
        with self._lock:
            return self._busy()

    def swap_engine(self, engine) -> None:
        """Decode with `engine` from the next step on; refused while a request is in flight (it would be
        dropped with the old engine), under the lock that submits take."""
        self.while_idle(lambda: setattr(self, "engine", engine))

    def while_idle(self, work: Callable[[], None]) -> None:
        """Run `work` in the caller's thread with no request in flight and none submitted meanwhile;
        refused (IN_FLIGHT) otherwise."""
        with self._lock:
            if self._busy():
                raise RuntimeError(IN_FLIGHT)
            work()

    def _busy(self) -> bool:
        return any(not h.done.is_set() for h in self._handles)

    def abort(self, request_id: str) -> None:
        """Stop a request at the next step; it ends with finish_reason "abort" (unless it ended first)."""
        self._commands.put(("abort", request_id))

    @property
    def num_running(self) -> int:
        """Requests the engine decodes now: its scheduler's running ones. The others it holds wait their
        turn (max_num_seqs, the KV-cache budget), as do those not yet given to it."""
        return self.engine.num_running()

    @property
    def num_parked(self) -> int:
        """Requests the engine parked out of its KV pool (their rows in host memory) until blocks come free."""
        return self.engine.num_parked()

    def stop(self, timeout: float | None = None) -> None:
        """End the thread after aborting what is in flight (from the thread itself: without waiting)."""
        self._commands.put(("stop", None))
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout)

    # ---- the engine thread --------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopping:
            idle = not (self._running or self._waiting)
            if idle:  # an idle pool here would throttle whoever decodes next (a user stepping the engine)
                release_openmp_pool()
            self._take_commands(block=idle)
            self._admit()
            if self._running:
                self._step()
            for rid in [rid for rid, h in self._running.items() if h._emit()]:
                del self._running[rid]
        with self._lock:  # a submit from now on ends at once; those queued before end here
            self._stopped = True
        self._take_commands(block=False)
        for handle in [*self._running.values(), *self._waiting]:
            self._abort(handle)

    def _take_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(block=block)
            while True:
                self._do(*command)
                command = self._commands.get_nowait()
        except queue.Empty:
            pass

    def _do(self, what: str, arg) -> None:
        if what == "submit":
            self._waiting.extend(arg)
        elif what == "abort":
            handle = self._running.get(arg) or next((h for h in self._waiting if h.request_id == arg), None)
            if handle is not None:
                self._abort(handle)
        elif what == "stop":
            self._stopping = True

    def _abort(self, handle: RequestHandle) -> None:
        seq = handle.seq
        if handle.request_id in self._running:
            self._guard(lambda: self.engine.abort(seq), [handle], "abort")
            del self._running[handle.request_id]
        else:
            self._waiting.remove(handle)
        seq.abort()
        handle._emit()

    def _admit(self) -> None:
        while self._waiting:
            handle = self._waiting.popleft()

            def add(seq=handle.seq) -> None:
                self.engine.check(seq)
                self.engine.add_request(seq)
            if self._guard(add, [handle], "admission") and not handle.seq.finished:
                self._running[handle.request_id] = handle
                if self.threads is not None:  # what it decodes with (a later change: _step)
                    handle.seq.stats.ran_on(self.threads.choice)
            else:
                handle._emit()

    def _step(self) -> None:
        if self.threads is not None:
            choice = self.threads.refresh()
            if choice.threads != self._applied_threads:
                torch.set_num_threads(choice.threads)
                self._applied_threads = choice.threads
                for h in self._running.values():  # their stats line says what they decode with now
                    h.seq.stats.ran_on(choice)
        if not self._guard(self.engine.step, list(self._running.values()), "step"):
            return
        if not self.engine.has_unfinished():  # nothing left inside: whatever is unfinished was dropped
            for h in self._running.values():
                if not h.seq.finished:
                    h.seq.fail("the engine dropped this request without finishing it")

    def _guard(self, call: Callable[[], object], handles: list[RequestHandle], what: str) -> bool:
        """Run `call`; if it raises, the requests it concerned fail with its message (and leave the engine)."""
        try:
            call()
            return True
        except Exception as e:  # noqa: BLE001 -- a request's error must not end the thread
            message = " ".join(str(e).split()) or type(e).__name__
            # a refused request is routine; a step that raises is a bug worth its traceback
            log.warning("specee engine: %s failed for %d request(s): %s", what, len(handles), message,
                        exc_info=what == "step")
            for h in handles:
                if h.seq.finished:
                    continue
                h.exception = e
                try:
                    self.engine.abort(h.seq)
                except Exception:  # noqa: BLE001 -- the engine may no longer hold it
                    pass
                h.seq.fail(message)
            return False
