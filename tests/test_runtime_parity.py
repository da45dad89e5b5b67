"""Parity of the layer-granular runtime with transformers' own forward and generate.

Tiny random checkpoints (one per supported variant, built with transformers in
tests/checkpoints.py) and the real models in ../shared/models are loaded on both sides in
float32 and compared:

* logits: prefill (last prompt position) and >= 4 teacher-forced incremental decode steps
  against one full transformers forward over the same tokens, atol 1e-4;
* greedy generation: the same tokens as `transformers.generate(do_sample=False)`.

EOS handling in greedy comparisons: we do NOT use `min_new_tokens` (it masks EOS logits
and so changes the argmax). Instead our side runs with `ignore_eos=True` and transformers
with `eos_token_id=None` (generate then never stops early; asserted by the output length),
so both sides are a plain argmax loop for exactly N tokens. The tokens are additionally
checked against the teacher-forced argmax of one transformers forward over prompt+output.
EOS stopping itself is compared separately on ref-target-24L, whose greedy outputs really
end with EOS: there both sides use their default EOS handling.
"""
from __future__ import annotations

import json

import pytest
import torch
from checkpoints import VARIANTS, load_hf
from safetensors import safe_open

from specee import SamplingParams
from specee.engine.full_depth import decode_step, prefill

pytestmark = pytest.mark.usefixtures("single_thread")

ATOL = 1e-4
N_GREEDY = 24


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0)
    new = out[0, len(prompt):].tolist()
    assert len(new) == n, "transformers stopped early although EOS was disabled"
    return new


def assert_teacher_forced_argmax(hf, prompt: list[int], generated: list[int]) -> None:
    """Each generated token is the argmax of transformers' logits at the position before it."""
    logits = hf_logits(hf, prompt + generated[:-1])
    expected = logits[len(prompt) - 1:].argmax(-1).tolist()
    assert generated == expected


def our_logits_trace(llm, prompts: list[list[int]], continuations: list[list[int]]) -> list[torch.Tensor]:
    """Prefill the (left-padded) batch, then decode the continuations teacher-forced.

    Returns logits [B, V] after the prefill and after every decode step."""
    model = llm.model
    steps = len(continuations[0])
    cache = model.new_cache(len(prompts), max(map(len, prompts)) + steps)
    with torch.inference_mode():
        out = [model.logits(prefill(model, cache, prompts)).float()]
        positions = torch.tensor([len(p) for p in prompts])
        for j in range(steps):
            tokens = torch.tensor([c[j] for c in continuations])
            out.append(model.logits(decode_step(model, cache, tokens, positions + j)).float())
    return out


def random_ids(n: int, vocab: int, seed: int, low: int = 3) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, vocab, (n,), generator=g).tolist()


# ---- tiny random checkpoints, one per variant -------------------------------------------------


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tiny_checkpoint, tiny_llm):
    path = tiny_checkpoint(request.param)
    return request.param, path, tiny_llm(request.param), load_hf(path)


