"""Lossless early exit: where an exited token is accepted or rolled back.

Under the recompute KV policy an exited token's row is carried into later steps until it
completes the last layer; the full model's prediction for the next position is then known.
Each emitted-but-unverified token is accepted (greedy: equal argmax; sampling: speculative
sampling's acceptance with the exit layer's distribution as the draft) or replaced, and
everything after a replaced token is rolled back: history, KV cache, carried rows, drafter,
exit schedule and exit histogram. Only verified tokens reach the Sequence, so only verified
text is streamed. `judge` runs on the device with the step's other verdicts (one host read for
the whole step); `settle` reads its result.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..sampling import SamplingParams, greedy, probabilities

if TYPE_CHECKING:
    from ..engine.early_exit import ExitState


@dataclass
class Unverified:
    """An emitted token not yet checked against the full model."""

    token: int
    exit_layer: int
    draft_probs: torch.Tensor | None  # the exit layer's distribution q (sampling only)


class LosslessVerifier:
    """One request's unverified tokens, oldest first."""

    def __init__(self, state: ExitState, num_layers: int, greedy: bool):
        self.state, self.num_layers, self.greedy = state, num_layers, greedy
        self.unverified: list[Unverified] = []

    def hold(self, token: int, exit_layer: int, draft_probs: torch.Tensor | None) -> None:
        """An exited token, emitted but not yet checked against the full model."""
        self.unverified.append(Unverified(token, exit_layer, draft_probs))

    def width(self, rows: int) -> int:
        """Verdict entries `judge` gives for `rows` completed rows."""
        return rows if self.greedy else 2 * rows

    def judge(self, final_logits: torch.Tensor, params: SamplingParams,
              generator: torch.Generator | None) -> torch.Tensor:
        """The full model's judgement of the unverified tokens that the completed carried rows
        predicted (row j: unverified[j]), on the device: greedy, its argmax per row; sampling,
        (accepted, the token it keeps or puts there instead) per row."""
        if self.greedy:
            return greedy(final_logits)
        out = []
        for row, item in zip(final_logits, self.unverified):
            p, q = probabilities(row[None], params)[0], item.draft_probs[0]
            ratio = (p[item.token] / q[item.token]).clamp(max=1.0)
            accepted = torch.rand((), generator=generator, device=p.device) < ratio
            residual = (p - q).clamp(min=0)
            total = residual.sum()
            residual = torch.where(total > 0, residual / total.clamp(min=1e-30), p)
            replacement = torch.multinomial(residual, 1, generator=generator)[0]
            out.append(torch.stack([accepted.long(), torch.where(accepted, item.token, replacement)]))
        return torch.cat(out)

    def settle(self, values: list[int], rows: int, at_bound: bool) -> tuple[list[int], bool]:
        """Read `judge`'s verdict for `rows` rows: the verified tokens, in order (a replaced one
        last), and whether all were kept (else everything after the replaced one is rolled back)."""
        st, kept = self.state, []
        for j in range(rows):
            item = self.unverified[0]
            best = values[j] if self.greedy else values[2 * j + 1]
            if best != item.token:
                st.stats.rollbacks_at_bound += at_bound
                self.rollback(best)
                return kept + [best], False
            self.unverified.pop(0)
            st.stats.verified_positions += 1
            kept.append(item.token)
        return kept, True

    def rollback(self, replacement: int) -> None:
        """The oldest unverified token was wrong: drop it and everything after (all unverified),
        and the exit layers they added to the schedule and histogram; the full model's token
        takes its place."""
        st = self.state
        pos = len(st.history) - len(self.unverified)
        st.stats.rollbacks += 1
        st.stats.discarded_tokens += len(st.history) - pos
        for item in self.unverified:
            st.stats.exit_histogram[item.exit_layer] -= 1
        st.scheduler.forget_last(len(self.unverified))
        del st.history[pos:]
        self.unverified.clear()
        st.kv.truncate(pos)
        st.drafter.truncate(pos)
        st.history.append(replacement)
        st.stats.exit_histogram[self.num_layers - 1] += 1
        st.scheduler.record(self.num_layers - 1)
