"""The engine thread (engine/worker.py): streams consumed in any order and from any thread equal
`generate`'s texts; a failing request ends alone with an error; aborts by id; asyncio consumers."""
from __future__ import annotations

import asyncio
import threading

import pytest
from conftest import real_model_dir

from specee import LLM, SamplingParams
from specee.engine.sequence import Sequence
from specee.engine.worker import loop_sink
from specee.model.kv_cache import ContextLengthError

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = ["Once upon a time", "The little dog", "Lily wanted to", "One day, a big", "Tom and Sue",
           "The sun was", "A bird sang", "Mom said"]
PARAMS = SamplingParams(max_tokens=40)
MODES = {"full_depth": None, "ngram": {"method": "ngram", "num_speculative_tokens": 3}}


@pytest.fixture(scope="module", params=list(MODES))
def llm(request):
    return LLM(real_model_dir("stories260K"), dtype="float32", speculative_config=MODES[request.param])


@pytest.fixture(scope="module")
def answers(llm):
    return [o.text for o in llm.generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("n", [2, 8])
def test_streams_consumed_alternately_equal_generate(llm, answers, n):
    streams = [llm.stream(p, PARAMS) for p in PROMPTS[:n]]
    texts, live = [""] * n, set(range(n))
    while live:
        for i in sorted(live):
            try:
                texts[i] += next(streams[i])
            except StopIteration:
                live.discard(i)
    assert texts == answers[:n]
    assert all(texts)


def test_streams_consumed_from_threads_equal_generate(llm, answers):
    texts = [""] * len(PROMPTS)

    def consume(i: int) -> None:
        texts[i] = "".join(llm.stream(PROMPTS[i], PARAMS))

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert texts == answers


def test_deltas_carry_every_token_id_and_end_with_the_output(llm):
    handle = llm.worker.submit(Sequence(PROMPTS[0], llm.encode(PROMPTS[0]), PARAMS, llm.tokenizer, llm.eos_ids))
    deltas = list(handle)
    out = deltas[-1].output
    assert out is not None and not any(d.finished for d in deltas[:-1])
    assert [t for d in deltas for t in d.token_ids] == out.token_ids
    assert "".join(d.text for d in deltas) == out.text


def test_a_request_that_cannot_run_fails_alone_and_the_thread_lives(llm, answers):
    bad = Sequence([5] * 500, [5] * 500, SamplingParams(max_tokens=50), llm.tokenizer, llm.eos_ids)
    good = llm.worker.submit(Sequence(PROMPTS[0], llm.encode(PROMPTS[0]), PARAMS, llm.tokenizer, llm.eos_ids))
    failed = llm.worker.submit(bad)
    out = failed.result(30)
    assert out.finish_reason == "error" and "exceeds the model's context" in out.error
    assert isinstance(failed.exception, ContextLengthError)
    assert good.result(30).text == answers[0]
    with pytest.raises(ContextLengthError):
        llm.generate([[5] * 500], SamplingParams(max_tokens=50))
    assert llm.generate(PROMPTS[1], PARAMS)[0].text == answers[1]


def test_a_step_that_raises_fails_its_requests_and_later_ones_run(llm, answers, monkeypatch):
    real = llm.engine.step
    calls = []

    def broken():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("kernel exploded")
        return real()

    monkeypatch.setattr(llm.engine, "step", broken)
    handle = llm.worker.submit(Sequence(PROMPTS[0], llm.encode(PROMPTS[0]), PARAMS, llm.tokenizer, llm.eos_ids))
    out = handle.result(30)
    assert out.finish_reason == "error" and out.error == "kernel exploded"
    assert not llm.engine.has_unfinished()
    assert llm.generate(PROMPTS[1], PARAMS)[0].text == answers[1]


def test_abort_by_request_id(llm):
    long = SamplingParams(max_tokens=200, ignore_eos=True)
    handle = llm.worker.submit(Sequence(PROMPTS[0], llm.encode(PROMPTS[0]), long, llm.tokenizer, llm.eos_ids))
    next(iter(handle))  # it runs
    llm.worker.abort(handle.request_id)
    out = handle.result(30)
    assert out.finish_reason == "abort" and len(out.token_ids) < 200
    assert not llm.engine.has_unfinished()


def test_asyncio_consumers_share_one_queue(llm, answers):
    async def main() -> list[str]:
        queue: asyncio.Queue = asyncio.Queue()
        sink = loop_sink(asyncio.get_running_loop(), queue.put_nowait)
        for i, p in enumerate(PROMPTS[:4]):
            llm.worker.submit(Sequence(p, llm.encode(p), PARAMS, llm.tokenizer, llm.eos_ids), sink, tag=i)
        texts, left = [""] * 4, 4
        while left:
            delta = await asyncio.wait_for(queue.get(), 30)
            texts[delta.tag] += delta.text
            left -= delta.finished
        return texts

    assert asyncio.run(main()) == answers[:4]


def test_a_batch_reaches_the_engine_together(llm, monkeypatch):
    """`generate`'s prompts are admitted by one step, whatever the threads' timing: here each
    submission is slowed (as on a loaded machine), which let the engine thread step with only
    the first request when they were submitted one by one."""
    import time

    import specee.engine.worker as worker_module

    monkeypatch.setattr(worker_module, "release_openmp_pool", lambda: time.sleep(0.02))
    engine = llm.engine
    real, sizes = engine.step, []

    def step():
        sizes.append(len(engine.scheduler.running) + len(engine.scheduler.waiting))
        return real()
    monkeypatch.setattr(engine, "step", step)
    llm.generate(PROMPTS[:4], SamplingParams(max_tokens=4))
    assert sizes[0] == 4, sizes


@pytest.mark.parametrize("release", ["dropped", "closed"])
def test_an_llm_dropped_or_closed_stops_its_thread_and_frees_its_engine(release):
    """The engine thread must not hold the LLM: a dropped LLM's thread, weights and KV pool were
    kept for the life of the process (tens of GB of reserved pools in a test run, and then a fork
    for Ray failed with ENOMEM)."""
    import gc
    import weakref

    llm = LLM(real_model_dir("stories260K"), dtype="float32")
    assert llm.generate(PROMPTS[0], SamplingParams(max_tokens=4))[0].text
    thread, engine = llm.worker.thread, weakref.ref(llm.engine)
    if release == "closed":
        llm.close()
        assert not thread.is_alive()
        assert llm.generate(PROMPTS[0], SamplingParams(max_tokens=4))[0].text  # a new thread starts
        thread = llm.worker.thread
    del llm
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()
    assert engine() is None


def test_a_stream_closed_on_the_engine_thread_does_not_wait_for_itself(llm, answers):
    """A partly read stream that the garbage collector finalizes on the engine thread (a reference cycle
    collected mid-step) ran its `finally` there and waited for an abort that only that thread could do:
    every request hung. Here a sink on the engine thread closes it."""
    stream = llm.stream(PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True))
    next(stream)
    closer = Sequence(PROMPTS[1], llm.encode(PROMPTS[1]), PARAMS, llm.tokenizer, llm.eos_ids)
    handle = llm.worker.submit(closer, sink=lambda delta: stream.close())
    assert handle.result(timeout=60).text == answers[1]
    assert not llm.worker.busy  # the closed stream's request ended too (aborted)
    assert [o.text for o in llm.generate(PROMPTS[:2], PARAMS)] == answers[:2]


