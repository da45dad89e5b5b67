"""Calibration data for the exit predictors: steps (a)-(c) of `exit_bank`'s procedure.

The target generates its own greedy continuations at full depth (batched), then a
teacher-forced pass over prompt + continuation runs the layers one by one and records, per
layer and decode position, the exit features of the drafter's proposals, the label (the
layer's logit-lens argmax equals the final one) and whether that argmax is a spec token.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from ..drafters.base import Drafter, frequency_shortlist
from ..engine.full_depth import decode_step, prefill, prefill_inputs
from ..engine.scheduler import check_fits
from ..exit.features import exit_features, spec_rows
from ..model.llama import Transformer
from ..progress import progress_bar
from .prompts import encode_prompt

if TYPE_CHECKING:
    from ..tokenizer import Tokenizer

DEFAULT_DRAFT_VOCAB_FRACTION = 0.25  # FR-Spec's shortlist: a quarter of the vocabulary, by frequency


@torch.inference_mode()
def _generate(model: Transformer, prompts: list[list[int]], batches: list[list[int]], max_new_tokens: int,
              eos_ids: frozenset[int], bar) -> list[list[int]]:
    """(a) Greedy continuations at full depth, one left-padded batch at a time."""
    out: list[list[int]] = [[] for _ in prompts]
    for batch in batches:
        rows = [prompts[i] for i in batch]
        cache = model.new_cache(len(rows), max(len(r) for r in rows) + max_new_tokens)
        positions = torch.tensor([len(r) for r in rows], device=model.device)
        h = prefill(model, cache, rows)
        done = [False] * len(rows)
        steps = 0
        while True:
            tokens = model.logits(h).argmax(dim=-1)
            for j, t in enumerate(tokens.tolist()):
                if not done[j]:
                    out[batch[j]].append(t)
                    done[j] = t in eos_ids or len(out[batch[j]]) >= max_new_tokens
            steps += 1
            bar.update(1)
            if all(done):
                break
            h = decode_step(model, cache, tokens, positions)
            positions += 1
        bar.update(max_new_tokens - steps)
    return out


@torch.inference_mode()
def _record(model: Transformer, drafter: Drafter, seqs: list[list[int]], starts: list[int],
            batches: list[list[int]], bar, lens_chunk: int = 2048) -> dict[str, torch.Tensor]:
    """(b, c) Teacher-forced, layer by layer: features [L, N, 3k], correct/in_spec [L, N], owner [N].

    Keeps every layer's hidden states at the decode positions (the inputs c_0 .. c_{m-2}, whose
    next tokens c_1 .. c_{m-1} the decode loop predicts; c_0 itself comes out of the full-depth
    prefill and never exits)."""
    L, H = model.cfg.num_layers, model.cfg.hidden_size
    dev = model.device
    feats, correct, in_spec, owner, final_tok, nxt = [], [], [], [], [], []
    for batch in batches:
        use = [i for i in batch if len(seqs[i]) - starts[i] >= 1]
        if not use:
            bar.update(1)
            continue
        inputs = [seqs[i][:-1] for i in use]
        W = max(len(x) for x in inputs)
        cache = model.new_cache(len(inputs), W)
        ids, step = prefill_inputs(model, cache, inputs)
        # rows whose next token is a decoded one: input indices start-1 .. len-2 of each sequence
        sel = torch.cat([r * W + (W - len(inputs[r])) + torch.arange(starts[i] - 1, len(seqs[i]) - 1, device=dev)
                         for r, i in enumerate(use)])
        spec = torch.cat([drafter.teacher_forced_top_k(seqs[i], starts[i]).to(dev) for i in use])  # [N, k]
        rows = spec_rows(model, spec)  # [N, k, H]
        h = model.embed(ids)
        h_prev = h.reshape(-1, H)[sel]
        f_b, top_b = [], []
        for l in range(L):
            h = model.layer(l, h, step, cache)
            h_sel = h.reshape(-1, H)[sel]
            f_b.append(exit_features(model, h_prev, h_sel, rows).float())
            normed = model.norm(h_sel)
            top_b.append(torch.cat([model.lm_head(c).argmax(-1) for c in normed.split(lens_chunk)]))
            h_prev = h_sel
        top = torch.stack(top_b)  # [L, N]
        feats.append(torch.stack(f_b))
        correct.append(top == top[-1:])
        in_spec.append((top.unsqueeze(-1) == spec.unsqueeze(0)).any(-1))
        owner.append(torch.cat([torch.full((len(seqs[i]) - starts[i],), i, dtype=torch.long) for i in use]))
        final_tok.append(top[-1].cpu())
        nxt.append(torch.tensor([t for i in use for t in seqs[i][starts[i]:]], dtype=torch.long))
        bar.update(1)
    return {"feats": torch.cat(feats, 1).cpu(), "correct": torch.cat(correct, 1).cpu(),
            "in_spec": torch.cat(in_spec, 1).cpu(), "owner": torch.cat(owner), "final": torch.cat(final_tok),
            "next": torch.cat(nxt)}


def _check_draft_vocab(drafter: Drafter, draft_vocab: int | None) -> None:
    if draft_vocab is None:
        return
    if draft_vocab < 0:
        raise ValueError(f"draft_vocab must be >= 0 (0 = the whole vocabulary), got {draft_vocab}")
    if draft_vocab and not drafter.scores_vocabulary:
        raise ValueError(f"draft_vocab={draft_vocab}: the drafter {drafter.name} does not score a vocabulary "
                         "(only a draft model's LM head can be restricted)")
    if drafter.scores_vocabulary and draft_vocab > drafter.vocab_limit:
        raise ValueError(f"draft_vocab={draft_vocab} exceeds the draft's vocabulary ({drafter.vocab_limit} tokens)")


@torch.inference_mode()
def record_calibration(model: Transformer, tokenizer: Tokenizer, drafter: Drafter,
                       prompts: list[str] | list[list[int]], *, max_new_tokens: int = 96, batch_size: int = 32,
                       chat: bool = False, max_prompt_tokens: int = 256,
                       eos_ids: set[int] | frozenset[int] | None = None, progress: bool = True,
                       draft_vocab: int | None = None) -> dict[str, Any]:
    """Steps (a)-(c): generate the target's greedy continuations, choose a draft model's
    vocabulary shortlist (see `calibrate`'s draft_vocab) and record, under it, per layer and
    decode position, the exit features, the label and whether the layer's argmax is a spec token.

    The drafter is left as it was found (its previous shortlist is restored): the bank carries
    the shortlist, and whoever decodes with the bank applies it. eos_ids: None = the config's
    eos ids plus the tokenizer's.
    Returns {"feats" [L, N, 3k], "correct" [L, N], "in_spec" [L, N], "owner" [N] (prompt index),
    "final" [N] (teacher-forced final argmax), "next" [N] (the generated token), "draft_vocab"
    (the shortlist, or None), ...}."""
    _check_draft_vocab(drafter, draft_vocab)
    if not prompts:
        raise ValueError("no calibration prompts")
    if eos_ids is None:
        eos_ids = set(model.cfg.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            eos_ids.add(tokenizer.eos_token_id)
    eos_ids = frozenset(eos_ids)

    enc = [encode_prompt(tokenizer, p, chat, max_prompt_tokens) for p in prompts]
    for i, ids in enumerate(enc):
        if not ids:
            raise ValueError(f"calibration prompt {i} encodes to no tokens")
        check_fits(model.cfg.context_limit, len(ids), max_new_tokens)
    order = sorted(range(len(enc)), key=lambda i: len(enc[i]))  # similar lengths batch together
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]

    # (a) the target's own greedy continuations
    t0 = time.perf_counter()
    with progress_bar(total=len(batches) * max_new_tokens, desc="calibrate: generate", unit="step",
                      enabled=progress) as bar:
        conts = _generate(model, enc, batches, max_new_tokens, eos_ids, bar)
    t1 = time.perf_counter()
    seqs = [p + c for p, c in zip(enc, conts)]
    starts = [len(p) + 1 for p in enc]  # first decoded position: predicts c_1 from input c_0
    if all(len(s) - st < 1 for s, st in zip(seqs, starts)):
        raise ValueError("calibration produced no decode positions (every continuation ended at once); "
                         "use more prompts or a larger max_new_tokens")

    # (b, c) teacher-forced layer-by-layer recording, with the drafter as it will decode
    shortlist = None
    previous = drafter.shortlist if drafter.scores_vocabulary else None
    if drafter.scores_vocabulary:
        limit = drafter.vocab_limit
        size = round(limit * DEFAULT_DRAFT_VOCAB_FRACTION) if draft_vocab is None else draft_vocab
        if 0 < size < limit:
            shortlist = frequency_shortlist(seqs, limit, max(size, drafter.k))
        drafter.restrict_vocab(shortlist)
    try:
        with progress_bar(total=len(batches), desc="calibrate: record layers", unit="batch", enabled=progress) as bar:
            rec = _record(model, drafter, seqs, starts, batches, bar)
    finally:
        if drafter.scores_vocabulary:
            drafter.restrict_vocab(previous)
    t2 = time.perf_counter()
    rec["seconds"] = {"generate": t1 - t0, "record": t2 - t1}
    rec["draft_vocab"] = shortlist
    rec["num_prompts"] = len(prompts)
    rec["max_new_tokens"] = max_new_tokens
    return rec
