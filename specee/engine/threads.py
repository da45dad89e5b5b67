"""How many CPU threads decode: the user's number, or the fastest of a few measured at load.

torch's threads meet at a barrier in every parallel region, so when another process holds a core the
descheduled thread stalls the rest: on a 2-core AMD EPYC with one busy process, SmolLM2 Q4_1 decoded
57-76 tokens/s with 2 threads and 230-257 with 1 (idle: 206-219 and 217-226). Where no number is
given, a burst of decode steps is timed with 1, all-but-one and all threads in turn, and the
fastest median wins (BENCHMARKS.md, "int4 kernel levels, threads on a busy machine", and session
22). torch's thread count is one per process: the counts tried go up to its setting when the LLM is
built (or, where that setting is an earlier LLM's choice, the setting before it), and the LLM leaves
it at the count chosen.

The same probe decides, once at load, whether int4 products of 1-3 rows prefetch their weights
(kernels/int4_common.h; 4 rows or more always do): on an Intel Xeon it took SmolLM2's four products a
layer from 157 to 110 us, on an AMD EPYC (Zen 4) decoding with it ran 0.80x of decoding without (24
of 24 alternating pairs), the CPU's own prefetchers doing better alone. SPECEE_INT4_PREFETCH=1 or 0
sets it instead.
"""
from __future__ import annotations

import ctypes
import functools
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..model.kernels import loaded_cpu_kernels
from ..model.quant import Int4Linear

PREFETCH_ENV = "SPECEE_INT4_PREFETCH"
PROBE_SECONDS = 0.2  # past this, no further round of timings (a probe of two options: about 0.2 s)
ROUNDS = (3, 7)  # rounds of timings per option: at least, at most
# Each timing runs steps back to back for at least this long. A thread that slept comes back ahead of
# a process that spins (the scheduler credits its sleep, a few ms), so single 4 ms steps interleaved
# with other counts kept showing 2 threads fast beside a busy process (3.8 against 4.3 ms for 1) and
# decoding then ran 72-87 tokens/s against 212-235 on 1 thread (SmolLM2, AMD EPYC Zen 4).
BURST_SECONDS = 0.02
# More threads are chosen only when their median step is under this share of the fewer threads': beside
# a busy process their bursts still run ahead of the decoding that follows (SmolLM2 Q4_1 on 2 cores of
# an Intel Xeon, 10 LLMs built beside a spinning process: 2 threads' probes took 1.15-1.59x of 1
# thread's in nine, 0.94x in one, and that LLM decoded at 54-66 tokens/s on 2 threads against 108-212
# on 1). Idle, 2 threads' steps take 0.56-0.75x of 1 thread's on the models measured.
MORE_THREADS_MARGIN = 0.9


@dataclass
class ThreadChoice:
    threads: int
    step_ms: dict[int, float] = field(default_factory=dict)  # median probe step per count tried; {} if given


def check_threads(threads) -> int | None:
    """`threads` if it is None or a positive integer; else a one-line ValueError."""
    if threads is None or (isinstance(threads, int) and not isinstance(threads, bool) and threads >= 1):
        return threads
    raise ValueError(f"threads must be a positive integer (or None: the fastest measured at load), got {threads!r}")


def oversubscribed(threads: int | None) -> str | None:
    """A note where `threads` is more than the CPUs this process may run on: each step's parallel
    regions then wait for threads that share a core (SmolLM2, 2 cores: 64 threads ran 20x slower)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    if threads is None or threads <= cpus:
        return None
    return (f"threads={threads} (--threads) is more than the {cpus} CPUs this process may use; decoding will be "
            f"slower than with {cpus}")


def candidates(most: int) -> list[int]:
    """1 (nothing to wait for), all but one (room for one busy process) and all."""
    return sorted({1, max(1, most - 1), most})


def fastest(step: Callable[[], object], options: list, apply: Callable[[object], object],
            margin: float = 1.0) -> tuple[object, dict]:
    """Time `step` under each option (`apply(option)` sets it), a burst of steps each in turn, so that
    a load that comes and goes hits them alike, and set the option with the fastest median; one
    warm-up step each first. A larger option wins over a smaller one only with a median under
    `margin` times the smaller's (1.0: the fastest, the smaller on a tie). An option whose fastest
    step is over twice another's slowest stops being timed (a busy machine's 2 threads took 60-360 ms
    a step against 7-16 ms: more rounds would only cost time). Returns it and the median step in ms
    per option timed."""
    times: dict = {o: [] for o in options}
    live = list(options)
    start = time.perf_counter()
    for rounds in range(ROUNDS[1]):
        if len(live) < 2 or (rounds >= ROUNDS[0] and time.perf_counter() - start > PROBE_SECONDS):
            break
        for o in live:
            apply(o)
            if rounds == 0:
                step()  # warm-up: the pool's first use, caches
            times[o].append(burst(step))
        live = [o for o in live if not any(min(times[o]) > 2 * max(times[m]) for m in live)]
    step_ms = {o: 1e3 * statistics.median(ts) for o, ts in times.items() if ts}
    best, *larger = sorted(live)
    for o in larger:
        if step_ms[o] < margin * step_ms[best]:
            best = o
    apply(best)
    return best, step_ms


def burst(step: Callable[[], object]) -> float:
    """Seconds a step over steps run back to back for at least BURST_SECONDS (one on a large model)."""
    steps, start = 0, time.perf_counter()
    while True:
        step()
        steps += 1
        elapsed = time.perf_counter() - start
        if elapsed >= BURST_SECONDS:
            return elapsed / steps


# torch's thread count before any LLM changed it, and the count an LLM set last: a later LLM's ceiling
# is torch's count unless that count is an earlier LLM's choice (LLM(threads=1), then LLM(): the second
# tried 1 thread only and decoded at 0.57x on an idle 2-core Xeon)
_TORCH_THREADS = torch.get_num_threads()
_set_by_llm: int | None = None


def set_threads(count: int) -> None:
    global _set_by_llm
    torch.set_num_threads(count)
    _set_by_llm = count


def ceiling() -> int:
    """The most threads an LLM built now may try: torch's count, or its count before an LLM set it."""
    now = torch.get_num_threads()
    return _TORCH_THREADS if now == _set_by_llm else now


