"""Full-depth passes over a dense batch of prompts, for the tools that run fixed batches outside
the engine (calibration's exit data, the early-exit loop's prefill, `bench` cost probes).

Prompts are left-padded into one batch; padding slots are never marked filled in the KV
cache, so no row ever attends to them, and RoPE positions start at 0 for every prompt.
Serving goes through the engine (engine/engine.py), whose requests each own a run of the cache pool.
"""
from __future__ import annotations

import torch

from ..model.kv_cache import KVCache
from ..model.llama import Transformer
from ..model.step_inputs import StepInputs


def prefill(model: Transformer, cache: KVCache, prompts: list[list[int]]) -> torch.Tensor:
    """Run left-padded prompts through every layer; return the last position's hidden state [B, H]."""
    return model.forward(*prefill_inputs(model, cache, prompts), cache)[:, -1]


def prefill_inputs(model: Transformer, cache: KVCache, prompts: list[list[int]]) -> tuple[torch.Tensor, StepInputs]:
    """Left-pad prompts into one batch: token ids [B, W] and their step inputs; marks the
    non-padding slots filled in `cache` (padding is never read)."""
    device = model.device
    width = max(len(p) for p in prompts)
    if all(len(p) == width for p in prompts):  # no padding: causal attention, no mask
        cache.filled[:, :, :width] = True
        cache.length = width
        return torch.tensor(prompts, device=device), model.range_inputs(0, width)
    pads = torch.tensor([width - len(p) for p in prompts], device=device)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    slots = model.slot_ids[:width]
    positions = (slots[None, :] - pads[:, None]).clamp(min=0)
    cache.filled[:, :, :width] = slots[None, :] >= pads[:, None]
    cache.length = width
    return ids, model.step_inputs(positions, slots, cache.attention_mask(0, slots, width), width)


def decode_step(model: Transformer, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor,
                depth: int | None = None) -> torch.Tensor:
    """Append one token per row ([B]) at the next slot through layers 0..depth-1 (default: all);
    return hidden states [B, H]."""
    n = cache.length
    slots = cache.slot_ids[n : n + 1]
    cache.mark_filled(slice(None), n)
    cache.length = n + 1
    mask = cache.attention_mask(0, slots, n + 1) if cache.padded else None
    step = model.step_inputs(positions[:, None], slots, mask, n + 1)
    return model.forward(tokens[:, None], step, cache, depth)[:, -1]
