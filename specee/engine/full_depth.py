"""Plain full-depth decoding of a batch of requests: the baseline every fast path is checked against.

Prompts are left-padded into one batch; padding slots are never marked filled in the KV
cache, so no row ever attends to them, and RoPE positions start at 0 for every prompt.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from ..clock import device_time
from ..model.kv_cache import KVCache
from ..model.llama import StepInputs, Transformer
from ..sampling import RowSampler
from .sequence import Sequence


def check_fits(model: Transformer, prompt_len: int, max_tokens: int) -> int:
    """Cache length a request needs; a clear error if it exceeds the model's context."""
    from ..model.kv_cache import ContextLengthError

    if prompt_len == 0:
        raise ValueError("empty prompt: at least one token is needed")
    needed = prompt_len + max_tokens
    limit = model.cfg.context_limit
    if needed > limit:
        raise ContextLengthError(
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {needed} exceeds the model's "
            f"context of {limit} tokens; shorten the prompt or lower max_tokens")
    return needed


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
    slots = model.slot_ids[n : n + 1]
    cache.mark_filled(slice(None), n)
    cache.length = n + 1
    mask = None if cache.filled.shape[1] == 1 else cache.attention_mask(0, slots, n + 1)
    step = model.step_inputs(positions[:, None], slots, mask, n + 1)
    return model.forward(tokens[:, None], step, cache, depth)[:, -1]


@torch.inference_mode()
def decode_full_depth(model: Transformer, seqs: list[Sequence]) -> Iterator[None]:
    """Greedy or sampled decoding at full depth, one token per sequence per step; yields after each
    step (the caller reads the sequences: streaming needs no thread). Each sequence keeps its own
    SamplingParams (filters, seed, limits, stop strings); finished rows ride along until all are done."""
    params = [s.params for s in seqs]
    for s in seqs:
        check_fits(model, len(s.prompt_ids), s.params.max_tokens)
    cache = model.new_cache(len(seqs), max(len(s.prompt_ids) for s in seqs) + max(p.max_tokens for p in params))
    sampler = RowSampler(params, [p.make_generator(model.device) for p in params], model.device)  # per request, as vLLM seeds
    positions = torch.tensor([len(s.prompt_ids) for s in seqs], device=model.device)

    t0 = device_time(model.device)
    h = prefill(model, cache, [s.prompt_ids for s in seqs])
    t1 = device_time(model.device)
    try:
        while True:
            tokens = sampler(model.logits(h))
            for seq, token in zip(seqs, tokens.tolist()):
                if not seq.finished:
                    seq.append(token)
            yield
            if all(s.finished for s in seqs):
                break
            h = decode_step(model, cache, tokens, positions)
            positions += 1
    finally:  # also when the caller stops early (a closed stream)
        t2 = device_time(model.device)
        for s in seqs:
            s.stats.prefill_seconds = t1 - t0
            s.stats.decode_seconds = t2 - t1
            s.stats.decode_tokens = max(len(s.output_ids) - 1, 0)  # the first token came from the prefill