def choose_threads(step: Callable[[], object], counts: list[int]) -> ThreadChoice:
    """The fastest of `counts` on `step`, set as torch's count; a larger count only where its median
    step is under MORE_THREADS_MARGIN of the count it would replace."""
    best, step_ms = fastest(step, counts, set_threads, MORE_THREADS_MARGIN)
    return ThreadChoice(best, step_ms)


def prefetch_setting() -> bool | None:
    """SPECEE_INT4_PREFETCH as a bool, None where unset; a one-line error for another value."""
    value = os.environ.get(PREFETCH_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{PREFETCH_ENV}={value!r}: 1 (int4 products prefetch) or 0 (they do not)")
    return None if value == "" else value == "1"


def uses_int4_kernels(model) -> bool:
    """Whether any of the model's products (the head's ranker included) runs specee's int4 kernels."""
    return any(isinstance(lin, Int4Linear) and lin.kernel is not None for lin in model.decode_linears())


def choose_prefetch(step: Callable[[], object]) -> tuple[bool, dict[bool, float]]:
    """Whether int4 products of 1-3 rows prefetch: SPECEE_INT4_PREFETCH if set, else the faster on
    `step`, and the median step in ms of each setting timed."""
    kernels = loaded_cpu_kernels()
    forced = prefetch_setting()
    if forced is not None:
        kernels.int4_set_prefetch(forced)
        return forced, {}
    return fastest(step, [True, False], kernels.int4_set_prefetch)


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
    at load and again between the engine thread's steps once RECHECK_SECONDS have passed, or at once
    when a watched step has slowed (a machine turns busy while a server runs or during a long
    generate, and 2 threads beside a busy process decoded at 0.17-0.27x of idle; a check costs ~0.2 s
    of decode steps there, 0.7% of its time); elsewhere torch's setting (the host only launches work)."""

    RECHECK_SECONDS = 30.0
    # Once a second (or less often, so that watching costs WATCH_SHARE of the time: a Qwen2.5-1.5B step
    # is 45 ms) one decode step is timed; over SLOWED times the last measurement of the count in force,
    # the machine has changed and the counts are measured again then, SOON_SECONDS after the last check
    # at the earliest (a load that comes and goes costs at most a probe per 5 s). On 2 threads, a
    # process that starts spinning made SmolLM2's steps 5-7x slower.
    # A watched step over FEWER_SLOWER times what fewer threads took in the last probe also sets off a
    # check: that probe ran ahead of the decoding after it (SmolLM2, beside a spinning process: a 12.4
    # ms probe of 2 threads against 13.2 for 1, then 18 ms steps on 2, under SLOWED, for 12 s).
    WATCH_SECONDS = 1.0
    WATCH_SHARE = 0.005
    SOON_SECONDS = 5.0
    SLOWED = 2.0
    FEWER_SLOWER = 1.2

    def __init__(self, model, threads: int | None):
        self.most = ceiling()  # the ceiling of the counts tried, kept across checks
        self.auto = threads is None and model.device.type == "cpu"
        int4 = model.device.type == "cpu" and uses_int4_kernels(model)
        self.step = decode_step(model) if self.auto or int4 else None
        if threads is not None:
            set_threads(threads)
        self.choice = ThreadChoice(threads or self.most)
        self.checked = self.watched = -float("inf")
        self.watched_step = 0.0  # seconds the last watched step took
        self.refresh()
        # after the thread count: measured at the count that decodes; {} where nothing was timed
        self.prefetch, self.prefetch_ms = choose_prefetch(self.step) if int4 else (None, {})

    def hold(self) -> None:
        """Keep the count chosen so far (a benchmark compares configurations under one count)."""
        self.auto = False

    def refresh(self) -> ThreadChoice:
        """Re-measure when automatic and due, or when a watched step has slowed; the choice in force."""
        if self.auto:
            now = time.monotonic()
            since = now - self.checked
            watch_gap = max(self.WATCH_SECONDS, self.watched_step / self.WATCH_SHARE)
            if since >= self.RECHECK_SECONDS or (since >= self.SOON_SECONDS and now - self.watched >= watch_gap
                                                 and self.slowed()):
                self.choice = choose_threads(self.step, candidates(self.most))
                self.checked = self.watched = time.monotonic()
        return self.choice

    def slowed(self) -> bool:
        """Whether one decode step now takes over SLOWED times the last measurement of this count, or
        over FEWER_SLOWER times that of a smaller count."""
        self.watched = time.monotonic()
        before = self.choice.step_ms.get(self.choice.threads)
        fewer = [ms for count, ms in self.choice.step_ms.items() if count < self.choice.threads]
        start = time.perf_counter()
        self.step()
        self.watched_step = time.perf_counter() - start
        ms = self.watched_step * 1e3
        return before is not None and (ms > self.SLOWED * before or bool(fewer) and ms > self.FEWER_SLOWER * min(fewer))
