"""Generation behaviour: batching, KV truncation, sampling, stop strings, EOS, max_tokens, streaming.

Text-level tests run on the tiny random `llama2` checkpoint (its Metaspace BPE tokenizer
decodes every token to plain ASCII, so any generated text is printable); batching and
truncation are also checked on the real models when ../shared is present.
"""
from __future__ import annotations

import json

import pytest
import torch
from checkpoints import clone_checkpoint, edit_json

from specee import LLM, SamplingParams
from specee.engine.full_depth import decode_step, prefill
from specee.sampling import probabilities, sample

pytestmark = pytest.mark.usefixtures("single_thread")

TEXT_VARIANT = "llama2"
PROMPT = "Once upon a time there was"


@pytest.fixture(scope="module")
def llm(tiny_llm):
    return tiny_llm(TEXT_VARIANT)


@pytest.fixture(scope="module")
def greedy_full(llm):
    """The reference greedy continuation of PROMPT (EOS ignored), 40 tokens."""
    out = llm.generate(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True))[0]
    assert len(out.text) > 30, "test premise: the tiny model produces some text"
    return out


# ---- 3. batching ----------------------------------------------------------------------------

BATCH_PROMPTS = ["Tom", "One day the sun was shining and the birds", "She said: Hello,", "Question: What is 12 plus"]


def assert_batch_equals_alone(llm, prompts, params):
    batched = llm.generate(prompts, params)
    assert len({len(o.prompt_token_ids) for o in batched}) > 1, "test premise: prompts of different lengths"
    for prompt, out in zip(prompts, batched):
        alone = llm.generate(prompt, params)[0]
        assert out.token_ids == alone.token_ids, prompt
        assert out.text == alone.text and out.finish_reason == alone.finish_reason


@pytest.mark.parametrize("variant", ["llama2", "qwen2"])
def test_batched_greedy_equals_alone(tiny_llm, variant):
    assert_batch_equals_alone(tiny_llm(variant), BATCH_PROMPTS, SamplingParams(max_tokens=20, ignore_eos=True))


@pytest.mark.slow
def test_batched_greedy_equals_alone_real(real_llm):
    prompts = ["Once upon a time", "Lily and Tom went to the park. They saw a big", "The dog"]
    assert_batch_equals_alone(real_llm("stories260K"), prompts, SamplingParams(max_tokens=48))


@pytest.mark.slow
def test_batched_with_eos_equals_alone_real(real_llm):
    """ref-target-24L stops at EOS after different numbers of tokens per prompt; finished rows
    must keep their output while the others go on."""
    llm = real_llm("ref-target-24L")
    prompts = ["Once upon a time", "The little dog", "The history of the city begins in the year"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24))
    assert any(o.finish_reason == "stop" for o in outs), "test premise: some prompt ends with EOS"
    assert any(o.finish_reason == "length" for o in outs), "test premise: some prompt runs to max_tokens"
    assert len({len(o.token_ids) for o in outs}) > 1
    for prompt, out in zip(prompts, outs):
        alone = llm.generate(prompt, SamplingParams(max_tokens=24))[0]
        assert (out.token_ids, out.text, out.finish_reason) == (alone.token_ids, alone.text, alone.finish_reason)


# ---- 4. KV truncation -------------------------------------------------------------------------


def _decode(model, cache, tokens_per_row, start_positions):
    """Decode one step per entry of tokens_per_row (a list of [B] token lists); return logits."""
    out = []
    for j, tokens in enumerate(tokens_per_row):
        h = decode_step(model, cache, torch.tensor(tokens), start_positions + j)
        out.append(model.logits(h))
    return out


