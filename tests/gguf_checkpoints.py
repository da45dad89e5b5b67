"""Tiny random GGUF files written with `gguf.GGUFWriter`, laid out the way llama.cpp's converter
writes them (its tensor names, Q/K rows permuted for llama, 1-D tensors in F32), for parity tests
against transformers loading the same file with `gguf_file=`.

Weights are quantized with `gguf.quants.quantize` where the gguf package can quantize the type;
the k-quants (Q4_K, Q5_K, Q6_K), which it can only dequantize, get random blocks with small
scales, which are valid blocks of those types all the same.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

# types written as random blocks: byte offset and count of the float16 scale fields in one block (the
# rest is random bits); Q8_1 is there only to be refused (the gguf package cannot dequantize it)
_RANDOM_BLOCKS = {"Q4_K": ((0, 2),), "Q5_K": ((0, 2),), "Q6_K": ((208, 1),), "Q8_1": ()}


@dataclass(frozen=True)
class TinyGGUF:
    arch: str  # "llama" or "qwen2"
    types: tuple[str, ...]  # tensor types of the 2-D weights, assigned round-robin
    tied: bool
    layers: int = 2
    hidden: int = 256  # k-quant blocks hold 256 values: rows must be multiples of it
    intermediate: int = 512
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 320


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's Q/K row permutation (HF half-split -> interleaved RoPE)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _encode(w: np.ndarray, type_name: str, rng: np.random.Generator) -> tuple[np.ndarray, object]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize

    qtype = GGMLQuantizationType[type_name]
    if qtype == GGMLQuantizationType.F32:
        return w.astype(np.float32), None
    if qtype == GGMLQuantizationType.F16:
        return w.astype(np.float16), None
    if type_name in _RANDOM_BLOCKS:
        block, size = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(w.shape[0], w.shape[1] // block, size), dtype=np.uint8)
        for offset, count in _RANDOM_BLOCKS[type_name]:  # Q4_K / Q5_K: d and dmin; Q6_K: d
            scales = rng.uniform(1e-4, 4e-4, size=(w.shape[0], w.shape[1] // block, count)).astype(np.float16)
            raw[..., offset : offset + 2 * count] = scales.view(np.uint8)
        return raw.reshape(w.shape[0], -1), qtype
    return quantize(w.astype(np.float32), qtype), qtype


def hf_weights(spec: TinyGGUF, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights under their Hugging Face names (norms and biases away from 1 and 0)."""
    rng = np.random.default_rng(seed)
    H, I, D = spec.hidden, spec.intermediate, spec.hidden // spec.heads
    q, kv = spec.heads * D, spec.kv_heads * D

    def mat(rows: int, cols: int) -> np.ndarray:
        return rng.normal(0, 0.08, size=(rows, cols)).astype(np.float32)

    def vec(n: int, center: float) -> np.ndarray:
        return (center + rng.normal(0, 0.1, size=n)).astype(np.float32)

    w = {"model.embed_tokens.weight": mat(spec.vocab, H), "model.norm.weight": vec(H, 1.0)}
    if not spec.tied:
        w["lm_head.weight"] = mat(spec.vocab, H)
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        w.update({p + "input_layernorm.weight": vec(H, 1.0), p + "post_attention_layernorm.weight": vec(H, 1.0),
                  p + "self_attn.q_proj.weight": mat(q, H), p + "self_attn.k_proj.weight": mat(kv, H),
                  p + "self_attn.v_proj.weight": mat(kv, H), p + "self_attn.o_proj.weight": mat(H, q),
                  p + "mlp.gate_proj.weight": mat(I, H), p + "mlp.up_proj.weight": mat(I, H),
                  p + "mlp.down_proj.weight": mat(H, I)})
        if spec.arch == "qwen2":
            w.update({p + "self_attn.q_proj.bias": vec(q, 0.0), p + "self_attn.k_proj.bias": vec(kv, 0.0),
                      p + "self_attn.v_proj.bias": vec(kv, 0.0)})
    return w


def write_gguf(path: Path, spec: TinyGGUF, seed: int = 0, override_type: dict[str, str] | None = None,
               metadata: dict[str, object] | None = None) -> Path:
    """Write `spec` as a GGUF file; override_type forces the type of named GGUF tensors; metadata ({key
    after the architecture: an int, float or str}) replaces or adds the architecture's keys (hostile files)."""
    from gguf import GGUFWriter

    from specee.model.config import ModelConfig
    from specee.model.gguf import gguf_tensor_map

    rng = np.random.default_rng(seed + 1)
    D = spec.hidden // spec.heads
    writer = GGUFWriter(str(path), spec.arch)
    writer.add_name(f"tiny-{spec.arch}")
    meta = {"block_count": spec.layers, "context_length": 256, "embedding_length": spec.hidden,
            "feed_forward_length": spec.intermediate, "attention.head_count": spec.heads,
            "attention.head_count_kv": spec.kv_heads, "rope.dimension_count": D,
            "rope.freq_base": 10000.0 if spec.arch == "llama" else 1000000.0,
            "attention.layer_norm_rms_epsilon": 1e-6, "vocab_size": spec.vocab, **(metadata or {})}
    for key, value in meta.items():
        key = f"{spec.arch}.{key}"
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint64(key, value) if value >= 2**32 else writer.add_uint32(key, value)
    cfg = ModelConfig(architecture={"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[spec.arch],
                      vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
                      num_layers=spec.layers, num_heads=spec.heads, num_kv_heads=spec.kv_heads, head_dim=D,
                      rms_norm_eps=1e-6, rope_theta=1e4, rope_type="default", rope_scaling=None,
                      max_position_embeddings=256, tie_word_embeddings=spec.tied, qkv_bias=spec.arch == "qwen2",
                      o_bias=False, sliding_window=None, checkpoint_dtype="float32", bos_token_id=None,
                      eos_token_ids=())
    to_gguf = {hf: g for g, hf in gguf_tensor_map(cfg).items()}
    weights = hf_weights(spec, seed)
    matrices = 0
    for hf_name, w in weights.items():
        name = to_gguf[hf_name]
        if spec.arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            w = _permute(w, spec.heads if ".attn_q." in name else spec.kv_heads)
        if w.ndim == 1:
            data, raw = w, None
        else:
            type_name = (override_type or {}).get(name, spec.types[matrices % len(spec.types)])
            matrices += 1
            data, raw = _encode(w, type_name, rng)
        writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
