"""GGUF checkpoints against transformers loading the same file (`gguf_file=`, float32).

Tiny files written with gguf.GGUFWriter cover the architectures, tensor types and tied/separate
output heads; SmolLM2-135M-Instruct (../shared) is the real model: logits of prefill and decode
steps, and greedy generations of 64+ tokens.
"""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import MODELS
from gguf_checkpoints import TinyGGUF, _permute, write_gguf

from specee import SamplingParams
from specee.model.config import UnsupportedModelError
from specee.model.gguf import gguf_tensor_map, unpermute_rows
from specee.model.llama import Transformer
from specee.model.weights import CheckpointError, fingerprint_weights

pytest.importorskip("gguf")
pytestmark = pytest.mark.usefixtures("single_thread")

SMOLLM2 = MODELS / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY = {
    "llama-tied-legacy-quants": TinyGGUF("llama", ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"), True),
    "qwen2-kquants": TinyGGUF("qwen2", ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "F16"), False),
    "llama-separate-kquants": TinyGGUF("llama", ("Q6_K", "Q4_K", "Q5_K"), False),
}


def hf_gguf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return functools.cache(lambda name: write_gguf(tmp_path_factory.mktemp("gguf") / f"{name}.gguf", TINY[name]))


@torch.inference_mode()
def full_logits(model: Transformer, ids: list[int]) -> torch.Tensor:
    x = torch.tensor([ids])
    return model.logits(model.forward(x, model.range_inputs(0, len(ids)), model.new_cache(1, len(ids))))[0]


@pytest.mark.parametrize("name", list(TINY))
def test_tiny_gguf_matches_transformers(tiny_gguf, name):
    path = tiny_gguf(name)
    ours = Transformer.load(path)
    spec = TINY[name]
    assert ours.cfg.tie_word_embeddings is spec.tied
    assert ours.cfg.qkv_bias is (spec.arch == "qwen2")
    ids = [1, 5, 9, 33, 100, 200, 7, 8, 250, 3, 17, 64]
    with torch.inference_mode():
        ref = hf_gguf(path)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(full_logits(ours, ids), ref, rtol=1e-4, atol=1e-4)


def test_unpermute_rows_inverts_llama_cpp_permutation():
    w = np.arange(8 * 6 * 5, dtype=np.float32).reshape(48, 5)  # 4 heads of 12 rows
    assert np.array_equal(unpermute_rows(_permute(w, 4), 4), w)
    raw = np.random.default_rng(0).integers(0, 256, size=(48, 18), dtype=np.uint8)  # quantized blocks too
    assert np.array_equal(unpermute_rows(_permute(raw, 4), 4), raw)
    t = torch.from_numpy(w)
    assert torch.equal(unpermute_rows(torch.from_numpy(_permute(w, 4)), 4), t)
    assert not np.array_equal(_permute(w, 4), w)


def test_tensor_map_names_every_weight_the_runtime_takes(tiny_gguf):
    ours = Transformer.load(tiny_gguf("qwen2-kquants"))
    names = gguf_tensor_map(ours.cfg)
    assert names["blk.1.attn_q.bias"] == "model.layers.1.self_attn.q_proj.bias"
    assert names["output.weight"] == "lm_head.weight" and names["token_embd.weight"] == "model.embed_tokens.weight"
    assert len(names) == 3 + 12 * ours.cfg.num_layers


def test_fingerprint_changes_with_weights_and_not_with_rewrite(tiny_gguf, tmp_path):
    path = tiny_gguf("llama-tied-legacy-quants")
    same = write_gguf(tmp_path / "same.gguf", TINY["llama-tied-legacy-quants"])
    other = write_gguf(tmp_path / "other.gguf", TINY["llama-tied-legacy-quants"], seed=1)
    assert fingerprint_weights(path) == fingerprint_weights(same) != fingerprint_weights(other)


