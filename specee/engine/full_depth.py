"""Plain full-depth decoding of a batch of requests: the baseline every fast path is checked against.

Prompts are left-padded into one batch; padding slots are never marked filled in the KV
cache, so no row ever attends to them, and RoPE positions start at 0 for every prompt.
`FullDepthBatch` keeps such a batch running while requests join and leave it (continuous batching).
"""
from __future__ import annotations

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
    slots = cache.slot_ids[n : n + 1]
    cache.mark_filled(slice(None), n)
    cache.length = n + 1
    mask = cache.attention_mask(0, slots, n + 1) if cache.padded else None
    step = model.step_inputs(positions[:, None], slots, mask, n + 1)
    return model.forward(tokens[:, None], step, cache, depth)[:, -1]


class FullDepthBatch:
    """Greedy or sampled decoding at full depth, one token per request per step, while requests join
    and leave: an iterator of steps (the caller reads the sequences: streaming needs no thread).

    Every row writes the same cache slot in a step (`Transformer.layer` takes one slot list for the
    batch), so rows are right-aligned: a newcomer's prompt is prefilled on its own (a fresh cache:
    no attention over the batch's history) and copied left-padded into a new row ending at the slot
    the running rows write in that step. Padding slots stay unfilled, so no row reads them; RoPE
    positions are per row. Whenever the rows change (newcomers, finished or dropped rows) the cache is
    rebuilt in one copy rather than rows being reused in place: finished rows leave (compaction, so
    they cost nothing after), leading slots no remaining row reads are dropped, room is made on the
    left for a prompt longer than the history, and the length is sized to what the rows may still
    need. That copy moves about the bytes one step's attention reads, and only on a change; a step
    without one is a single batched decode pass. The sampler is rebuilt with the rows, and each
    request keeps its own generator, so seeded sampling draws the same tokens whatever the batch holds.
    """

    def __init__(self, model: Transformer, seqs: list[Sequence]):
        self.model = model
        self.seqs: list[Sequence] = []  # the rows, in cache order
        self.pending: list[Sequence] = []  # added; they join at the next step
        self.cache = model.new_cache(0, 0)
        self.starts: list[int] = []  # each row's first slot (its prompt's first token)
        self.positions = torch.zeros(0, dtype=torch.long, device=model.device)  # RoPE position of each row's next token
        self.tokens = torch.zeros(0, dtype=torch.long, device=model.device)  # each row's last token, written next step
        self.generators: list[torch.Generator | None] = []  # per request, as vLLM seeds
        self.sampler = RowSampler([], [], model.device)
        self.changed = False  # a row finished or was dropped: the next step rebuilds the batch
        self.dropped: set[int] = set()  # ids of rows dropped since the last rebuild
        self.decoding_since: dict[int, float] = {}  # id(seq) -> when its prefill ended
        self.add(seqs)

    def add(self, seqs: list[Sequence]) -> None:
        """Queue requests to join at the next step; refuses all of them (before any work) if one does
        not fit the model's context."""
        for s in seqs:
            check_fits(self.model, len(s.prompt_ids), s.params.max_tokens)
        self.pending += seqs

    def drop(self, seq: Sequence) -> None:
        """Let a request go (an aborted stream); its row leaves at the next step."""
        if any(s is seq for s in self.pending):
            self.pending = [s for s in self.pending if s is not seq]
            return
        self.dropped.add(id(seq))
        self.changed = True
        self._settle([seq], device_time(self.model.device))

    def __iter__(self) -> FullDepthBatch:
        return self

    @torch.inference_mode()
    def __next__(self) -> None:
        """One step: newcomers are prefilled (their first token), the other rows decode one token."""
        joined = None
        if self.pending or self.changed or not self.seqs:
            joined = self._rebuild()
            if not self.seqs:
                raise StopIteration
        if joined is None:
            h = decode_step(self.model, self.cache, self.tokens, self.positions)
        else:  # the running rows decode through a view of theirs; the newcomers already wrote this slot
            running, n = len(self.tokens), self.cache.length
            h = joined
            if running:
                view = self.cache.row_view(slice(0, running))
                h = torch.cat([decode_step(self.model, view, self.tokens, self.positions[:running]), joined])
            self.cache.length = n + 1
        tokens = self.sampler(self.model.logits(h))
        finished = []
        for seq, token in zip(self.seqs, tokens.tolist()):
            seq.append(token)
            if seq.finished:
                finished.append(seq)
        self.tokens = tokens
        self.positions += 1
        if finished:
            self.changed = True
            self._settle(finished, device_time(self.model.device))

    def close(self) -> None:
        """Stopped early (the engine's abort): settle the stats of the rows still running."""
        self._settle([s for s in self.seqs if id(s) in self.decoding_since], device_time(self.model.device))

    def _settle(self, seqs: list[Sequence], now: float) -> None:
        for s in seqs:
            s.stats.decode_seconds = now - self.decoding_since.pop(id(s))
            s.stats.decode_tokens = max(len(s.output_ids) - 1, 0)  # the first token came from the prefill

    def _rebuild(self) -> torch.Tensor | None:
        """Regroup the rows for a change (see the class docstring): the running rows first, then the
        newcomers, prefilled; returns the newcomers' last hidden states (None without newcomers)."""
        model, old = self.model, self.cache
        keep = [i for i, s in enumerate(self.seqs) if not s.finished and id(s) not in self.dropped]
        new, self.pending, self.changed = self.pending, [], False
        self.dropped.clear()
        seqs = [self.seqs[i] for i in keep] + new
        self.seqs = seqs
        if not seqs:
            return None
        n = old.length
        # slots before `first` are read by no row: dropped, so a lone row starts at slot 0 and needs no mask
        first = min((self.starts[i] for i in keep), default=n)
        width = max((len(s.prompt_ids) for s in new), default=0)
        slot = max(n - first, width - 1)  # written this step: running rows' next token, newcomers' last prompt token
        shift = slot - (n - first)  # running rows move from `first` to `shift`
        left = [s.params.max_tokens - len(s.output_ids) for s in seqs]  # tokens each row may still produce
        self.cache = cache = model.new_cache(len(seqs), slot + max(left))
        cache.length = slot
        if keep:
            cache.load(old, keep, slice(first, n), 0, shift)
        joined = None
        if new:
            t0 = device_time(model.device)
            fresh = model.new_cache(len(new), width)
            joined = prefill(model, fresh, [s.prompt_ids for s in new])
            cache.load(fresh, slice(None), slice(0, width), len(keep), slot - width + 1)
            t1 = device_time(model.device)
            for s in new:
                s.stats.prefill_seconds = t1 - t0
                self.decoding_since[id(s)] = t1
        index = torch.tensor(keep, dtype=torch.long, device=model.device)
        self.starts = [self.starts[i] - first + shift for i in keep] + [slot - len(s.prompt_ids) + 1 for s in new]
        # a newcomer's position is its last prompt token's until the step's `+= 1`
        self.positions = torch.cat([self.positions[index],
                                    torch.tensor([len(s.prompt_ids) - 1 for s in new], dtype=torch.long,
                                                 device=model.device)])
        self.tokens = self.tokens[index]  # the newcomers' first tokens come from this step's sampling
        self.generators = [self.generators[i] for i in keep] + [s.params.make_generator(model.device) for s in new]
        self.sampler = RowSampler([s.params for s in seqs], self.generators, model.device)
        return joined


def decode_full_depth(model: Transformer, seqs: list[Sequence]) -> FullDepthBatch:
    """The engine's full-depth decoder for `seqs`: a batch that steps them and takes newcomers."""
    return FullDepthBatch(model, seqs)
