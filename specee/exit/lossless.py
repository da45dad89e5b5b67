"""Lossless early exit: where an exited token is accepted or rolled back.

Under the recompute KV policy an exited token's row is carried into later steps until it
completes the last layer; the full model's prediction for the next position is then known.
Each emitted-but-unverified token is accepted where the full model's own choice at its position
equals it (greedy: the argmax; sampling: a draw from the full model's distribution p) and else
replaced by that choice, and everything after a replaced token is rolled back: history, KV cache,
carried rows, drafter, exit schedule and exit histogram. Only verified tokens reach the Sequence, so only verified
text is streamed. `judge` runs on the device with the step's other verdicts (one host read for
the whole step); `settle` reads its result.

Why a draw, not speculative sampling's ratio test: an exited token is the exit layer's argmax, not a
draw from the exit layer's distribution q, so it is a point-mass draft. Accepting it with probability
min(1, p/q) held it ~3x too often (0.966 against p = 0.317 on a tiny model); a draw y ~ p kept when
y equals it, else emitted in its place, emits exactly p (speculative sampling's point-mass case, as
`verify_chain` does for n-gram drafts).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..sampling import SamplingParams, sample

if TYPE_CHECKING:
    from ..engine.early_exit import ExitState


@dataclass
class Unverified:
    """An emitted token not yet checked against the full model."""

    token: int
    exit_layer: int


class LosslessVerifier:
    """One request's unverified tokens, oldest first."""

    def __init__(self, state: ExitState, num_layers: int):
        self.state, self.num_layers = state, num_layers
        self.unverified: list[Unverified] = []

    def hold(self, token: int, exit_layer: int) -> None:
        """An exited token, emitted but not yet checked against the full model."""
        self.unverified.append(Unverified(token, exit_layer))

    def judge(self, final_logits: torch.Tensor, params: SamplingParams,
              generator: torch.Generator | None) -> torch.Tensor:
        """The full model's choice at each position the completed carried rows predict (row j:
        unverified[j]), on the device: its argmax, or its draw from p when sampling."""
        return sample(final_logits, params, generator)

    def settle(self, values: list[int], rows: int, at_bound: bool) -> tuple[list[int], bool]:
        """Read `judge`'s verdict for `rows` rows: the verified tokens, in order (a replaced one
        last), and whether all were kept (else everything after the replaced one is rolled back)."""
        st, kept = self.state, []
        for best in values[:rows]:
            item = self.unverified[0]
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