def test_safetensors_fingerprint_samples_several_tensors(tiny_checkpoint, tmp_path):
    """Same names, shapes and first tensor, other weights changed: a different checkpoint, a different key."""
    from safetensors.torch import load_file, save_file

    from checkpoints import clone_checkpoint

    src = tiny_checkpoint("llama2")
    path = clone_checkpoint(src, tmp_path / "model")
    tensors = load_file(str(src / "model.safetensors"))
    first = sorted(tensors)[0]
    (path / "model.safetensors").unlink()
    save_file({n: t if n == first else t * 1.5 for n, t in tensors.items()}, str(path / "model.safetensors"))
    assert fingerprint_weights(path) != fingerprint_weights(src)


def test_directory_with_one_gguf_loads_it(tiny_gguf, tmp_path):
    path = tiny_gguf("llama-separate-kquants")
    (tmp_path / path.name).symlink_to(path)
    assert Transformer.load(tmp_path).cfg.num_layers == TINY["llama-separate-kquants"].layers


# ---- SmolLM2-135M-Instruct --------------------------------------------------------------------
PROMPTS = ["What is the capital of France?", "Write a Python function that reverses a string.",
           "Explain photosynthesis in two sentences.", "List three uses of a paperclip."]


@pytest.fixture(scope="module")
def smollm2(gguf_llm):
    if not SMOLLM2.exists():
        pytest.skip(f"real model SmolLM2 not available: {SMOLLM2} is absent (../shared/models is not mounted)")
    hf = hf_gguf(SMOLLM2)
    # decode exactly N tokens as specee's ignore_eos does: EOS may be chosen and decoding goes on
    # (min_new_tokens would forbid EOS instead, changing the greedy stream). generate() then needs an
    # explicit attention mask, else it masks the prompt's <|im_end|> as padding (pad id = eos id = 2).
    hf.generation_config.eos_token_id = hf.config.eos_token_id = None
    return gguf_llm(SMOLLM2), hf


def test_smollm2_config(smollm2):
    llm, hf = smollm2
    cfg = llm.model.cfg
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert cfg.tie_word_embeddings and cfg.rope_theta == hf.config.rope_parameters["rope_theta"] == 100000.0
    assert cfg.rms_norm_eps == pytest.approx(hf.config.rms_norm_eps)
    # its eos, <|im_end|>, and <|endoftext|>, on which llama.cpp stops too (Qwen2.5's files name only
    # <|im_end|>, and raw text ran on past <|endoftext|> into another language)
    assert llm.tokenizer.eos_token_id == 2 and llm.eos_ids == {0, 2}
    assert [llm.tokenizer.token_id(t) for t in ("<|endoftext|>", "<|im_end|>")] == [0, 2]


@torch.inference_mode()
def test_smollm2_prefill_and_decode_logits_match_transformers(smollm2):
    llm, hf = smollm2
    model = llm.model
    ids = llm.tokenizer.encode_chat([{"role": "user", "content": PROMPTS[0]}])
    steps = 6
    x = torch.tensor([ids])
    continuation = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=steps, do_sample=False)
    continuation = continuation[0, len(ids):].tolist()
    ref = hf(torch.tensor([ids + continuation])).logits[0]
    cache = model.new_cache(1, len(ids) + steps)
    prefill = model.logits(model.forward(torch.tensor([ids]), model.range_inputs(0, len(ids)), cache))[0]
    torch.testing.assert_close(prefill, ref[: len(ids)], rtol=1e-4, atol=1e-4)
    for j, token in enumerate(continuation):  # decode steps, one token each, through the KV cache
        pos = len(ids) + j
        step = model.logits(model.forward(torch.tensor([[token]]), model.range_inputs(pos, 1), cache))[0, 0]
        torch.testing.assert_close(step, ref[pos], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("prompt", PROMPTS[1:])
def test_smollm2_greedy_matches_transformers_generate(smollm2, prompt):
    llm, hf = smollm2
    ids = llm.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    with torch.inference_mode():
        x = torch.tensor([ids])
        ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=64, do_sample=False)[0, len(ids):]
    ours = llm.generate(ids, SamplingParams(max_tokens=64, ignore_eos=True))[0]
    assert ours.token_ids == ref.tolist()


def test_smollm2_answers_coherently(smollm2):
    llm, _ = smollm2
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=16), chat=True)[0]
    assert "Paris" in out.text and out.finish_reason == "stop"


