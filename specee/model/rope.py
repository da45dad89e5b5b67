"""Rotary position embeddings (default, linear and llama3 frequency scaling), HF half-rotation layout."""
from __future__ import annotations

import math

import torch

from .config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    # float32 and the same operation order as transformers, so the RoPE tables match it bit for
    # bit (a float64 inv_freq differs by an ulp, which grows with the position: ~2e-4 in logits at 4k)
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling or {}
    if cfg.rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif cfg.rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_tables(cfg: ModelConfig, max_len: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [max_len, head_dim], computed once per model (gathered by position per step)."""
    inv_freq = inverse_frequencies(cfg)
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(device, dtype), emb.sin().to(device, dtype)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated, so that rotate_half(x) * sin == roll(x, D/2) * signed_sin."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x: [B, S, heads, D] (q and k heads together: one rotation for both); cos/sin: [B, S, 1, D].

    HF's x * cos + rotate_half(x) * sin, with rotate_half(x) = cat(-x2, x1) written as a roll
    and the sign folded into the table: four ops instead of six."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed
