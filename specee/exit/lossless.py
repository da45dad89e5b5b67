"""Lossless early exit: where an exited token is accepted or rolled back.

Under the recompute KV policy an exited token's row is carried into later steps until it
completes the last layer; the full model's prediction for the next position is then known.
Each emitted-but-unverified token is accepted (greedy: equal argmax; sampling: speculative
sampling's acceptance with the exit layer's distribution as the draft) or replaced, and
everything after a replaced token is rolled back: history, KV cache, carried rows, drafter,
exit schedule and exit histogram. Only verified tokens reach the Sequence, so only verified
text is streamed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..sampling import probabilities

if TYPE_CHECKING:
    from ..engine.early_exit import DecodeRun


@dataclass
class Unverified:
    """An emitted token not yet checked against the full model."""

    token: int
    exit_layer: int
    draft_probs: torch.Tensor | None  # the exit layer's distribution q (sampling only)


class LosslessVerifier:
    def __init__(self, run: DecodeRun):
        self.run = run
        self.unverified: list[Unverified] = []

    def hold(self, token: int, exit_layer: int, draft_probs: torch.Tensor | None) -> None:
        """An exited token, emitted but not yet checked against the full model."""
        self.unverified.append(Unverified(token, exit_layer, draft_probs))

    def verify(self, slots: list[int], final_logits: torch.Tensor, at_bound: bool) -> bool:
        """Check the unverified tokens that the completed rows at `slots` predicted (row at slot s
        predicts history[s + 1]); roll back at the first mismatch. Returns False if it rolled back
        or the request finished."""
        run = self.run
        for row, slot in enumerate(slots):
            pos = slot + 1
            assert pos == len(run.history) - len(self.unverified), "carried rows out of order"
            item = self.unverified[0]
            accepted, replacement = self.accept(final_logits[row:row + 1], item)
            if not accepted:
                run.stats.rollbacks_at_bound += at_bound
                self.rollback(pos, replacement)
                return False
            self.unverified.pop(0)
            run.stats.verified_positions += 1
            run.seq.append(item.token)
            if run.seq.finished:
                return False
        return True

    def accept(self, final_logits: torch.Tensor, item: Unverified) -> tuple[bool, int]:
        """Whether the full model keeps `item`; else the token it puts there instead."""
        params, generator = self.run.params, self.run.generator
        if params.greedy:
            best = int(final_logits.argmax(dim=-1))
            return best == item.token, best
        p = probabilities(final_logits, params)[0]
        q = item.draft_probs[0]
        ratio = (p[item.token] / q[item.token]).clamp(max=1.0)
        if float(torch.rand((), generator=generator, device=p.device)) < float(ratio):
            return True, item.token
        residual = (p - q).clamp(min=0)
        total = residual.sum()
        residual = p if float(total) <= 0 else residual / total
        return False, int(torch.multinomial(residual, 1, generator=generator))

    def rollback(self, pos: int, replacement: int) -> None:
        """history[pos] was wrong: drop it and everything after (they are all unverified), and the
        exit layers they added to the schedule and histogram; emit the full model's token."""
        run = self.run
        run.stats.rollbacks += 1
        run.stats.discarded_tokens += len(run.history) - pos
        for item in self.unverified:
            run.stats.exit_histogram[item.exit_layer] -= 1
        run.scheduler.forget_last(len(self.unverified))
        del run.history[pos:]
        self.unverified.clear()
        run.kv.truncate(pos)
        run.drafter.truncate(pos)
        run.emit(replacement, run.num_layers - 1)
