"""Reading GGUF checkpoints (llama.cpp's format): config from the metadata, tensors dequantized.

The header is read by gguf_header.py (tensors as gguf's ReaderTensors, memory-mapped), every
tensor is dequantized with `gguf.quants.dequantize` into float32, then renamed to the Hugging Face
names the Transformer constructor takes. Two llama.cpp conventions are undone on the way:

* names: `blk.N.attn_q.weight` is `model.layers.N.self_attn.q_proj.weight` (`gguf_tensor_map`);
* llama-architecture files store the Q and K projections with their rows permuted per head
  (convert_hf_to_gguf.py's `permute`, for llama.cpp's interleaved RoPE); `unpermute_rows` puts
  them back in the half-split order specee's RoPE uses. qwen2 files are written unpermuted.

Both helpers work on raw quantized blocks too (any array whose dim 0 is output rows), so a
loader that keeps the weights quantized can reuse them.
"""
from __future__ import annotations

import functools
import hashlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import ModelConfig, UnsupportedModelError, count, head_shape, position_limit, positive
from .gguf_blocks import GGUFWeight, all_finite
from .gguf_header import READ_ERRORS, Header
from .weights import CheckpointError

# GGUF `general.architecture` -> the transformers class name specee's ModelConfig uses
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
PERMUTED_QK = {"LlamaForCausalLM"}  # architectures whose GGUF converter permutes attn_q / attn_k rows

