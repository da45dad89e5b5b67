"""Whether a step speculates: measured, per batch size, as the step's emitted tokens per second.

Extra draft rows are nearly free at batch 1 on a memory-bound machine and cost full price once the
batch makes the products compute-bound; where that happens depends on the model, the CPU and the
drafter (vLLM's `disable_by_batch_size` is a fixed number for this). The gate keeps, per batch size
(in powers of two), the recent throughput of steps with and without drafts (a decaying sum), plays
the better one and tries the other now and then. A step without drafts runs full depth's row and
choice (the drafter still sees the token), so the output does not depend on the choice (greedy stays full depth's tokens).

Extra rows only cost more as the batch grows, so where drafting lost at a smaller batch, a larger
batch seen for the first time starts without drafts and only explores them: warming drafts up first
cost what they lose (Qwen2.5-Coder-1.5B with its 0.5B draft model, 4 requests x 64 tokens: 0.73x of
full depth, drafts having lost alone already).
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


@dataclass
class Bucket:
    spec: Arm
    plain: Arm
    gap: int  # steps between two tries of the losing arm (doubles while it keeps losing)
    since: int = 0
    best: bool = True
    spec_warmup: int = 0  # steps with drafts played before comparing (0: drafts lost at a smaller batch)


class SpeculationGate:
    """warmup: steps each arm plays first at a new batch size (drafts first). Exploring costs what the
    losing arm costs (a draft model's step can cost several plain ones), so the gap between tries
    doubles, up to `max_gap`, while the same arm keeps winning, and shrinks back when the choice flips."""

    def __init__(self, explore: int = 8, max_gap: int = 64, decay: float = 0.9, warmup: tuple[int, int] = (4, 2)):
        self.explore, self.max_gap, self.decay, self.warmup = explore, max_gap, decay, warmup
        self.buckets: dict[int, Bucket] = {}
        self.current: Bucket | None = None
        self.on = True

    def begin_step(self, batch_size: int) -> bool:
        """Whether this step's requests draft."""
        key = max(batch_size, 1).bit_length()
        if key not in self.buckets:
            lost = self.lost_below(key)
            self.buckets[key] = Bucket(Arm(), Arm(), self.explore, best=not lost, spec_warmup=0 if lost else self.warmup[0])
        b = self.current = self.buckets[key]
        if b.spec.steps < b.spec_warmup or b.plain.steps < self.warmup[1]:
            self.on = b.spec.steps < b.spec_warmup
            return self.on
        best = b.spec.rate() >= b.plain.rate()
        if best != b.best:
            b.best, b.gap = best, self.explore
        b.since += 1
        if b.since >= b.gap:  # try the other arm
            b.since, b.gap = 0, min(2 * b.gap, self.max_gap)
            self.on = not best
        else:
            self.on = best
        return self.on

    def lost_below(self, key: int) -> bool:
        """Whether drafts lost at the largest smaller batch where both arms have played."""
        measured = [k for k, b in self.buckets.items() if k < key and b.spec.steps and b.plain.steps]
        if not measured:
            return False
        b = self.buckets[max(measured)]
        return b.spec.rate() < b.plain.rate()

    def end_step(self, tokens: int, seconds: float) -> None:
        """A step of only decoding requests emitted `tokens` in `seconds` (drafting included)."""
        (self.current.spec if self.on else self.current.plain).add(tokens, seconds, self.decay)