def check_truncation(model, prompts):
    """Go 6 tokens ahead, truncate back to 2 past the prompt, decode other tokens: the logits must
    be those of a cache that never went further."""
    B = len(prompts)
    width = max(map(len, prompts))
    g = torch.Generator().manual_seed(5)
    ahead = torch.randint(3, model.cfg.vocab_size, (6, B), generator=g).tolist()
    other = torch.randint(3, model.cfg.vocab_size, (4, B), generator=g).tolist()
    pos0 = torch.tensor([len(p) for p in prompts])
    with torch.inference_mode():
        cache = model.new_cache(B, width + 10)
        prefill(model, cache, prompts)
        _decode(model, cache, ahead, pos0)
        assert cache.length == width + 6
        cache.truncate(width + 2)
        assert cache.length == width + 2
        got = _decode(model, cache, other, pos0 + 2)

        fresh = model.new_cache(B, width + 10)
        prefill(model, fresh, prompts)
        _decode(model, fresh, ahead[:2], pos0)
        want = _decode(model, fresh, other, pos0 + 2)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # truncating into the prompt works the same way
    with torch.inference_mode():
        cache.truncate(width - 1)
        last = [p[-1] for p in prompts]
        again = model.logits(decode_step(model, cache, torch.tensor(last), pos0 - 1))
        fresh = model.new_cache(B, width + 10)
        ref = model.logits(prefill(model, fresh, prompts))
    torch.testing.assert_close(again, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("batch", [1, 3])
def test_kv_truncate_then_redecode_matches_never_going_further(llm, batch):
    prompts = [llm.tokenizer.encode(p) for p in BATCH_PROMPTS[:batch]]
    check_truncation(llm.model, prompts)


@pytest.mark.slow
def test_kv_truncate_real(real_llm):
    llm = real_llm("stories260K")
    check_truncation(llm.model, [llm.tokenizer.encode(p) for p in ["Once upon a time", "The cat sat"]])


# ---- 5. sampling ------------------------------------------------------------------------------

SAMPLED = dict(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, ignore_eos=True)


def test_same_seed_same_output(llm):
    a = llm.generate(PROMPT, SamplingParams(seed=123, **SAMPLED))[0]
    b = llm.generate(PROMPT, SamplingParams(seed=123, **SAMPLED))[0]
    assert a.token_ids == b.token_ids and a.text == b.text


def test_different_seeds_differ(llm, greedy_full):
    outs = [tuple(llm.generate(PROMPT, SamplingParams(seed=s, **SAMPLED))[0].token_ids) for s in range(4)]
    assert len(set(outs)) == 4
    assert all(list(o) != greedy_full.token_ids[:24] for o in outs)


def test_seeded_sampling_of_a_batch_is_reproducible(llm):
    prompts = BATCH_PROMPTS[:3]
    a = [o.token_ids for o in llm.generate(prompts, SamplingParams(seed=7, **SAMPLED))]
    b = [o.token_ids for o in llm.generate(prompts, SamplingParams(seed=7, **SAMPLED))]
    assert a == b and len({tuple(x) for x in a}) == 3


def test_seeded_request_is_independent_of_its_batch(llm):
    """Seeds are per request (as in vLLM): batching a seeded request with others changes nothing."""
    params = SamplingParams(seed=11, **SAMPLED)
    alone = llm.generate(BATCH_PROMPTS[0], params)[0].token_ids
    batched = llm.generate(BATCH_PROMPTS[:3], params)
    assert batched[0].token_ids == alone


def test_top_k_1_equals_greedy(llm, greedy_full):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=40, temperature=1.5, top_k=1, seed=9, ignore_eos=True))[0]
    assert out.token_ids == greedy_full.token_ids


def test_tiny_top_p_equals_greedy(llm, greedy_full):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=40, temperature=1.0, top_p=1e-6, seed=9, ignore_eos=True))[0]
    assert out.token_ids == greedy_full.token_ids


@pytest.mark.parametrize("extreme", [{"temperature": 1e-300}, {"temperature": 1e-45}, {"temperature": 1.0, "top_p": 1e-300}],
                         ids=["temperature-1e-300", "temperature-1e-45", "top_p-1e-300"])
def test_extreme_sampling_values_decode_greedily_beside_other_requests(llm, greedy_full, extreme):
    """A temperature whose division overflows float32, or a top_p that rounds to 0 in it, made NaN
    probabilities: the draw raised inside the step and failed every request in it (the server gave each a
    500). Below GREEDY_BELOW a temperature is greedy; top-p keeps the best token."""
    greedy = SamplingParams(max_tokens=40, ignore_eos=True)
    extreme_params = SamplingParams(max_tokens=40, ignore_eos=True, seed=3, **extreme)
    outs = llm.generate([PROMPT, BATCH_PROMPTS[1]], [extreme_params, greedy])
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert outs[0].token_ids == greedy_full.token_ids
    assert outs[1].token_ids == llm.generate(BATCH_PROMPTS[1], greedy)[0].token_ids