# ---- bad files ------------------------------------------------------------------------------------
def test_truncated_gguf_is_a_clean_error(tiny_gguf, tmp_path):
    data = tiny_gguf("qwen2-kquants").read_bytes()
    for cut in (len(data) // 2, 200):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match=r"not a readable GGUF file \(truncated or corrupt"):
            Transformer.load(path)


@pytest.mark.parametrize("metadata,says", [
    ({"block_count": 2**31}, r"llama.block_count 2147483648 does not match its blk.N tensors"),  # hung, memory growing
    ({"context_length": 2**40}, r"llama.context_length 1099511627776 is past the 2097152 positions"),  # asked for 4 TB
    ({"attention.head_count": 0}, r"llama.attention.head_count must be an integer >= 1, got 0"),  # ZeroDivisionError
    ({"attention.head_count_kv": 3}, r"4 attention heads do not split into 3 key/value heads"),
    ({"attention.key_length": 3, "rope.dimension_count": 3}, r"head dimension 3 is not an even number"),
    ({"rope.freq_base": float("nan")}, r"llama.rope.freq_base must be a finite number > 0, got nan"),  # decoded garbage
    ({"embedding_length": "abc"}, r"llama.embedding_length must be an integer >= 1, got 'abc'"),
    ({"rope.scaling.type": "linear"}, r"GGUF metadata lacks llama.rope.scaling.factor"),  # a KeyError traceback
])
def test_hostile_gguf_metadata_is_one_line_naming_the_file(tmp_path, metadata, says):
    spec = TINY["llama-tied-legacy-quants"]
    assert spec.heads == 4 and spec.arch == "llama"
    path = write_gguf(tmp_path / "hostile.gguf", spec, metadata=metadata)
    with pytest.raises(ValueError, match=rf"^{path}: {says}") as e:
        Transformer.load(path)
    assert "\n" not in str(e.value)


def test_an_eos_id_past_the_vocabulary_is_named(tmp_path):
    """It was a transformers warning, then "cannot build the tokenizer ... (list index out of range)"."""
    import shutil

    import gguf

    if not SMOLLM2.exists():
        pytest.skip(f"real model SmolLM2 not available: {SMOLLM2} is absent (../shared/models is not mounted)")
    path = shutil.copy(SMOLLM2, tmp_path / "eos.gguf")
    field = gguf.GGUFReader(path, "r+").fields["tokenizer.ggml.eos_token_id"]
    field.parts[field.data[0]][0] = 49152
    del field
    with pytest.raises(CheckpointError, match=r"eos.gguf: tokenizer.ggml.eos_token_id 49152 is not a token id "
                                              r"\(the vocabulary has 49152 tokens\)$"):
        Transformer.load(path)


def test_a_tensor_named_twice_is_refused(tmp_path):
    """Which of the two would load was chance (transformers' tokenizer conversion happened to notice)."""
    path = write_gguf(tmp_path / "twice.gguf", TINY["llama-tied-legacy-quants"])
    data = path.read_bytes()
    assert data.count(b"blk.0.attn_k.weight") == 1
    path.write_bytes(data.replace(b"blk.0.attn_k.weight", b"blk.0.attn_q.weight"))
    with pytest.raises(CheckpointError, match=r"not a readable GGUF file .*tensor blk.0.attn_q.weight appears twice"):
        Transformer.load(path)


def test_unsupported_tensor_type_is_named(tmp_path):
    path = write_gguf(tmp_path / "q8_1.gguf", TINY["llama-tied-legacy-quants"],
                      override_type={"blk.0.ffn_up.weight": "Q8_1"})
    with pytest.raises(UnsupportedModelError, match="GGUF tensor type.*Q8_1 cannot be dequantized"):
        Transformer.load(path)


def test_unsupported_architecture_is_named(tmp_path):
    from gguf import GGUFWriter

    writer = GGUFWriter(str(tmp_path / "gemma.gguf"), "gemma")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="unsupported GGUF architecture 'gemma'; specee supports llama, qwen2"):
        Transformer.load(tmp_path / "gemma.gguf")


