"""The engine (add_request / step over a scheduler): batches, continuous batching at full depth
(requests joining a running batch and leaving it), order, finishing and aborting."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from checkpoints import Variant, make_checkpoint
from ee_helpers import AllTokensDrafter, decoder

from specee import LLM, SamplingParams
from specee.engine.sequence import Sequence
from specee.model.kv_cache import ContextLengthError

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


@pytest.mark.parametrize("mode", ["lossy", "lossless"])
def test_lossy_early_exit_batches_requests_and_lossless_takes_one_at_a_time(llm, batches, mode):
    """Lossy one-token exits share passes; lossless mode (a rollback moves one request's slots) runs
    the requests in turn. With predictors that never fire, both give full depth's tokens."""
    llm.early_exit = decoder(llm, AllTokensDrafter(llm.model.cfg.vocab_size), mode=mode)
    try:
        outs = llm.generate(["one", "two"], SamplingParams(max_tokens=3, ignore_eos=True))
    finally:
        llm.early_exit = None
    assert batches == ([["one", "two"]] if mode == "lossy" else [["one"], ["two"]])
    assert [o.token_ids for o in outs] == [o.token_ids for o in llm.generate(["one", "two"],
                                                                             SamplingParams(max_tokens=3, ignore_eos=True))]


def solo(llm, seq: Sequence) -> tuple[list[int], str, str | None]:
    """What `seq`'s request gives decoded alone: tokens, text, finish reason."""
    alone = Sequence(seq.prompt, seq.prompt_ids, seq.params, llm.tokenizer, seq.eos_ids)
    llm.engine.add_request(alone)
    while llm.engine.has_unfinished():
        llm.engine.step()
    return alone.output_ids, alone.text, alone.finish_reason


def drive(llm, arrivals: dict[int, list[Sequence]]) -> list[list[Sequence]]:
    """Step the engine, adding arrivals[i] just before step i, until it is idle; returns what finished
    at each step. Checks that a request added while a batch runs joins it in that step (its first
    token comes out of it) and that the batch holds exactly the unfinished requests and newcomers."""
    engine, finished, i = llm.engine, [], 0
    while i <= max(arrivals) or engine.has_unfinished():
        new = arrivals.get(i, [])
        for s in new:
            engine.add_request(s)
        rows = len(engine.running) + len(new)
        batch = engine._batch
        finished.append(engine.step())
        if batch is not None and new:  # joined the running batch, which took its first step with them
            assert engine._batch in (batch, None) and all(len(s.output_ids) == 1 for s in new)
        if engine._batch is not None:  # finished rows left it (compaction)
            assert len(engine._batch.seqs) == engine._batch.cache.k.shape[1] == rows
        i += 1
    return finished


def test_requests_join_a_running_batch_and_each_matches_decoding_alone(llm, batches):
    greedy = SamplingParams(ignore_eos=True, max_tokens=10)
    a = sequence(llm, "one", greedy)
    long = "The quick brown fox jumps over the lazy dog while the cat sleeps"  # longer than the history
    b = sequence(llm, long, dataclasses.replace(greedy, max_tokens=4))
    c = sequence(llm, "Tom and his friend went", dataclasses.replace(greedy, max_tokens=9))
    d = sequence(llm, "two", dataclasses.replace(greedy, max_tokens=2))
    finished = drive(llm, {0: [a], 2: [b], 3: [c, d]})
    assert batches == [["one"]]  # one batch: the others joined it
    # each finished at its own step (joined + max_tokens - 1), the others running on
    assert [[s.prompt for s in f] for f in finished] == ([[]] * 4 + [["two"], [long]] + [[]] * 3
                                                         + [["one"], [], [c.prompt]])
    for s in (a, b, c, d):
        assert (s.output_ids, s.text, s.finish_reason) == solo(llm, s)
    assert a.stats.decode_tokens == 9 and b.stats.prefill_seconds > 0 and b.stats.decode_seconds > 0


def test_seeded_sampling_per_request_is_independent_of_the_batch(llm):
    """Each request draws from its own generator: the same tokens alone, in a batch, or joining one
    at another step."""
    p = SamplingParams(max_tokens=8, temperature=0.9, seed=3, ignore_eos=True)
    params = [p, dataclasses.replace(p, seed=4, top_k=5), dataclasses.replace(p, seed=5, top_p=0.8, max_tokens=5),
              SamplingParams(max_tokens=6, ignore_eos=True)]
    prompts = ["one", "Tom and his friend went", "two", "The quick brown fox"]
    outs = []
    for arrivals in ({0: [0, 1, 2, 3]}, {0: [3], 1: [0], 4: [1, 2]}, {0: [2], 3: [1], 5: [0, 3]}):
        seqs = [sequence(llm, prompt, sp) for prompt, sp in zip(prompts, params)]
        drive(llm, {step: [seqs[i] for i in rows] for step, rows in arrivals.items()})
        outs.append([s.output_ids for s in seqs])
    assert outs[0] == outs[1] == outs[2] == [solo(llm, s)[0] for s in seqs]


def test_a_stop_in_one_row_does_not_disturb_the_others(llm):
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    tokens = solo(llm, sequence(llm, "Tom and his friend went", greedy))[0]
    eos = sequence(llm, "Tom and his friend went", dataclasses.replace(greedy, ignore_eos=False))
    eos.eos_ids = frozenset({tokens[3]})  # its 4th token (or an earlier one like it) ends it
    text = solo(llm, sequence(llm, "one", greedy))[1]
    stop = sequence(llm, "one", dataclasses.replace(greedy, stop=(text[3:6],)))  # a stop string inside its text
    others = [sequence(llm, "two", greedy),
              sequence(llm, "The quick brown fox", dataclasses.replace(greedy, max_tokens=9))]
    drive(llm, {0: [others[0], eos], 1: [stop, others[1]]})
    assert eos.finish_reason == stop.finish_reason == "stop"
    assert len(eos.output_ids) <= 4 and len(stop.output_ids) < 12
    for s in (eos, stop, *others):
        assert (s.output_ids, s.text, s.finish_reason) == solo(llm, s)


def test_abort_lets_a_running_request_go_and_the_batch_runs_on(llm):
    params = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.5, seed=7)
    first, second = sequence(llm, "one", params), sequence(llm, "two", dataclasses.replace(params, top_k=3))
    waiting = sequence(llm, "three", params)
    engine = llm.engine
    engine.add_request(first)
    engine.step()
    engine.add_request(second)
    engine.step()  # second joins
    engine.add_request(waiting)
    engine.abort(waiting)  # never runs
    engine.abort(first)
    assert [s is second for s in engine.running] == [True] and first.stats.decode_seconds > 0
    engine.step()
    assert [s is second for s in engine._batch.seqs] == [True] and engine._batch.cache.k.shape[1] == 1  # row left
    while engine.has_unfinished():
        engine.step()
    assert len(first.output_ids) == 2 and not waiting.output_ids
    assert second.output_ids == solo(llm, second)[0]
    engine.add_request(first := sequence(llm, "one", params))
    engine.step()
    engine.abort(first)  # the last running request: the batch stops
    assert not engine.has_unfinished() and len(first.output_ids) == 1 and first.stats.decode_seconds > 0


