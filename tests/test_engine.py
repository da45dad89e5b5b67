"""The engine (add_request / step over a scheduler): batches, order, finishing and aborting."""
from __future__ import annotations

import dataclasses

import pytest
from checkpoints import Variant, make_checkpoint
from ee_helpers import AllTokensDrafter, decoder

from specee import LLM, SamplingParams
from specee.engine.sequence import Sequence

SMALL = Variant("engine3", "llama", dict(num_hidden_layers=3, num_key_value_heads=2))


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(make_checkpoint(tmp_path_factory.mktemp("engine") / "m", SMALL, seed=2), dtype="float32")


def sequence(llm, prompt: str, params: SamplingParams) -> Sequence:
    return Sequence(prompt, llm.encode(prompt), params, llm.tokenizer, llm.eos_ids)


@pytest.fixture
def batches(llm, monkeypatch):
    """The batches the engine hands to the decoder, as lists of prompts."""
    seen = []
    real = llm.engine.decode
    monkeypatch.setattr(llm.engine, "decode", lambda seqs: seen.append([s.prompt for s in seqs]) or real(seqs))
    return seen


def test_full_depth_batches_requests_with_their_own_parameters(llm, batches):
    a = SamplingParams(max_tokens=4, temperature=0.8, seed=1, ignore_eos=True)
    seqs = [sequence(llm, "one", a), sequence(llm, "two", dataclasses.replace(a, max_tokens=7, top_k=5)),
            sequence(llm, "three", SamplingParams(max_tokens=5, ignore_eos=True)),  # greedy
            sequence(llm, "four", dataclasses.replace(a, seed=5, top_p=0.9))]
    for s in seqs:
        llm.engine.add_request(s)
    finished, steps = [], 0
    while llm.engine.has_unfinished():
        finished += llm.engine.step()
        steps += 1
    assert batches == [["one", "two", "three", "four"]]
    assert [s.prompt for s in finished] == ["one", "four", "three", "two"]  # each reported once, when done
    assert steps == 7  # one step per token of the longest request
    assert [len(s.output_ids) for s in seqs] == [4, 7, 5, 4]
    alone = [llm.generate(s.prompt, s.params)[0].token_ids for s in seqs]
    assert [s.output_ids for s in seqs] == alone


def test_early_exit_takes_one_request_at_a_time(llm, batches):
    llm.early_exit = decoder(llm, AllTokensDrafter(llm.model.cfg.vocab_size))
    try:
        outs = llm.generate(["one", "two"], SamplingParams(max_tokens=3, ignore_eos=True))
    finally:
        llm.early_exit = None
    assert batches == [["one"], ["two"]]
    assert [o.token_ids for o in outs] == [o.token_ids for o in llm.generate(["one", "two"],
                                                                             SamplingParams(max_tokens=3, ignore_eos=True))]


def test_abort_drops_a_waiting_request_and_stops_a_running_batch(llm):
    params = SamplingParams(max_tokens=50, ignore_eos=True, temperature=0.5)
    running, waiting = sequence(llm, "one", params), sequence(llm, "two", dataclasses.replace(params, top_k=3))
    llm.engine.add_request(running)
    llm.engine.step()
    llm.engine.add_request(waiting)  # a running batch takes no newcomers: it waits
    llm.engine.step()
    llm.engine.abort(waiting)
    llm.engine.abort(running)
    assert not llm.engine.has_unfinished()
    assert len(running.output_ids) == 2 and not waiting.output_ids
    assert running.stats.decode_seconds > 0  # the decoder's own bookkeeping ran when it was stopped