def test_a_request_submitted_to_a_stopped_engine_thread_ends_as_aborted():
    """`generate` takes the LLM's engine thread, then submits to it: a `close()` in between stopped the
    thread, and the request waited forever on a queue nobody reads."""
    llm = LLM(real_model_dir("stories260K"), dtype="float32")
    worker = llm.worker
    llm.close()
    seq = Sequence(PROMPTS[0], llm.encode(PROMPTS[0]), PARAMS, llm.tokenizer, llm.eos_ids)
    handle = worker.submit(seq)
    assert handle.result(timeout=10).finish_reason == "abort"
    assert llm.generate(PROMPTS[0], SamplingParams(max_tokens=4))[0].text  # a new thread starts


def test_two_threads_first_requests_calibrate_once_and_both_finish(tmp_path, monkeypatch):
    """Early exit without a bank calibrates on first use: two threads' first `generate`s both calibrated,
    and the second bank's new engine dropped the first thread's requests in flight (finish "error")."""
    import specee.calibration as calibration
    from specee import EarlyExitConfig

    monkeypatch.setenv("SPECEE_CACHE", str(tmp_path))
    prompts, runs, real = calibration.load_calibration_prompts(limit=4), [], calibration.calibrate
    monkeypatch.setattr(calibration, "load_calibration_prompts", lambda: prompts)
    monkeypatch.setattr(calibration, "calibrate", lambda *a, **k: runs.append(1) or real(*a, **k))
    llm = LLM(real_model_dir("stories260K"), dtype="float32", progress=False,
              early_exit=EarlyExitConfig(draft="ngram", k=2))
    outs = {}

    def first_use(i: int) -> None:
        outs[i] = llm.generate(PROMPTS[2 * i : 2 * i + 2], SamplingParams(max_tokens=60, ignore_eos=True))

    threads = [threading.Thread(target=first_use, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert runs == [1] and sorted(outs) == [0, 1]
    assert all(o.finish_reason == "length" and len(o.token_ids) == 60 for i in outs for o in outs[i])


def test_the_engine_is_not_switched_under_requests_in_flight(llm, answers):
    """Changing scheduling (or the decoding) made a new engine, and the engine thread dropped the old one's
    requests: now refused while one is in flight, leaving everything as it was."""
    stream = llm.stream(PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True))
    next(stream)
    engine, scheduling = llm.engine, dict(llm.scheduling)
    with pytest.raises(RuntimeError, match="requests are in flight"):
        llm.set_scheduling(max_num_seqs=2)
    assert llm.engine is engine and llm.scheduling == scheduling
    assert len(stream.__next__()) and llm.worker.busy
    stream.close()
    llm.set_scheduling(max_num_seqs=scheduling["max_num_seqs"])
    assert [o.text for o in llm.generate(PROMPTS[:2], PARAMS)] == answers[:2]


def test_a_refused_engine_change_leaves_the_llm_as_it_was(llm, answers, monkeypatch):
    """The engine thread refuses a new engine when a request came in after the idle check: the LLM kept the
    new scheduling and engine although the thread decoded with the old ones."""
    from specee.engine.worker import IN_FLIGHT

    worker = llm.worker
    engine, scheduling = llm.engine, dict(llm.scheduling)

    def refused(new):
        raise RuntimeError(IN_FLIGHT)
    monkeypatch.setattr(worker, "swap_engine", refused)
    with pytest.raises(RuntimeError, match="requests are in flight"):
        llm.set_scheduling(max_num_seqs=2)
    assert llm.engine is engine is worker.engine and llm.scheduling == scheduling


def test_an_engine_change_racing_the_first_request_is_the_engine_thread_s(answers):
    """set_scheduling on one thread while another's first request starts the engine thread: the change was
    made on an engine the thread never took (58 of 60 tries), with no error."""
    for _ in range(6):
        fresh = LLM(real_model_dir("stories260K"), dtype="float32", threads=1)
        client = threading.Thread(target=fresh.generate, args=(PROMPTS[:1], SamplingParams(max_tokens=1)))
        client.start()
        i = 0
        while getattr(fresh, "_worker", None) is None or i < 3:
            try:
                fresh.set_scheduling(max_num_seqs=2 + i % 50)
            except RuntimeError:
                pass
            i += 1
        client.join()
        assert fresh.engine is fresh._worker.engine
        assert fresh._worker.engine.scheduler.max_num_seqs == fresh.scheduling["max_num_seqs"]
        fresh.close()


def test_warm_up_is_refused_while_requests_are_in_flight(llm, answers):
    """It writes the pool's free blocks, which the engine thread takes runs from: every output went wrong."""
    stream = llm.stream(PROMPTS[0], PARAMS)
    text = next(stream)
    with pytest.raises(RuntimeError, match="requests are in flight"):
        llm.warm_up()
    assert text + "".join(stream) == answers[0]
    llm.warm_up()
    assert [o.text for o in llm.generate(PROMPTS[:2], PARAMS)] == answers[:2]
