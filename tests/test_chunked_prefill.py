"""Chunked prefill (engine/scheduling.py, the scheduler): a long prompt prefills a part a step while the
running requests keep decoding, every mode gets the tokens of a prefill in one pass, and a step's
prompt rows stay within its token budget."""
from __future__ import annotations

import dataclasses

import pytest
from checkpoints import make_checkpoint
from ee_helpers import EXIT_MODES
from engine_helpers import DRAFT, MODES, PROMPTS, SMALL, mode_llms_for, sequence

from specee import LLM, SamplingParams
from specee.engine.scheduling import MIN_PROMPT_PART, prompt_part_end
from specee.engine.sequence import Sequence

pytestmark = pytest.mark.usefixtures("single_thread")

LONG = " ".join(PROMPTS[1:] * 3)  # 100-odd tokens: at prefill_chunk 32, three or four parts


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("chunked")
    return make_checkpoint(root / "m", SMALL, seed=2), make_checkpoint(root / "d", DRAFT, seed=2)


@pytest.fixture(scope="module", params=[None, "int4"], ids=["float", "int4"])
def mode_llms(request, checkpoints):
    return mode_llms_for(*checkpoints, request.param)


def parts(length: int, chunk: int) -> list[tuple[int, int]]:
    out, done = [], 0
    while done < length:
        out.append((done, prompt_part_end(done, length, chunk)))
        done = out[-1][1]
    return out


@pytest.mark.parametrize("chunk", [0, 32, 33, 50, 512])
def test_prompt_parts_cover_the_prompt_in_parts_of_32_rows_or_more(chunk):
    for length in range(1, 1200, 7):
        cut = parts(length, chunk)
        assert cut[0][0] == 0 and cut[-1][1] == length
        assert all(a[1] == b[0] for a, b in zip(cut, cut[1:]))
        sizes = [b - a for a, b in cut]
        assert all(n >= min(MIN_PROMPT_PART, length) for n in sizes), (length, sizes)
        if chunk:
            assert all(n <= chunk + MIN_PROMPT_PART - 1 for n in sizes) and len(cut) >= length // (chunk + 31)
        else:
            assert sizes == [length]


def alone(llm, seq: Sequence, **scheduling) -> Sequence:
    """`seq`'s request decoded alone on an engine with these scheduling settings."""
    llm.set_scheduling(**scheduling)
    twin = Sequence(seq.prompt, seq.prompt_ids, seq.params, llm.tokenizer, seq.eos_ids)
    llm.engine.add_request(twin)
    while llm.engine.has_unfinished():
        llm.engine.step()
    return twin


def recorded(engine) -> list[dict[str, int]]:
    """Each step's batch from here on: request id -> the prompt rows it prefills in the step (0: it decodes)."""
    log, schedule, scheduler = [], engine.scheduler.schedule, engine.scheduler

    def prompt_rows(r) -> int:
        start, end = scheduler.part(r)
        return end - start

    def logged():
        batch = schedule()
        log.append({r.seq.request_id: 0 if r.prefilled else prompt_rows(r) for r in batch})
        return batch
    scheduler.schedule = logged
    return log


@pytest.mark.parametrize("mode", [*MODES, *EXIT_MODES])
def test_every_mode_prefills_a_long_prompt_in_parts_while_the_others_decode(mode_llms, mode):
    """At prefill_chunk 32 a long prompt arriving beside a decoding request prefills one part a step,
    each step with the decoding request's rows in it; its tokens equal those of its prefill in one
    pass (an EAGLE head starts from the features of every part's rows: it refuses fewer than the
    prompt's), and the decoding request's equal its tokens alone."""
    llm = mode_llms[mode]
    greedy = SamplingParams(ignore_eos=True, max_tokens=8)
    long_seq = sequence(llm, LONG, greedy)
    whole = alone(llm, long_seq, prefill_chunk=0)
    try:
        llm.set_scheduling(prefill_chunk=32)
        engine = llm.engine
        engine.kv.drop_prompts()  # the whole prefill's prompt is cached: this one is to prefill in parts
        running = sequence(llm, PROMPTS[0], dataclasses.replace(greedy, max_tokens=16))
        engine.add_request(running)
        engine.step()
        log = recorded(engine)
        engine.add_request(long_seq)
        while engine.has_unfinished():
            engine.step()
    finally:
        llm.set_scheduling(prefill_chunk=512)
    cut = parts(engine.decoding.prefill_length(long_seq), 32)
    prefilling = [step for step in log if step.get(long_seq.request_id)]
    assert len(cut) >= 3 and [step[long_seq.request_id] for step in prefilling] == [b - a for a, b in cut]
    assert all(running.request_id in step for step in prefilling)  # it decodes beside every part
    assert long_seq.output_ids == whole.output_ids
    assert running.output_ids == alone(llm, running).output_ids


