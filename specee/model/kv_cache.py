"""A preallocated KV cache whose fill state is tracked per layer and per slot.

Early exit leaves some layers unwritten for some positions, so "which entries exist" is a
per-layer fact: `filled[layer, row, slot]`. Attention at a layer only reads filled slots
(the `skip` policy relies on that), and truncation (rollback in lossless mode) clears the
fill state of every layer past a position.
"""
from __future__ import annotations

import torch

from .config import ModelConfig


KV_CACHE_DTYPES = ("auto", "float16", "float32")  # what a cache may store (Transformer.kv_dtype_for)


def check_kv_cache_dtype(value: str) -> None:
    if value not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype (--kv-cache-dtype) must be one of {', '.join(KV_CACHE_DTYPES)}, got {value!r}")


class ContextLengthError(ValueError):
    """A request does not fit the model's context window."""


class KVCache:
    def __init__(self, cfg: ModelConfig, batch_size: int, max_len: int, device: torch.device, dtype: torch.dtype):
        shape = (cfg.num_layers, batch_size, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.filled = torch.zeros(cfg.num_layers, batch_size, max_len, dtype=torch.bool, device=device)
        self.max_len = max_len
        self.length = 0  # slots in use: the token history length (padding included)
        # slot indices 0..max_len-1, made once: decode steps slice them. The cache's own, not the model's
        # position range: a continuous batch aligns staggered rows on shared slots, which can pass the context
        self.slot_ids = torch.arange(max_len, device=device)
        # whether some row may hold unfilled slots below `length` (left padding), so attention must read
        # through the mask; a lone row is filled from slot 0 unless its owner says otherwise
        self.padded = batch_size > 1
        self.k_layers, self.v_layers = self.k.unbind(0), self.v.unbind(0)  # per-layer views, made once
        self.pool_slot = None  # storage of its own, in no pool

    @classmethod
    def over(cls, k: torch.Tensor, v: torch.Tensor, filled: torch.Tensor, slot_ids: torch.Tensor,
             pool_slot: int) -> KVCache:
        """A one-row cache over storage someone else owns (engine/kv_manager.py: a request's run of
        pool blocks): k, v [layers, 1, kv_heads, len, D] views, filled [layers, 1, len]; pool_slot:
        where its slot 0 lies in the pool."""
        cache = object.__new__(cls)
        cache.length, cache.padded = 0, False
        cache.rebind(k, v, filled, slot_ids, pool_slot)
        return cache

    def rebind(self, k: torch.Tensor, v: torch.Tensor, filled: torch.Tensor, slot_ids: torch.Tensor,
               pool_slot: int) -> None:
        """Point this cache at other pool storage holding its rows (its run grew or moved; its length
        stays): whoever holds the cache (a KV policy, a drafter's state) sees the new run."""
        self.pool_slot = pool_slot
        self.k, self.v, self.filled = k, v, filled
        self.max_len = k.shape[3]
        self.slot_ids = slot_ids[: self.max_len]
        self.k_layers, self.v_layers = k.unbind(0), v.unbind(0)

    def mark_filled(self, layers: slice, slots: torch.Tensor | slice) -> None:
        """Record that `layers` now hold K/V for `slots` (called once per step, not per layer)."""
        self.filled[layers, :, slots] = True

    def truncate(self, length: int) -> None:
        """Forget every slot at or past `length`, in every layer (the data stays, unread)."""
        self.filled[:, :, length:] = False
        self.length = min(self.length, length)

    def attention_mask(self, layer: int, slots: torch.Tensor, kv_len: int) -> torch.Tensor:
        """[B, 1, S, kv_len]: row at slot s reads filled slots <= s of `layer` (and always itself,
        so padding rows stay finite)."""
        keys = torch.arange(kv_len, device=slots.device)
        causal = keys <= slots[:, None]  # [S, kv_len]
        mask = self.filled[layer, :, None, :kv_len] & causal
        return (mask | (keys == slots[:, None])).unsqueeze(1)
