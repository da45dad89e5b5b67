"""Model configuration parsed from a Hugging Face `config.json`.

Both the transformers-4 keys (`rope_theta`, `rope_scaling`, `torch_dtype`) and the
transformers-5 ones (`rope_parameters`, `dtype`) are accepted. Anything this runtime
cannot execute exactly is refused here, with the reason, before weights are read.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from numbers import Integral, Real
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


class UnsupportedModelError(ValueError):
    """The checkpoint uses an architecture or option the runtime does not implement."""


# Positions a config may declare: RoPE tables and the default KV pool are sized from it, so a hostile
# 2**40 asked torch for terabytes (Qwen2.5-1M, the longest the supported families ship, declares 1,010,000)
MAX_CONTEXT = 1 << 21


def count(value: Any, name: str, source: str, least: int = 1) -> int:
    """A config integer, checked: untrusted files give strings, floats or zeros that failed far later."""
    if not isinstance(value, Integral) or isinstance(value, bool) or value < least:
        raise ValueError(f"{source}: {name} must be an integer >= {least}, got {value!r}")
    return int(value)


def positive(value: Any, name: str, source: str) -> float:
    """A config float, checked finite and > 0 (a NaN RoPE base loaded and decoded garbage)."""
    if not isinstance(value, Real) or isinstance(value, bool) or not 0 < value < math.inf:
        raise ValueError(f"{source}: {name} must be a finite number > 0, got {value!r}")
    return float(value)


def head_shape(hidden: int, num_heads: int, num_kv_heads: int, head_dim: int | None, source: str) -> int:
    """The head dimension, checked against the heads: GQA groups whole, RoPE on pairs."""
    if head_dim is None:
        if hidden % num_heads:
            raise ValueError(f"{source}: hidden size {hidden} is not a multiple of the {num_heads} attention heads")
        head_dim = hidden // num_heads
    if num_heads % num_kv_heads:
        raise ValueError(f"{source}: {num_heads} attention heads do not split into {num_kv_heads} key/value heads")
    if head_dim < 2 or head_dim % 2:
        raise ValueError(f"{source}: head dimension {head_dim} is not an even number >= 2 (RoPE rotates pairs)")
    return head_dim


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_type: str
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    sliding_window: int | None
    checkpoint_dtype: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def context_limit(self) -> int:
        """Tokens one sequence may hold: the position limit, capped by a sliding window."""
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        archs = raw.get("architectures") or []
        archs = [archs] if isinstance(archs, str) else archs
        arch = archs[0] if isinstance(archs, list) and archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"{source}: unsupported architecture {arch!r} (model_type {raw.get('model_type')!r}); "
                f"specee supports {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        missing = [key for key in REQUIRED_KEYS if key not in raw]
        if missing:
            raise ValueError(f"{source}: missing required key(s) {', '.join(missing)}")
        if raw.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"{source}: unsupported hidden_act {raw['hidden_act']!r} (only 'silu')")
        if raw.get("mlp_bias", False):
            raise UnsupportedModelError(f"{source}: mlp_bias=true is not supported")
        rope_theta, rope_type, rope_scaling = _parse_rope(raw, source)
        num_heads = count(raw["num_attention_heads"], "num_attention_heads", source)
        hidden = count(raw["hidden_size"], "hidden_size", source)
        num_kv_heads = count(raw.get("num_key_value_heads") or num_heads, "num_key_value_heads", source)
        given = raw.get("head_dim")
        head_dim = head_shape(hidden, num_heads, num_kv_heads, None if given is None else count(given, "head_dim", source),
                              source)
        family = SUPPORTED_ARCHITECTURES[arch]
        # Qwen2 always has q/k/v biases; Llama's `attention_bias` adds them to q/k/v and o.
        llama_bias = family == "llama" and bool(raw.get("attention_bias", False))
        qkv_bias = family == "qwen2" or llama_bias
        sliding = raw.get("sliding_window")
        if family == "qwen2" and not raw.get("use_sliding_window", False):
            sliding = None
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            vocab_size=count(raw["vocab_size"], "vocab_size", source),
            hidden_size=hidden,
            intermediate_size=count(raw["intermediate_size"], "intermediate_size", source),
            num_layers=count(raw["num_hidden_layers"], "num_hidden_layers", source),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=positive(raw.get("rms_norm_eps", 1e-6), "rms_norm_eps", source),
            rope_theta=rope_theta,
            rope_type=rope_type,
            rope_scaling=rope_scaling,
            max_position_embeddings=position_limit(raw.get("max_position_embeddings", 2048), "max_position_embeddings",
                                                   source),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=llama_bias,
            sliding_window=sliding,
            checkpoint_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(raw, source=str(path))


def position_limit(value: Any, name: str, source: str) -> int:
    n = count(value, name, source)
    if n > MAX_CONTEXT:
        raise ValueError(f"{source}: {name} {n} is past the {MAX_CONTEXT} positions specee sizes tables for")
    return n


def _parse_rope(raw: dict[str, Any], source: str) -> tuple[float, str, dict[str, Any] | None]:
    params = raw.get("rope_parameters")
    if params is not None:  # transformers >= 5
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        scaling = params
    else:
        theta = raw.get("rope_theta", 10000.0)
        scaling = raw.get("rope_scaling")
    rope_type = "default"
    if scaling:
        rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{source}: unsupported rope scaling {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type != "default" and "factor" in scaling:
        positive(scaling["factor"], "rope_scaling.factor", source)
    return positive(theta, "rope_theta", source), rope_type, (dict(scaling) if rope_type != "default" else None)