def test_probabilities_filters():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    p = probabilities(logits, SamplingParams(temperature=1.0))
    torch.testing.assert_close(p, torch.softmax(logits, -1))
    p = probabilities(logits, SamplingParams(temperature=0.5))
    torch.testing.assert_close(p, torch.softmax(logits / 0.5, -1))
    p = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[0, 2:] == 0).all()
    torch.testing.assert_close(p[0, :2], torch.softmax(logits[0, :2], -1))
    # top_p keeps the smallest prefix (by probability) whose mass reaches top_p
    full = torch.softmax(logits, -1)[0]
    top_p = float(full[0] + full[1]) - 1e-4  # needs exactly the two largest
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=top_p))
    assert (p[0, 2:] == 0).all() and (p[0, :2] > 0).all()
    torch.testing.assert_close(p.sum(-1), torch.ones(1))
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=float(full[0]) + 1e-4))
    assert (p[0, 2:] == 0).all() and p[0, 1] > 0


def test_sample_frequencies_follow_the_distribution():
    logits = torch.tensor([1.0, 0.0, -0.5, 2.0]).repeat(4000, 1)
    params = SamplingParams(temperature=1.0, seed=0)
    draws = sample(logits, params, params.make_generator(torch.device("cpu")))
    freq = torch.bincount(draws, minlength=4).float() / len(draws)
    torch.testing.assert_close(freq, torch.softmax(logits[0], -1), atol=0.03, rtol=0)


# ---- stop strings, EOS, max_tokens -------------------------------------------------------------


def _stop_candidate(text: str, start: int) -> str:
    """A 3-character substring of text at/after `start` whose first occurrence is at/after `start`."""
    for i in range(start, len(text) - 3):
        s = text[i:i + 3]
        if s.strip() and text.find(s) == i:
            return s
    pytest.fail("test premise: no usable stop string in the generated text")


def test_stop_string_cuts_text(llm, greedy_full):
    full = greedy_full.text
    stop = _stop_candidate(full, len(full) // 2)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full[: full.find(stop)]
    assert stop not in out.text
    n = len(out.token_ids)
    assert n < 40 and out.token_ids == greedy_full.token_ids[:n]


def test_stop_string_spanning_tokens_and_earliest_of_several(llm, greedy_full):
    # text after k tokens ends at a token boundary; a stop string straddling it needs two tokens
    k = 12
    boundary = len(llm.generate(PROMPT, SamplingParams(max_tokens=k, ignore_eos=True))[0].text)
    full = greedy_full.text
    assert full[:boundary] == llm.generate(PROMPT, SamplingParams(max_tokens=k, ignore_eos=True))[0].text
    straddle = full[boundary - 2: boundary + 2]
    if full.find(straddle) != boundary - 2:
        pytest.fail("test premise: the straddling stop string occurs earlier")
    later = _stop_candidate(full, boundary + 6)
    params = SamplingParams(max_tokens=40, ignore_eos=True, stop=[later, straddle])
    out = llm.generate(PROMPT, params)[0]
    assert out.finish_reason == "stop" and out.text == full[: boundary - 2]
    # streaming must hold back the stop string's first half until it is known not to be one
    deltas = list(llm.stream(PROMPT, params))
    assert "".join(deltas) == llm.last_output.text == out.text


def test_the_earliest_stop_string_wins_when_one_token_completes_several(llm, greedy_full):
    """Two stop strings that one token completes together: the text ends at the earlier of them,
    whatever their order in the list (the first listed won, and the text kept the other)."""
    deltas = list(llm.stream(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True)))
    full, start = "".join(deltas), 0
    assert full == greedy_full.text
    for piece in deltas:
        head, tail = piece[:2], piece[2:]
        if len(piece) >= 4 and full.find(head) == start and full.find(tail) == start + 2:
            break
        start += len(piece)
    else:
        pytest.fail("test premise: a token of 4 characters or more whose halves first occur in it")
    out = llm.generate(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True, stop=[tail, head]))[0]
    assert out.finish_reason == "stop" and out.text == full[:start]


def test_stop_string_not_hit_gives_length(llm, greedy_full):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True, stop=["@@never@@"]))[0]
    assert out.finish_reason == "length" and out.text == greedy_full.text


@pytest.mark.parametrize("n", [1, 5, 17])
def test_max_tokens_respected(llm, greedy_full, n):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=n, ignore_eos=True))[0]
    assert len(out.token_ids) == n and out.stats.generated_tokens == n
    assert out.finish_reason == "length"
    assert out.token_ids == greedy_full.token_ids[:n]