def test_checkpoint_is_the_intended_variant(variant):
    """Guards the parity tests themselves: each checkpoint really exercises its feature on both sides."""
    name, path, llm, hf = variant
    cfg, raw = llm.model.cfg, json.loads((path / "config.json").read_text())
    hf_rope = hf.config.rope_parameters
    if name == "llama3":
        assert "rope_scaling" in raw and "rope_parameters" not in raw and "rope_theta" in raw
        assert cfg.rope_type == "llama3" and hf_rope["rope_type"] == "llama3"
        assert cfg.rope_theta == hf_rope["rope_theta"] == 500000.0
    elif name == "rope_parameters":
        assert "rope_parameters" in raw and "rope_theta" not in raw and "rope_scaling" not in raw
        assert cfg.rope_theta == hf_rope["rope_theta"] == 1e6
    elif name == "rope_linear":
        assert cfg.rope_type == "linear" and hf_rope["rope_type"] == "linear"
    elif name == "qwen2":
        assert cfg.qkv_bias and not cfg.o_bias
        assert hf.model.layers[0].self_attn.k_proj.bias.abs().min() > 0
        assert cfg.vocab_size > llm.tokenizer.vocab_size  # padded vocabulary
    elif name == "llama_attention_bias":
        assert cfg.qkv_bias and cfg.o_bias
    elif name == "mistral":
        assert cfg.architecture == "MistralForCausalLM"
    elif name == "tied":
        assert cfg.tie_word_embeddings and llm.model.head.weight is llm.model.embedding
    elif name == "gqa_head_dim":
        assert cfg.head_dim == 32 != cfg.hidden_size // cfg.num_heads and cfg.num_kv_heads < cfg.num_heads
    elif name == "sharded":
        index = json.loads((path / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1 and not (path / "model.safetensors").exists()
    # the norm weights were perturbed away from 1 (so a runtime ignoring them would fail parity)
    assert not torch.allclose(hf.model.norm.weight, torch.ones_like(hf.model.norm.weight))


def test_prefill_and_decode_logits_match_transformers(variant):
    name, _, llm, hf = variant
    vocab = llm.model.cfg.vocab_size
    prompt, cont = random_ids(11, vocab, seed=1), random_ids(6, vocab, seed=2)
    ref = hf_logits(hf, prompt + cont)
    ours = our_logits_trace(llm, [prompt], [cont])
    assert len(ours) == 1 + len(cont)
    for j, got in enumerate(ours):
        torch.testing.assert_close(got[0], ref[len(prompt) - 1 + j], atol=ATOL, rtol=0,
                                   msg=lambda m: f"{name}: step {j} (0 = prefill): {m}")


def test_left_padded_batch_logits_match_transformers(variant):
    """Rows of different prompt lengths in one batch: each row equals transformers on that row alone."""
    name, _, llm, hf = variant
    vocab = llm.model.cfg.vocab_size
    prompts = [random_ids(n, vocab, seed=10 + n) for n in (3, 9, 6)]
    conts = [random_ids(5, vocab, seed=20 + i) for i in range(3)]
    ours = our_logits_trace(llm, prompts, conts)
    for b, (p, c) in enumerate(zip(prompts, conts)):
        ref = hf_logits(hf, p + c)
        for j, got in enumerate(ours):
            torch.testing.assert_close(got[b], ref[len(p) - 1 + j], atol=ATOL, rtol=0,
                                       msg=lambda m: f"{name}: row {b} step {j}: {m}")


def test_greedy_generation_matches_transformers(variant):
    name, _, llm, hf = variant
    prompt = random_ids(7, llm.tokenizer.vocab_size, seed=3)
    out = llm.generate([prompt], SamplingParams(max_tokens=N_GREEDY, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == N_GREEDY
    assert out.token_ids == hf_greedy(hf, prompt, N_GREEDY), name
    assert_teacher_forced_argmax(hf, prompt, out.token_ids)


def test_rope_tables_match_transformers(variant):
    """cos/sin for every position up to 8k equal transformers' rotary embedding (which computes
    them in float32): an inv_freq off by one ulp drifts by ~1e-5 rad per 1k positions."""
    from specee.model.rope import rope_tables

    name, _, llm, hf = variant
    n = 8192
    cos, sin = rope_tables(llm.model.cfg, n, torch.device("cpu"), torch.float32)
    ref_cos, ref_sin = hf.model.rotary_emb(torch.zeros(1, dtype=torch.float32), torch.arange(n)[None])
    torch.testing.assert_close(cos, ref_cos[0], atol=1e-6, rtol=0, msg=lambda m: f"{name} cos: {m}")
    torch.testing.assert_close(sin, ref_sin[0], atol=1e-6, rtol=0, msg=lambda m: f"{name} sin: {m}")



def test_a_decode_rows_kept_inputs_are_its_slots_and_cannot_change(variant, monkeypatch):
    """range_inputs keeps a decode row's StepInputs per slot (below KEPT_ROW_INPUTS): a kept one holds
    exactly what a fresh one would, cannot be altered (a later request reads it), and slots past the
    limit are made each time and not kept."""
    import dataclasses

    from specee.model import llama

    model = variant[2].model
    monkeypatch.setattr(llama, "KEPT_ROW_INPUTS", 40)
    monkeypatch.setattr(model, "_row_inputs", {})  # what earlier tests' decoding kept
    D = model.cfg.head_dim
    for n in (0, 5, 37):
        kept = model.range_inputs(n, 1)
        assert model.range_inputs(n, 1) is kept
        assert kept.reads == "all" and kept.mask is None and kept.kv_len == n + 1
        assert torch.equal(kept.slots, torch.tensor([n]))
        assert torch.equal(kept.cos, model.cos_table[n].view(1, 1, 1, D))
        assert torch.equal(kept.sin, model.sin_table[n].view(1, 1, 1, D))
        with pytest.raises(dataclasses.FrozenInstanceError):
            kept.mask = torch.ones(1, 1, 1, n + 1, dtype=torch.bool)
    far = model.range_inputs(40, 1)
    assert model.range_inputs(40, 1) is not far and far.kv_len == 41 and torch.equal(far.slots, torch.tensor([40]))

def test_long_context_logits_match_transformers(tmp_path_factory):
    """Llama-3 RoPE scaling at positions near 5k: prefill and decode logits still within 1e-4."""
    from checkpoints import LONG_CONTEXT, make_checkpoint

    from specee import LLM

    path = make_checkpoint(tmp_path_factory.mktemp("long") / "model", LONG_CONTEXT)
    llm, hf = LLM(path, dtype="float32"), load_hf(path)
    ids = random_ids(5000 + 4, llm.model.cfg.vocab_size, seed=6)
    prompt, cont = ids[:5000], ids[5000:]
    ref = hf_logits(hf, ids)
    for j, got in enumerate(our_logits_trace(llm, [prompt], [cont])):
        torch.testing.assert_close(got[0], ref[len(prompt) - 1 + j], atol=ATOL, rtol=0)


def test_tied_checkpoint_has_no_separate_head(tiny_checkpoint):
    """SmolLM-style: transformers saves no lm_head.weight; the runtime must reuse the embedding."""
    path = tiny_checkpoint("tied")
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names


# ---- real models --------------------------------------------------------------------------------

REAL_PROMPTS = {
    "stories260K": ["Once upon a time", "Lily and Tom went to the park. They saw", "The little dog was sad because"],
    "ref-target-24L": ["The history of the city begins", "def fibonacci(n):\n", "Question: Tom has 3 apples and buys 5 more."],
}
N_REAL = 64


@pytest.mark.slow
@pytest.mark.parametrize("name", list(REAL_PROMPTS))
def test_real_model_logits_match_transformers(name, real_llm, real_hf):
    llm, hf = real_llm(name), real_hf(name)
    prompt = llm.tokenizer.encode(REAL_PROMPTS[name][0])
    cont = random_ids(5, llm.tokenizer.vocab_size, seed=4)
    ref = hf_logits(hf, prompt + cont)
    for j, got in enumerate(our_logits_trace(llm, [prompt], [cont])):
        # 24 fp32 layers with real weights: logits are O(10), so a relative term is needed too
        torch.testing.assert_close(got[0], ref[len(prompt) - 1 + j], atol=2e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(REAL_PROMPTS))
def test_real_model_greedy_matches_transformers(name, real_llm, real_hf):
    llm, hf = real_llm(name), real_hf(name)
    prompts = REAL_PROMPTS[name]
    outs = llm.generate(prompts, SamplingParams(max_tokens=N_REAL, ignore_eos=True))
    for text, out in zip(prompts, outs):
        prompt = llm.tokenizer.encode(text)
        assert out.prompt_token_ids == prompt and len(out.token_ids) == N_REAL
        assert out.token_ids == hf_greedy(hf, prompt, N_REAL), f"{name}: {text!r}"
        assert_teacher_forced_argmax(hf, prompt, out.token_ids)


@pytest.mark.slow
def test_real_model_eos_stop_matches_transformers(real_llm, real_hf):
    """Default EOS handling on both sides: ref-target-24L's greedy answers end with <|im_end|>."""
    name = "ref-target-24L"
    llm, hf = real_llm(name), real_hf(name)
    prompts = ["Once upon a time", "The little dog"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=N_REAL))
    for text, out in zip(prompts, outs):
        prompt = llm.tokenizer.encode(text)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              do_sample=False, max_new_tokens=N_REAL)[0, len(prompt):].tolist()
        eos = hf.generation_config.eos_token_id
        assert ref[-1] in (eos if isinstance(eos, list) else [eos]), "test premise: transformers stops at EOS here"
        assert out.token_ids == ref
        assert out.finish_reason == "stop" and len(out.token_ids) < N_REAL
        assert "<|im_end|>" not in out.text