def test_a_newcomer_that_does_not_fit_is_refused_and_the_batch_runs_on(llm):
    running = sequence(llm, "one", SamplingParams(max_tokens=5, ignore_eos=True))
    llm.engine.add_request(running)
    llm.engine.step()
    llm.engine.add_request(Sequence([5] * 250, [5] * 250, SamplingParams(max_tokens=10), llm.tokenizer, llm.eos_ids))
    with pytest.raises(ContextLengthError):
        llm.engine.step()
    assert [s.prompt for s in llm.engine.running] == ["one"] and not llm.engine.scheduler.waiting
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert running.output_ids == solo(llm, running)[0]


@pytest.mark.parametrize("long_prompt", [False, True])
def test_a_newcomer_needing_more_room_grows_the_cache(llm, long_prompt):
    """The cache is sized to what its rows need; a newcomer needing more (a prompt longer than the
    history, more tokens to go) grows it. With the rows staggered, the shared slots may pass the
    model's context (256 here) while each row's positions stay within it."""
    g = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(3, llm.model.cfg.vocab_size, (n,), generator=g).tolist()

    greedy = SamplingParams(ignore_eos=True, max_tokens=6)
    if long_prompt:  # a row deep into the context, then one that needs most of it
        old = Sequence("old", ids(200), dataclasses.replace(greedy, max_tokens=40), llm.tokenizer, llm.eos_ids)
        new = Sequence("new", ids(5), dataclasses.replace(greedy, max_tokens=200), llm.tokenizer, llm.eos_ids)
        join = 10
    else:
        old = sequence(llm, "one", greedy)
        new = Sequence("new", ids(30), dataclasses.replace(greedy, max_tokens=20), llm.tokenizer, llm.eos_ids)
        join = 2
    engine = llm.engine
    engine.add_request(old)
    for _ in range(join):
        engine.step()
    before = engine._batch.cache.max_len
    engine.add_request(new)
    engine.step()
    grown = engine._batch.cache.max_len
    assert grown > before and (grown > llm.model.cfg.max_position_embeddings) == long_prompt
    while engine.has_unfinished():
        engine.step()
    assert old.output_ids == solo(llm, old)[0] and new.output_ids == solo(llm, new)[0]