def test_output_text_is_the_decoded_continuation(llm, greedy_full):
    tok = llm.tokenizer
    prompt_ids = greedy_full.prompt_token_ids
    assert tok.decode(prompt_ids + greedy_full.token_ids) == tok.decode(prompt_ids) + greedy_full.text
    assert greedy_full.stats.prompt_tokens == len(prompt_ids)


@pytest.fixture(scope="module")
def eos_checkpoint(tiny_checkpoint, llm, greedy_full, tmp_path_factory):
    """The text checkpoint with its EOS id changed to a token greedy decoding emits at step >= 5."""
    ids = greedy_full.token_ids
    k = next(i for i in range(5, len(ids)) if ids[i] not in ids[:i])
    assert not set(ids[:k]) & llm.eos_ids, "test premise: the original EOS does not occur first"
    path = clone_checkpoint(tiny_checkpoint(TEXT_VARIANT), tmp_path_factory.mktemp("eos") / "model")
    edit_json(path / "config.json", eos_token_id=[2, ids[k]])  # a list, as Llama 3 configs have
    edit_json(path / "generation_config.json", eos_token_id=ids[k])
    return path, k


def test_eos_stops_generation(eos_checkpoint, greedy_full):
    path, k = eos_checkpoint
    llm = LLM(path, dtype="float32")
    eos = greedy_full.token_ids[k]
    assert eos in llm.eos_ids
    out = llm.generate(PROMPT, SamplingParams(max_tokens=40))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == greedy_full.token_ids[: k + 1] and out.token_ids[-1] == eos
    assert out.text == llm.tokenizer.decode(greedy_full.prompt_token_ids + greedy_full.token_ids[:k])[
        len(llm.tokenizer.decode(greedy_full.prompt_token_ids)):]
    # ignore_eos goes on to max_tokens
    out = llm.generate(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True))[0]
    assert out.finish_reason == "length" and out.token_ids == greedy_full.token_ids
    # in a batch, the row that hits EOS stops; the others go on
    outs = llm.generate([PROMPT, "Tom and his friend"], SamplingParams(max_tokens=40))
    assert outs[0].token_ids == greedy_full.token_ids[: k + 1]


def test_eos_from_generation_config_only(eos_checkpoint, greedy_full, tmp_path):
    """EOS listed only in generation_config.json (as Llama 3 instruct does) must stop generation too."""
    path, k = eos_checkpoint
    clone = clone_checkpoint(path, tmp_path / "model")
    edit_json(clone / "config.json", eos_token_id=2)
    assert json.loads((clone / "generation_config.json").read_text())["eos_token_id"] == greedy_full.token_ids[k]
    llm = LLM(clone, dtype="float32")
    out = llm.generate(PROMPT, SamplingParams(max_tokens=40))[0]
    assert out.finish_reason == "stop" and out.token_ids == greedy_full.token_ids[: k + 1]


# ---- streaming ----------------------------------------------------------------------------------


def _stream(llm, prompt, params):
    deltas = list(llm.stream(prompt, params))
    return deltas, llm.last_output


def test_stream_deltas_concatenate_to_final_text(llm, greedy_full):
    deltas, final = _stream(llm, PROMPT, SamplingParams(max_tokens=40, ignore_eos=True))
    assert len(deltas) > 5 and all(deltas)
    assert "".join(deltas) == final.text == greedy_full.text
    assert final.token_ids == greedy_full.token_ids


def test_stream_with_stop_string_never_leaks_it(llm, greedy_full):
    full = greedy_full.text
    stop = _stop_candidate(full, len(full) // 2)
    deltas, final = _stream(llm, PROMPT, SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop]))
    assert final.finish_reason == "stop"
    assert "".join(deltas) == final.text == full[: full.find(stop)]


def test_stream_sampled_matches_generate(llm):
    params = SamplingParams(seed=11, **SAMPLED)
    deltas, final = _stream(llm, PROMPT, params)
    assert "".join(deltas) == final.text
    assert final.token_ids == llm.generate(PROMPT, params)[0].token_ids


@pytest.mark.slow
@pytest.mark.parametrize("name", ["stories260K", "ref-target-24L"])
def test_stream_real_multibyte_text(real_llm, name):
    """Real tokenizers (byte fallback / byte-level): streamed text with multi-byte characters."""
    llm = real_llm(name)
    deltas, final = _stream(llm, "Café – naïve 😀 Once upon a time", SamplingParams(max_tokens=24, ignore_eos=True))
    assert "".join(deltas) == final.text
    tok = llm.tokenizer
    assert tok.decode(final.prompt_token_ids + final.token_ids) == tok.decode(final.prompt_token_ids) + final.text


