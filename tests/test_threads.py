"""CPU threads: --threads on every command that runs a model, LLM(threads=), the automatic choice
(engine/threads.py: the fastest count measured on a decode step) and the stats that report it."""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from conftest import real_model_dir

from specee import LLM, SamplingParams, cli
from specee.engine import threads
from specee.engine.threads import ThreadChoice, ThreadPolicy, candidates, check_threads, choose_prefetch, choose_threads
from specee.model import kernels

from conftest import MODELS
from checkpoints import VARIANTS, make_checkpoint

STORIES = MODELS / "stories260K"
needs_stories = pytest.mark.skipif(not STORIES.is_dir(), reason=f"shared models not found at {STORIES}")
MODEL_COMMANDS = [["generate", "--prompt", "hi"], ["chat"], ["calibrate", "-o", "x"], ["distill", "-o", "x"],
                  ["train-draft", "-o", "x"], ["bench", "speed"], ["bench", "quality"], ["bench", "oracle"],
                  ["bench", "sweep"]]


@pytest.fixture(autouse=True)
def keep_torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("command", MODEL_COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_every_command_that_runs_a_model_takes_threads(command):
    assert cli.build_parser().parse_args([*command, "--threads", "3"]).threads == 3


@pytest.mark.parametrize("value", ["0", "-1", "1.5", "two"])
@pytest.mark.parametrize("command", [MODEL_COMMANDS[0], MODEL_COMMANDS[5]], ids=["generate", "bench"])
def test_bad_thread_counts_are_one_line_naming_the_flag(capsys, command, value):
    assert cli.main([*command, f"--threads={value}"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--threads" in last and "positive integer" in last and repr(value) in last


@pytest.mark.parametrize("value", [0, -2, 1.5, "2", True])
def test_llm_refuses_bad_thread_counts_before_loading(value):
    with pytest.raises(ValueError, match=r"^threads must be a positive integer"):
        LLM("/nonexistent/model", threads=value)
    assert check_threads(None) is None and check_threads(4) == 4


def sleeper(ms_by_threads: dict[int, float]):
    """A step that takes a set time under each thread count (what a busy machine's steps look like)."""
    return lambda: time.sleep(ms_by_threads[torch.get_num_threads()] / 1e3)


@pytest.mark.parametrize("fast", [1, 2])
def test_the_automatic_choice_is_the_faster_count_and_sets_it(fast):
    slow = 3 - fast
    choice = choose_threads(sleeper({fast: 2.0, slow: 6.0}), [1, 2])
    assert choice.threads == fast == torch.get_num_threads()
    assert choice.step_ms[fast] < choice.step_ms[slow]


def test_a_count_far_slower_stops_being_timed(monkeypatch):
    monkeypatch.setattr(threads, "BURST_SECONDS", 0.0)  # one step a timing
    calls = {1: 0, 2: 0}

    def step():
        n = torch.get_num_threads()
        calls[n] += 1
        time.sleep(0.001 if n == 1 else 0.02)
    assert choose_threads(step, [1, 2]).threads == 1
    assert calls == {1: 2, 2: 2}  # a warm-up and one timed step each: 2 was out after the first round


@pytest.fixture
def kernel():
    """The C++ kernels, their prefetch setting restored afterwards."""
    module = kernels.cpu_kernels()
    if module is None:
        pytest.skip("no C++ kernels here")
    before = module.int4_prefetch()
    yield module
    module.int4_set_prefetch(before)


@pytest.mark.parametrize("faster", [True, False])
def test_the_int4_prefetch_setting_is_the_faster_one_and_stays_set(kernel, monkeypatch, faster):
    monkeypatch.delenv("SPECEE_INT4_PREFETCH", raising=False)
    on, step_ms = choose_prefetch(lambda: time.sleep((0.002 if kernel.int4_prefetch() == faster else 0.006)))
    assert on == faster == kernel.int4_prefetch()
    assert step_ms[faster] < step_ms[not faster]


def test_specee_int4_prefetch_sets_it_without_timing_and_refuses_other_values(kernel, monkeypatch):
    def step():
        raise AssertionError("timed although the setting was given")
    for value, want in (("0", False), ("1", True)):
        monkeypatch.setenv("SPECEE_INT4_PREFETCH", value)
        assert choose_prefetch(step) == (want, {}) and kernel.int4_prefetch() == want
    monkeypatch.setenv("SPECEE_INT4_PREFETCH", "yes")
    with pytest.raises(ValueError, match=r"^SPECEE_INT4_PREFETCH='yes': 1 .* or 0"):
        choose_prefetch(step)
    with pytest.raises(ValueError, match=r"^SPECEE_INT4_PREFETCH='yes'"):  # before looking for the model
        LLM("/nonexistent/model")


def test_a_model_with_int4_products_times_prefetching_at_load_and_a_float_one_does_not(kernel, monkeypatch, tmp_path):
    monkeypatch.delenv("SPECEE_INT4_PREFETCH", raising=False)
    path = make_checkpoint(tmp_path / "m", VARIANTS["qwen2"], seed=3)  # a vocabulary int4 can hold
    quantized = LLM(path, quantization="int4", threads=1)
    assert set(quantized.threads.prefetch_ms) == {True, False}
    assert quantized.threads.prefetch == kernel.int4_prefetch()
    float_model = LLM(path, quantization=None, threads=1)
    assert float_model.threads.prefetch is None and float_model.threads.prefetch_ms == {}


def test_a_count_fast_only_after_a_pause_loses_to_a_steady_one():
    """A busy machine as the scheduler shows it to threads that slept: 2 threads' first steps after a
    pause run fast (credited sleep), then share a core at 20 ms a step; 1 thread takes 3 ms steadily.
    Single steps interleaved would see 2 threads always at 1 ms; bursts of steps see the sharing."""
    run = {"start": 0.0, "end": 0.0}

    def step():
        if torch.get_num_threads() == 1:
            time.sleep(0.003)
            return
        now = time.perf_counter()
        if now - run["end"] > 0.002:  # back from a pause
            run["start"] = now
        time.sleep(0.001 if now - run["start"] < 0.006 else 0.02)
        run["end"] = time.perf_counter()
    choice = choose_threads(step, [1, 2])
    assert choice.threads == 1 and choice.step_ms[2] > choice.step_ms[1], choice


@pytest.mark.parametrize("ms", [{1: 50.0, 2: 48.0}, {1: 50.0, 3: 48.0, 4: 47.0}])
def test_more_threads_are_chosen_only_when_clearly_faster(ms):
    """A larger count within MORE_THREADS_MARGIN of a smaller one's step is not worth it: beside a busy
    process a probe of 2 threads at 0.94x of 1 thread's step was followed by steps at 3x. (Steps of 50
    ms: a sleep overshoots by up to ~0.8 ms on a VM, and at 10 ms that once made 9.4 ms look 0.89x.)"""
    choice = choose_threads(sleeper(ms), sorted(ms))
    assert choice.threads == 1 == torch.get_num_threads(), choice


@needs_stories
@pytest.mark.parametrize("watched_ms, slowed", [(70.0, True), (50.0, False)])
def test_a_step_slower_than_fewer_threads_measured_sets_off_a_check(watched_ms, slowed):
    """2 threads won the probe at 45 ms a step against 50 for 1; a step of 70 ms (under twice 45) says
    that probe ran ahead of the decoding after it, and the counts are measured again. (Steps of 50 ms:
    under CI's two busy workers a 10 ms sleep once took over 12.)"""
    llm = LLM(STORIES, threads=2)
    policy = llm.threads
    policy.choice = ThreadChoice(2, {1: 50.0, 2: 45.0})
    policy.step = lambda: time.sleep(watched_ms / 1e3)
    assert policy.slowed() is slowed


def test_candidates():
    assert candidates(1) == [1] and candidates(2) == [1, 2] and candidates(8) == [1, 7, 8]


@needs_stories
def test_llm_threads_given_and_chosen_show_in_the_stats(monkeypatch):
    params = SamplingParams(max_tokens=4)
    torch.set_num_threads(2)
    fixed = LLM(STORIES, threads=1)
    assert torch.get_num_threads() == 1 and fixed.threads.choice.step_ms == {}
    out = fixed.generate("Once", params)[0]
    assert out.stats.threads == 1 and out.stats.as_dict()["threads"] == 1 and out.stats.thread_probe_ms is None
    torch.set_num_threads(2)
    auto = LLM(STORIES)
    assert set(auto.threads.choice.step_ms) == {1, 2}
    out = auto.generate("Once", params)[0]
    assert out.stats.threads == auto.threads.choice.threads == torch.get_num_threads()
    assert set(out.stats.as_dict()["thread_probe_ms"]) == {1, 2}


@needs_stories
def test_an_earlier_llms_thread_count_does_not_cap_a_later_automatic_one(monkeypatch):
    """LLM(threads=1) leaves torch at 1 thread; an LLM built after it still tries torch's count from
    before (it tried 1 only, and decoded at 0.57x on an idle 2-core Xeon); a count the user sets
    himself stays the ceiling."""
    monkeypatch.setattr(threads, "_TORCH_THREADS", 2)
    monkeypatch.setattr(threads, "_set_by_llm", None)
    torch.set_num_threads(2)
    LLM(STORIES, threads=1)
    assert torch.get_num_threads() == 1
    assert set(LLM(STORIES).threads.choice.step_ms) == {1, 2}
    monkeypatch.setattr(threads, "_set_by_llm", None)
    torch.set_num_threads(1)  # the user's own setting
    assert LLM(STORIES).threads.choice.threads == 1


@needs_stories
def test_the_choice_is_measured_again_between_requests_once_due(monkeypatch):
    torch.set_num_threads(2)
    llm = LLM(STORIES)
    first = llm.threads.choice
    llm.generate("Once", SamplingParams(max_tokens=2))
    assert llm.threads.choice is first  # not due yet
    monkeypatch.setattr(ThreadPolicy, "RECHECK_SECONDS", 0.0)
    llm.generate("Once", SamplingParams(max_tokens=2))
    assert llm.threads.choice is not first and set(llm.threads.choice.step_ms) == {1, 2}  # the ceiling is kept
    held = llm.threads.choice
    llm.threads.hold()  # what `specee bench` does after loading
    llm.generate("Once", SamplingParams(max_tokens=2))
    assert llm.threads.choice is held


@needs_stories
@pytest.mark.parametrize("due", ["every step", "when a watched step slows"])
def test_a_machine_that_turns_busy_mid_request_is_measured_again_between_steps(monkeypatch, due):
    """A server hands requests straight to the engine thread, and a generate may run for minutes: the
    engine thread measures again between its steps once due, or as soon as a watched step has slowed,
    so a request whose machine turns busy half-way finishes on the count fastest then. A scripted step
    here: 2 threads faster until the request has 4 tokens, 1 thread after. Before, the count chosen
    when a request came stayed for good (2 threads beside a busy process decoded at 0.17-0.27x of idle)."""
    torch.set_num_threads(2)
    llm = LLM(STORIES)
    seqs, seen = [], []

    def scripted_step():
        busy = bool(seqs) and len(seqs[0].output_ids) >= 4
        time.sleep(0.005 if (torch.get_num_threads() == 1) == busy else 0.05)

    refresh = llm.threads.refresh

    def logged_refresh():
        choice = refresh()
        seen.append((threading.current_thread().name, choice.threads))
        return choice

    llm.threads.step = scripted_step
    monkeypatch.setattr(llm.threads, "refresh", logged_refresh)
    if due == "every step":
        monkeypatch.setattr(ThreadPolicy, "RECHECK_SECONDS", 0.0)
    else:  # a watched step 10x its count's measurement: measured again (not on the 1-thread steps after)
        monkeypatch.setattr(ThreadPolicy, "RECHECK_SECONDS", 1e9)
        monkeypatch.setattr(ThreadPolicy, "SOON_SECONDS", 0.0)
        monkeypatch.setattr(ThreadPolicy, "WATCH_SECONDS", 0.0)
        monkeypatch.setattr(ThreadPolicy, "WATCH_SHARE", float("inf"))
    (seq,) = llm._sequences("Once", SamplingParams(max_tokens=8, ignore_eos=True), False)
    seqs.append(seq)
    assert llm.worker.submit(seq).done.wait(60) and seq.finish_reason == "length"
    assert {name for name, _ in seen} == {"specee-engine"}, seen  # measured where the steps run
    counts = [n for _, n in seen]
    assert counts[0] == 2 and counts[-1] == 1 and counts == sorted(counts, reverse=True), counts
    assert seq.stats.threads == 1 and set(seq.stats.thread_probe_ms) == {1, 2}
    if due != "every step":
        assert llm.threads.checked < llm.threads.watched  # the 1-thread steps did not set off another


@needs_stories
def test_generate_threads_flag_runs_and_the_stats_line_says_so(capsys):
    code = cli.main(["generate", "--model", str(STORIES), "--prompt", "Once", "--no-chat", "--max-new-tokens", "4",
                     "--threads", "1"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert err.splitlines()[-1].endswith("; 1 thread)]")


def test_the_stats_line_says_when_fewer_threads_than_all_were_chosen():
    from specee.cli.outputs import stats_line
    from specee.engine.sequence import RequestStats

    assert stats_line(RequestStats(threads=2)).endswith("; 2 threads)")
    assert stats_line(RequestStats(threads=1, thread_probe_ms={1: 3.0, 2: 40.0})).endswith(
        "; 1 of 2 threads (the fastest measured))")


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _in_fresh_thread(work):
    """`work()`'s result, run on a new OS thread (its own OpenMP pool, none left behind: a pool ends with its thread)."""
    box = []
    t = threading.Thread(target=lambda: box.append(work()))
    t.start()
    t.join()
    return box[0]


needs_linux_omp = pytest.mark.skipif(not (os.path.isdir("/proc/self/task") and torch.backends.openmp.is_available()),
                                     reason="counts OS threads in /proc of an OpenMP build of torch")


@needs_linux_omp
def test_int4_products_run_on_the_threads_asked_for():
    """The kernels are built with OpenMP: a 2-thread product starts the calling thread's helper (it
    ran serially, whatever the count, when at::parallel_for's pragma was compiled away)."""
    from specee.model.kernels import int4_kernel
    from specee.model.quant import Int4Linear
    if int4_kernel() is None:
        pytest.skip("CPU kernels unavailable here")
    linear = Int4Linear.from_float(torch.randn(512, 256))
    x = torch.randn(2, 256)

    def product_adds_threads():
        torch.set_num_threads(2)
        before = _os_threads()
        linear(x)
        return _os_threads() - before
    assert _in_fresh_thread(product_adds_threads) == 1


@needs_linux_omp
def test_release_frees_the_calling_threads_openmp_pool():
    from specee.engine.threads import release_openmp_pool
    x = torch.randn(1 << 22)

    def counts():
        torch.set_num_threads(2)
        start = _os_threads()
        x.mul(2.0)  # large enough to run in parallel
        grown = _os_threads()
        release_openmp_pool()
        return grown - start, _os_threads() - start
    assert _in_fresh_thread(counts) == (1, 0)


@needs_linux_omp
@needs_stories
def test_a_thread_that_hands_requests_to_the_engine_leaves_no_idle_pool():
    """An idle pool elsewhere in the process makes the engine thread's parallel regions sleep and wake
    (engine/threads.py, release_openmp_pool): generate frees the caller's before its request runs."""
    llm = LLM(str(STORIES), threads=1)
    llm.generate(["warm"], SamplingParams(max_tokens=2))  # the engine thread exists, with no helper of its own
    x = torch.randn(1 << 22)

    def pool_left_after_generate():
        torch.set_num_threads(2)
        start = _os_threads()
        x.mul(2.0)  # leaves this thread an idle helper
        torch.set_num_threads(1)  # the engine thread decodes with the caller's count: none of its own
        llm.generate(["Once upon a time"], SamplingParams(max_tokens=2))
        return _os_threads() - start
    assert _in_fresh_thread(pool_left_after_generate) == 0


@needs_linux_omp
@needs_stories
def test_the_engine_thread_frees_its_openmp_pool_when_idle():
    """The README's own loop steps `llm.engine` in the caller's thread once the engine thread has
    nothing in flight: an idle pool left in the engine thread would throttle it the same way."""
    from specee.engine.threads import release_openmp_pool

    def engine_threads_left():
        llm = LLM(str(STORIES), threads=2)
        release_openmp_pool()  # this thread's pool from loading
        start = _os_threads()
        llm.generate(["Once upon a time"], SamplingParams(max_tokens=8))  # starts the engine thread; 2 threads
        deadline = time.monotonic() + 5
        while _os_threads() - start > 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        left = _os_threads() - start
        llm.worker.stop()
        return left
    assert _in_fresh_thread(engine_threads_left) == 1  # the engine thread alone, no helper


def test_more_threads_than_cpus_is_noted(capsys):
    """64 threads on 2 cores decoded SmolLM2 20x slower than 1, and nothing said why."""
    cpus = len(os.sched_getaffinity(0))
    llm = LLM(real_model_dir("stories260K"), dtype="float32", threads=cpus + 1)
    assert f"threads={cpus + 1} (--threads) is more than the {cpus} CPUs" in capsys.readouterr().err
    assert llm.threads.choice.threads == cpus + 1  # noted, not refused: the user may know better
    LLM(real_model_dir("stories260K"), dtype="float32", threads=cpus)
    assert "more than" not in capsys.readouterr().err