def test_directory_with_several_ggufs_lists_them(tiny_gguf, tmp_path):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).symlink_to(tiny_gguf("llama-separate-kquants"))
    with pytest.raises(CheckpointError, match=r"holds 2 GGUF files \(a.gguf, b.gguf\)"):
        Transformer.load(tmp_path)


def test_loading_pauses_the_cyclic_collector_and_restores_it(tmp_path, monkeypatch):
    """Parsing a GGUF vocabulary makes ~700k long-lived objects; collections while they piled up
    walked them all again (SmolLM2 Q4_1: 7.3 s to load, 5.6 s without them). The collector is paused
    for the load and left as the caller had it, also when the load fails."""
    import gc

    from specee import LLM

    if not SMOLLM2.exists():
        pytest.skip(f"real model SmolLM2 not available: {SMOLLM2} is absent (../shared/models is not mounted)")
    seen = []
    real_load = Transformer.load.__func__
    monkeypatch.setattr(Transformer, "load", classmethod(lambda cls, *a, **k: (seen.append(gc.isenabled()),
                                                                              real_load(cls, *a, **k))[1]))
    llm = LLM(SMOLLM2, threads=1)
    assert llm.model.cfg.num_layers == 30
    assert seen == [False] and gc.isenabled()
    with pytest.raises(FileNotFoundError):
        LLM(tmp_path / "missing.gguf")
    assert gc.isenabled()
    gc.disable()
    try:
        with pytest.raises(FileNotFoundError):
            LLM(tmp_path / "missing.gguf")
        assert not gc.isenabled()  # the caller's choice stays
    finally:
        gc.enable()


def test_an_opened_gguf_keeps_its_metadata_and_tensors_but_not_the_parsed_vocabulary():
    """gguf's reader parses a vocabulary into ~250k numpy views and ~285k dicts (SmolLM2); kept in the
    cache they were a million objects that every full collection walked (0.2-0.3 s pauses while
    serving). What is kept is the metadata, the tensors and the vocabulary's size."""
    import gc

    from specee.model.gguf import open_gguf

    if not SMOLLM2.exists():
        pytest.skip(f"real model SmolLM2 not available: {SMOLLM2} is absent (../shared/models is not mounted)")
    gguf_file = open_gguf(SMOLLM2)
    assert gguf_file is open_gguf(SMOLLM2)  # cached
    assert gguf_file.metadata["general.architecture"] == "llama" and gguf_file.vocab_size == 49152
    assert "tokenizer.ggml.tokens" not in gguf_file.metadata and len(gguf_file.tensors) == 272
    gc.collect()
    views = sum(type(o) is np.memmap for o in gc.get_objects())
    assert views < 5000, f"{views} numpy memmaps alive: a parsed vocabulary is being kept"


def test_a_quantized_gguf_keeps_its_embedding_as_blocks_and_looks_up_the_same_rows():
    """On the CPU the table stays the file's blocks (no float32 copy: 890 MiB for Qwen2.5-1.5B); its
    rows dequantize on lookup to exactly what the float table held."""
    import torch

    from specee.model.gguf_blocks import GGUFWeight
    from specee.model.llama import Transformer

    SMOLLM2_GGUF = MODELS / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not SMOLLM2_GGUF.is_file():
        pytest.skip(f"{SMOLLM2_GGUF} not found (../shared is absent)")
    quantized = Transformer.load(SMOLLM2_GGUF, quantization="auto")
    table = Transformer.load(SMOLLM2_GGUF).embedding  # float weights: the dequantized table
    assert isinstance(quantized.embedding, GGUFWeight) and isinstance(table, torch.Tensor)
    ids = torch.tensor([[0, 5, 49151, 5], [123, 7, 7, 42]])
    assert torch.equal(quantized.embed(ids), torch.nn.functional.embedding(ids, table))
    assert quantized.embed(ids[:, :0]).shape == (2, 0, 576)  # a step whose rows all carry over (lossless flush)
    assert quantized.embedding.data.nbytes < table.numel() * table.element_size() / 3  # Q8_0: 8.5 bits a weight