def test_stream_runs_on_the_engine_thread_and_stops_when_closed(llm, monkeypatch):
    """One engine thread decodes (the caller's thread only reads); closing the iterator aborts the
    request before close() returns, and nothing is decoded after it."""
    import threading
    import time

    from specee.engine.runner import ModelRunner

    threads, decoded = set(), []
    real_forward = ModelRunner.forward

    def spy(*args, **kwargs):
        threads.add(threading.get_ident())
        decoded.append(1)
        time.sleep(0.01)  # slower than the reader, so the close lands mid-request
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(ModelRunner, "forward", spy)
    stream = llm.stream(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(3):
        next(stream)
    stream.close()
    after_close = len(decoded)
    time.sleep(0.05)
    assert threads == {llm.worker.thread.ident} != {threading.get_ident()}
    assert after_close == len(decoded) < 39  # nothing decoded after the close


def test_the_cpu_greedy_kernel_picks_torchs_token_on_ties_nans_and_infinities():
    """greedy.cpp against torch's max + isfinite (what greedy() runs elsewhere), at each level here."""
    from specee.model import kernels
    from specee.sampling import NONFINITE_TOKEN, greedy

    if kernels.cpu_kernels() is None:
        pytest.skip("no C++ kernels here")
    g = torch.Generator().manual_seed(0)
    for vocab in (1, 5, 16, 17, 33, 49152, 49157):
        x = torch.randn(10, vocab, generator=g)
        x[1] = (x[1] * 2).round()  # many ties: the first index wins
        x[2, vocab // 2] = float("nan")
        x[3, vocab - 1] = float("inf")
        x[4] = float("-inf")
        x[5, 0] = float("-inf")
        x[6, vocab - 1] = x[6].max() + 1  # the best in the tail past the last 16-wide block
        x[7] = 3.0  # all tied
        x[8, vocab - 1] = float("nan")  # a NaN in the tail
        best, tokens = x.max(dim=-1)
        want = torch.where(best.isfinite(), tokens, NONFINITE_TOKEN)
        for level in kernels.LEVELS[: kernels.cpu_kernels().int4_best_level() + 1]:
            before = kernels.use_level(level)
            try:
                got = greedy(x)
            finally:
                kernels.use_level(before)
            assert got.tolist() == want.tolist(), (vocab, level)
    assert greedy(x[:, ::2]).tolist() == greedy(x[:, ::2].contiguous()).tolist()  # a strided view


def test_extreme_sampling_stops_and_duplicate_ids_on_the_default_quantized_path():
    """This session's sampling, stop-string and request-id fixes on what users run: SmolLM2's Q4_1 file on the
    C++ int4 path (quantization "auto"), every request in one batch beside the others."""
    import dataclasses

    from conftest import SMOLLM2_GGUF
    from engine_helpers import sequence

    if not SMOLLM2_GGUF.exists():
        pytest.skip(f"real model SmolLM2 not available: {SMOLLM2_GGUF} is absent")
    llm = LLM(SMOLLM2_GGUF)
    assert llm.quantization == "auto" and llm.model.fast_stack is not None, "test premise: the C++ quantized path"
    prompts = ["What is the capital of France?", "Name three colours.", "Write a haiku about the sea."]
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    alone = [llm.generate(p, greedy, chat=True)[0] for p in prompts]
    full = alone[2].text
    early, late = full[4:7], full[12:16]
    assert full.find(early) == 4 and full.find(late) == 12, "test premise: both stop strings first occur there"
    params = [SamplingParams(max_tokens=24, ignore_eos=True, temperature=1e-300),
              SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.0, top_p=1e-300, seed=1),
              SamplingParams(max_tokens=24, ignore_eos=True, stop=[late, early])]
    outs = llm.generate(prompts, params, chat=True)
    assert outs[0].token_ids == alone[0].token_ids and outs[1].token_ids == alone[1].token_ids
    assert outs[2].finish_reason == "stop" and outs[2].text == full[:4]
    first, second = (dataclasses.replace(sequence(llm, p, greedy), request_id="same") for p in prompts[:2])
    handles = llm.worker.submit_all([first, second])
    results = [h.result(timeout=120) for h in handles]
    assert results[1].finish_reason == "error" and "already in flight" in results[1].error
    assert results[0].token_ids == llm.generate(prompts[0], greedy)[0].token_ids
