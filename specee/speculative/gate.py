"""Whether a step speculates: measured, per batch size, as the step's emitted tokens per second.

Extra draft rows are nearly free at batch 1 on a memory-bound machine and cost full price once the
batch makes the products compute-bound; where that happens depends on the model, the CPU and the
drafter (vLLM's `disable_by_batch_size` is a fixed number for this). The gate keeps, per batch size
(in powers of two), the recent throughput of steps with and without drafts (a decaying sum), plays
the better one and tries the other every `explore` steps. A step without drafts is a chain of none: the same
verification, so the output does not depend on the choice (greedy stays full depth's tokens).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Arm:
    tokens: float = 0.0
    seconds: float = 0.0
    steps: int = 0

    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def add(self, tokens: int, seconds: float, decay: float) -> None:
        self.tokens = self.tokens * decay + tokens
        self.seconds = self.seconds * decay + seconds
        self.steps += 1


class SpeculationGate:
    """warmup: steps each arm plays first at a new batch size (drafts first: acceptance varies from
    step to step, and a few unlucky ones must not switch speculation off)."""

    def __init__(self, explore: int = 8, decay: float = 0.9, warmup: tuple[int, int] = (12, 4)):
        self.explore, self.decay, self.warmup = explore, decay, warmup
        self.arms: dict[tuple[int, bool], Arm] = {}
        self.steps = 0
        self.bucket, self.on = 0, True

    def begin_step(self, batch_size: int) -> bool:
        """Whether this step's requests draft."""
        self.steps += 1
        self.bucket = max(batch_size, 1).bit_length()
        spec, plain = (self.arms.setdefault((self.bucket, on), Arm()) for on in (True, False))
        if spec.steps < self.warmup[0] or plain.steps < self.warmup[1]:
            self.on = spec.steps < self.warmup[0]
            return self.on
        best = spec.rate() >= plain.rate()
        self.on = best if self.steps % self.explore else not best
        return self.on

    def end_step(self, tokens: int, seconds: float) -> None:
        """A step of only decoding requests emitted `tokens` in `seconds` (drafting included)."""
        self.arms[(self.bucket, self.on)].add(tokens, seconds, self.decay)
