"""How many CPU threads decode: the user's number, or the fastest of a few measured at load.

torch's threads meet at a barrier in every parallel region, so when another process holds a core the
descheduled thread stalls the rest: on a 2-core AMD EPYC with one busy process, SmolLM2 Q4_1 decoded
57-76 tokens/s with 2 threads and 230-257 with 1 (idle: 206-219 and 217-226). Where no number is
given, one decode step is timed with 1, all-but-one and all threads, interleaved, and the fastest
median wins (BENCHMARKS.md, "int4 kernel levels, threads on a busy machine"). torch's thread count is one per process: the counts tried
go up to its setting when the LLM is built, and the LLM leaves it at the count chosen.
"""
from __future__ import annotations

import ctypes
import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

PROBE_SECONDS = 0.4  # at most about this long timing steps at load (a few rounds on a large model)
ROUNDS = (3, 7)  # interleaved rounds per thread count: at least, at most


@dataclass
class ThreadChoice:
    threads: int
    step_ms: dict[int, float] = field(default_factory=dict)  # median probe step per count tried; {} if given


def check_threads(threads) -> int | None:
    """`threads` if it is None or a positive integer; else a one-line ValueError."""
    if threads is None or (isinstance(threads, int) and not isinstance(threads, bool) and threads >= 1):
        return threads
    raise ValueError(f"threads must be a positive integer (or None: the fastest measured at load), got {threads!r}")


def candidates(most: int) -> list[int]:
    """1 (nothing to wait for), all but one (room for one busy process) and all."""
    return sorted({1, max(1, most - 1), most})


def choose_threads(step: Callable[[], object], counts: list[int]) -> ThreadChoice:
    """Time `step` under each thread count, interleaved so that a load that comes and goes hits
    them alike, and set the count with the fastest median; one warm-up step each first. A count
    whose fastest step is over twice another's slowest stops being timed (a busy machine's 2
    threads took 60-360 ms a step against 7-16 ms: more rounds would only cost time)."""
    times: dict[int, list[float]] = {n: [] for n in counts}
    live = list(counts)
    start = time.perf_counter()
    for rounds in range(ROUNDS[1]):
        if len(live) < 2 or (rounds >= ROUNDS[0] and time.perf_counter() - start > PROBE_SECONDS):
            break
        for n in live:
            torch.set_num_threads(n)
            if rounds == 0:
                step()  # warm-up: the pool's first use, caches
            t = time.perf_counter()
            step()
            times[n].append(time.perf_counter() - t)
        live = [n for n in live if not any(min(times[n]) > 2 * max(times[m]) for m in live)]
    step_ms = {n: 1e3 * statistics.median(ts) for n, ts in times.items() if ts}
    best = min(live, key=lambda n: (step_ms.get(n, 0.0), n))
    torch.set_num_threads(best)
    return ThreadChoice(best, step_ms)


def decode_step(model) -> Callable[[], object]:
    """One token through every layer and the head, at position 0 of a cache of its own: what a
    decode step costs, without touching any request's state."""
    cache = model.new_cache(1, 1)
    token = torch.zeros(1, 1, dtype=torch.long, device=model.device)
    inputs = model.range_inputs(0, 1)

    def step():
        with torch.inference_mode():
            return model.logits(model.forward(token, inputs, cache))
    return step


@functools.cache
def _omp_pause():
    """`omp_pause_resource_all` of the OpenMP runtime torch loaded, or None (no OpenMP, or too old)."""
    return getattr(ctypes.CDLL(None), "omp_pause_resource_all", None)


def release_openmp_pool() -> None:
    """Free the calling thread's idle OpenMP threads. libgomp spins between parallel regions only while
    the process holds no more OpenMP threads than cores; an idle pool left by the thread that loaded
    the model tips a 2-core machine over, and every region of the engine thread then sleeps and wakes
    (SmolLM2 Q4_1, 2 threads, AMD EPYC: 7.9 ms a decode step instead of 2.8). Threads that hand work
    to the engine thread call this; it costs nothing where there is no pool."""
    pause = _omp_pause()
    if pause is not None:
        pause(1)  # omp_pause_soft: the threads go, the runtime stays


class ThreadPolicy:
    """The thread count a model decodes with: `threads` if given; on the CPU the fastest measured
    at load and again before a request once RECHECK_SECONDS have passed (a machine's load changes
    over a chat session; a check costs a few decode steps); elsewhere torch's setting (the host
    only launches work)."""

    RECHECK_SECONDS = 30.0

    def __init__(self, model, threads: int | None):
        self.most = torch.get_num_threads()  # the ceiling of the counts tried, kept across checks
        self.auto = threads is None and model.device.type == "cpu"
        self.step = decode_step(model) if self.auto else None
        if threads is not None:
            torch.set_num_threads(threads)
        self.choice = ThreadChoice(threads or self.most)
        self.checked = -float("inf")
        self.refresh()

    def hold(self) -> None:
        """Keep the count chosen so far (a benchmark compares configurations under one count)."""
        self.auto = False

    def refresh(self) -> ThreadChoice:
        """Re-measure when automatic and due; the choice in force."""
        if self.auto and time.monotonic() - self.checked >= self.RECHECK_SECONDS:
            self.choice = choose_threads(self.step, candidates(self.most))
            self.checked = time.monotonic()
        return self.choice