def test_a_step_runs_prompt_parts_within_its_token_budget(checkpoints):
    """Three long prompts arrive at once beside a decoding request, with a budget of 72 rows and parts
    of 32: each step takes the decode row and the parts that fit (one at least), first come first
    served, and every request gets its tokens alone."""
    llm = LLM(checkpoints[0], dtype="float32", quantization="int4", max_num_batched_tokens=72, prefill_chunk=32)
    engine, greedy = llm.engine, SamplingParams(ignore_eos=True, max_tokens=6)
    running = sequence(llm, PROMPTS[2], dataclasses.replace(greedy, max_tokens=20))
    engine.add_request(running)
    engine.step()
    log = recorded(engine)
    longs = [sequence(llm, text, greedy) for text in (LONG, PROMPTS[1] * 3, LONG[: len(LONG) // 2])]
    for s in longs:
        engine.add_request(s)
    while engine.has_unfinished():
        engine.step()
    for step in log:
        prompt_rows = [n for n in step.values() if n]
        assert len(prompt_rows) <= 1 or sum(prompt_rows) + sum(not n for n in step.values()) <= 72, step
    starts = [min(i for i, step in enumerate(log) if s.request_id in step) for s in longs]
    assert starts == sorted(starts) and starts[-1] > 0  # the third waited for room
    assert all(running.request_id in step for step in log[: max(starts) + 1])
    for s in [running, *longs]:
        assert s.output_ids == llm.generate([s.prompt_ids], s.params)[0].token_ids


def test_a_request_aborted_in_the_middle_of_its_prefill_leaves_and_frees_its_blocks(checkpoints):
    llm = LLM(checkpoints[0], dtype="float32", quantization="int4", prefill_chunk=32)
    engine, greedy = llm.engine, SamplingParams(ignore_eos=True, max_tokens=6)
    running, long_seq = sequence(llm, PROMPTS[2], greedy), sequence(llm, LONG, greedy)
    engine.add_request(running)
    engine.add_request(long_seq)
    engine.step()
    (r,) = [r for r in engine.scheduler.running if r.seq is long_seq]
    assert 0 < r.prefill_done < len(long_seq.prompt_ids)
    engine.abort(long_seq)
    while engine.has_unfinished():
        engine.step()
    assert long_seq.finish_reason == "abort" and not long_seq.output_ids
    assert engine.kv.free_blocks == engine.kv.num_blocks
    assert running.output_ids == llm.generate([running.prompt_ids], greedy)[0].token_ids


def test_bad_scheduling_settings_fail_at_once_naming_the_setting(checkpoints):
    for bad, match in (({"prefill_chunk": 5}, r"prefill_chunk \(--prefill-chunk\) must be 0 .* or at least 32"),
                       ({"prefill_chunk": -1}, "prefill_chunk"), ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
                       ({"max_num_seqs": True}, "max_num_seqs")):
        with pytest.raises(ValueError, match=match):
            LLM(checkpoints[0], quantization=None, **bad)
    llm = LLM(checkpoints[0], quantization=None)
    with pytest.raises(ValueError, match="prefill_chunk"):
        llm.set_scheduling(prefill_chunk=31)
    with pytest.raises(TypeError, match="unknown scheduling"):
        llm.set_scheduling(chunk=64)
    assert llm.scheduling["prefill_chunk"] == 512  # unchanged by the refusals