_LAYER_TENSORS = {  # GGUF per-block name -> HF per-layer name
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_QKV_BIASES = {"attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
               "attn_v.bias": "self_attn.v_proj.bias"}
_O_BIAS = {"attn_output.bias": "self_attn.o_proj.bias"}


def _supported_types() -> frozenset:
    """Tensor types the gguf package can dequantize (plain float types plus its quant kernels)."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import _type_traits

    return frozenset({T.F32, T.F16, *_type_traits})


@dataclass(frozen=True)
class GGUFFile:
    """What specee reads of a GGUF file: its scalar and string metadata (arrays such as the vocabulary
    left out), its tensors (gguf's ReaderTensor, data memory-mapped) and where their data starts.
    No parsed vocabulary is kept (gguf's reader made SmolLM2's ~250k numpy views and ~285k dicts, a
    million objects that every full collection of Python's collector walked: 0.2-0.3 s pauses in a
    server's decode loop)."""

    metadata: dict[str, Any]
    tensors: list
    data_offset: int
    vocab_size: int | None  # tokens in the file's tokenizer, if it has one
    metadata_digest: str  # sha256 of the metadata's bytes: what its converted tokenizer is stored by


def open_gguf(path: str | Path) -> GGUFFile:
    """A memory-mapped GGUF file (kept for a few files: the tokenizer's store and the loader read the
    same one); a truncated or corrupt file is a one-line CheckpointError."""
    path = Path(path)
    stat = path.stat()
    return _open_gguf(path.resolve(), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _open_gguf(path: Path, _mtime_ns: int, _size: int) -> GGUFFile:
    try:
        import gguf  # noqa: F401  (tensor types and dequantization)
    except ImportError:
        raise ImportError("reading GGUF files needs the gguf package: pip install 'specee[gguf]'") from None
    try:
        header = Header(path)
    except READ_ERRORS as e:
        detail = " ".join(str(e).split()) or type(e).__name__
        raise CheckpointError(f"{path}: not a readable GGUF file (truncated or corrupt: {detail})") from None
    tokens = header.array_lengths.get("tokenizer.ggml.tokens")
    digest = hashlib.sha256(header.buf[: header.metadata_end]).hexdigest()
    return GGUFFile(header.metadata, header.tensors, header.data_offset, tokens, digest)


def config_from_gguf(gguf_file: GGUFFile, source: str | Path) -> ModelConfig:
    """ModelConfig from a GGUF's metadata; architectures other than llama and qwen2 are refused."""
    meta = gguf_file.metadata
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(f"{source}: unsupported GGUF architecture {arch!r}; specee supports "
                                    f"{', '.join(sorted(GGUF_ARCHITECTURES))}")
    names = {t.name for t in gguf_file.tensors}
    if "rope_freqs.weight" in names:
        raise UnsupportedModelError(f"{source}: per-dimension RoPE frequencies (rope_freqs.weight, Llama 3.1 "
                                    "scaling) are not supported in GGUF files")

    def need(key: str) -> Any:
        if f"{arch}.{key}" not in meta:
            raise CheckpointError(f"{source}: GGUF metadata lacks {arch}.{key}")
        return meta[f"{arch}.{key}"]

    def number(key: str, check=count, default: Any = None) -> Any:  # checked: the file is untrusted
        return check(need(key) if default is None else meta.get(f"{arch}.{key}", default), f"{arch}.{key}", str(source))

    hidden, num_heads = number("embedding_length"), number("attention.head_count")
    num_kv_heads = number("attention.head_count_kv", default=num_heads)
    key_length = meta.get(f"{arch}.attention.key_length")
    head_dim = head_shape(hidden, num_heads, num_kv_heads, None if key_length is None else number("attention.key_length"),
                          str(source))
    rotary = number("rope.dimension_count", default=head_dim)
    if rotary != head_dim:
        raise UnsupportedModelError(f"{source}: partial rotary embeddings ({rotary} of {head_dim} dims) are not supported")
    num_layers = number("block_count")
    if f"blk.{num_layers - 1}.attn_norm.weight" not in names or f"blk.{num_layers}.attn_norm.weight" in names:
        raise CheckpointError(f"{source}: {arch}.block_count {num_layers} does not match its blk.N tensors")
    rope_type, rope_scaling = "default", None
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        rope_type, rope_scaling = "linear", {"rope_type": "linear", "factor": number("rope.scaling.factor", positive)}
    elif scaling != "none":
        raise UnsupportedModelError(f"{source}: unsupported GGUF rope scaling {scaling!r}; supported: none, linear")
    embedding = next((t for t in gguf_file.tensors if t.name == "token_embd.weight"), None)
    if embedding is None:
        raise CheckpointError(f"{source}: GGUF file has no token_embd.weight")
    special = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id",
               "tokenizer.ggml.bos_token_id")
    for key in special:
        if key in meta and gguf_file.vocab_size is not None and not 0 <= int(meta[key]) < gguf_file.vocab_size:
            raise CheckpointError(f"{source}: {key} {meta[key]} is not a token id (the vocabulary has "
                                  f"{gguf_file.vocab_size} tokens)")
    eos_ids = tuple(dict.fromkeys(int(meta[k]) for k in special[:3] if k in meta))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    types = Counter(t.tensor_type.name for t in gguf_file.tensors if len(t.shape) > 1)
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=number("vocab_size", default=embedding.shape[-1]),
        hidden_size=hidden,
        intermediate_size=number("feed_forward_length"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=number("attention.layer_norm_rms_epsilon", positive),
        rope_theta=number("rope.freq_base", positive, 10000.0),
        rope_type=rope_type,
        rope_scaling=rope_scaling,
        max_position_embeddings=number("context_length", position_limit),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias=arch == "qwen2" or "blk.0.attn_q.bias" in names,
        o_bias="blk.0.attn_output.bias" in names,
        sliding_window=None,
        checkpoint_dtype="GGUF " + "/".join(name for name, _ in types.most_common()),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids,
    )


def gguf_tensor_map(cfg: ModelConfig) -> dict[str, str]:
    """{GGUF tensor name: HF tensor name} for every tensor a model with this config holds."""
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    if not cfg.tie_word_embeddings:
        names["output.weight"] = "lm_head.weight"
    per_layer = dict(_LAYER_TENSORS)
    if cfg.qkv_bias:
        per_layer.update(_QKV_BIASES)
    if cfg.o_bias:
        per_layer.update(_O_BIAS)
    for i in range(cfg.num_layers):
        names.update({f"blk.{i}.{g}": f"model.layers.{i}.{h}" for g, h in per_layer.items()})
    return names


def permuted_heads(cfg: ModelConfig, gguf_name: str) -> int | None:
    """Heads to un-permute a tensor by (llama attn_q / attn_k), or None when it is stored as is."""
    if cfg.architecture not in PERMUTED_QK:
        return None
    if ".attn_q." in gguf_name:
        return cfg.num_heads
    if ".attn_k." in gguf_name:
        return cfg.num_kv_heads
    return None


def unpermute_rows(rows, num_heads: int):
    """Undo llama.cpp's per-head Q/K row interleave on dim 0 (torch tensor or numpy array, any trailing dims:
    float weights, biases or raw quantized blocks)."""
    per_head = rows.shape[0] // num_heads
    rest = tuple(rows.shape[1:])
    return rows.reshape(num_heads, per_head // 2, 2, *rest).swapaxes(1, 2).reshape(rows.shape)


def check_tensor_types(gguf_file: GGUFFile, source: str | Path) -> None:
    supported = _supported_types()
    bad = sorted({t.tensor_type.name for t in gguf_file.tensors if t.tensor_type not in supported})
    if bad:
        raise UnsupportedModelError(f"{source}: GGUF tensor type(s) {', '.join(bad)} cannot be dequantized "
                                    f"by the gguf package installed")


def check_finite(tensor, source: str | Path) -> None:
    """Refuse a tensor holding NaN or Inf (a corrupt file) before it is used, naming it."""
    if not all_finite(tensor.tensor_type, tensor.data):
        raise CheckpointError(f"{source}: tensor {tensor.name} holds NaN or infinite values (the file is corrupt)")


def read_gguf_state_dict(gguf_file: GGUFFile, cfg: ModelConfig, source: str | Path, dtype: torch.dtype = torch.float32,
                         raw_matrices: bool = False) -> dict[str, torch.Tensor | GGUFWeight]:
    """Every tensor dequantized (gguf.quants.dequantize) to `dtype`, un-permuted, under its HF name;
    with raw_matrices, weight matrices stay raw blocks (GGUFWeight, rows un-permuted) for quant.py."""
    from gguf.quants import dequantize

    check_tensor_types(gguf_file, source)
    mapping = gguf_tensor_map(cfg)
    extra = [t.name for t in gguf_file.tensors if t.name not in mapping]
    if extra:
        raise CheckpointError(f"{source}: unexpected GGUF tensors not used by {cfg.architecture}: {extra[:5]}")
    tensors: dict[str, torch.Tensor] = {}
    for t in gguf_file.tensors:
        check_finite(t, source)
        heads = permuted_heads(cfg, t.name)
        if raw_matrices and t.data.ndim == 2:  # a row permutation of quantized rows is exact
            tensors[mapping[t.name]] = GGUFWeight(t.tensor_type, t.data if heads is None else unpermute_rows(t.data, heads))
            continue
        values = torch.from_numpy(np.require(dequantize(t.data, t.tensor_type), np.float32, ["C", "W"]))
        if heads is not None:
            values = unpermute_rows(values, heads)
        tensors[mapping[t.name]] = values.to(dtype)
    return tensors


def fingerprint_gguf(path: str | Path, gguf_file: GGUFFile | None = None) -> str:
    """A cheap identity: the header (metadata and tensor table) plus strided byte samples of several tensors."""
    path = Path(path)
    gguf_file = gguf_file if gguf_file is not None else open_gguf(path)
    h = hashlib.sha256(f"gguf:{path.stat().st_size}".encode())
    with open(path, "rb") as f:
        h.update(f.read(gguf_file.data_offset))
    tensors = gguf_file.tensors
    picks = sorted({round(i * (len(tensors) - 1) / 7) for i in range(8)}) if tensors else []
    for i in picks:
        raw = tensors[i].data.reshape(tensors[i].data.shape[0], -1) if tensors[i].data.ndim > 1 else tensors[i].data[:, None]
        step = max(1, raw.shape[0] // 8)
        h.update(np.ascontiguousarray(raw[::step]).view(np.uint8).tobytes())
    return h.hexdigest()[:16]
