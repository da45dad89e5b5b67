"""Whether a step speculates: measured, per batch size, as the step's emitted tokens per second
(for drafters whose chains cost a forward, a draft model's or the EAGLE head's; n-gram chains are
lookups, drafted request by request where they pay: row_gate.py).

Extra draft rows are nearly free at batch 1 on a memory-bound machine and cost full price once the
batch makes the products compute-bound; where that happens depends on the model, the CPU and the
drafter (vLLM's `disable_by_batch_size` is a fixed number for this). The gate keeps, per batch size
(in powers of two), the recent throughput of steps with and without drafts, plays the better one
and tries the other now and then. A step without drafts runs full depth's row and choice (the
drafter still sees the token), so the output does not depend on the choice (greedy stays full
depth's tokens).

Trying drafts again is what costs, so each rule below makes tries cheaper or rarer (the
measurements behind each: BENCHMARKS.md, session 40, "The speculation gate's rules"):
- what switching costs is not what drafting does: the first drafting step after plain ones, and
  one whose draft model first catches up on more than a token a request (a new prompt), are not
  measured; a try lasts until one step is, or until its TRY_STEPS-th drafting step;
- the gap between tries doubles while the same arm wins, up to `max_gap` (up to `longest_gap` while
  drafts lose by more than `margin`: a wide loss seldom turns), and is at least what keeps a losing
  try's excess time under `explore_share` of the steps between tries;
- a batch size seen for the first time after a smaller one was measured starts without drafts, and
  tries them after `explore` steps where they won there by `margin`, else after `max_gap` (extra rows
  only cost more as the batch grows); one whose drafts-first warm-up was cut short starts over;
- a try's measurement replaces the losing arm's (one slow step must not keep an arm losing), and an
  arm that a try made best and that loses again within `explore` steps was a lucky step: the old arm
  comes back with the gap it had earned;
- a try that would first catch a draft model up waits until that catch-up (`CatchUpCost`: pending
  tokens times seconds a token) is within `explore_share` of the plain steps since the last try.
"""
from __future__ import annotations

from dataclasses import dataclass

TRY_STEPS = 3  # the drafting step of a try that is measured even if its drafters caught up first


@dataclass
class Arm:
    tokens: float = 0.0
    seconds: float = 0.0
    weight: float = 0.0  # decayed count of steps
    steps: int = 0

    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def add(self, tokens: int, seconds: float, decay: float) -> None:
        self.tokens = self.tokens * decay + tokens
        self.seconds = self.seconds * decay + seconds
        self.weight = self.weight * decay + 1
        self.steps += 1


@dataclass
class Line:
    """A least-squares line y = a + b * x through points weighted decay^age (decay 1: all alike)."""

    decay: float = 1.0
    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self.n, self.sx, self.sy = self.n * d + 1, self.sx * d + x, self.sy * d + y
        self.sxx, self.sxy = self.sxx * d + x * x, self.sxy * d + x * y

    def spread(self) -> float:
        """n^2 times the points' variance in x: 0 where they all have one x."""
        return self.n * self.sxx - self.sx * self.sx

    def slope(self) -> float:
        """b, at least 0 (call where `spread` is positive)."""
        return max(0.0, (self.n * self.sxy - self.sx * self.sy) / self.spread())

    def intercept(self, slope: float) -> float:
        """a for slope b, at least 0."""
        return max(0.0, (self.sy - slope * self.sx) / self.n)


class CatchUpCost(Line):
    """Seconds a drafting step spends per pending token (a token of the history a draft model has not
    run: a new request's prompt, or everything emitted while the batch did not draft): the slope of
    a least-squares line through every drafting step's (pending tokens, drafting seconds). Unknown (0)
    until the steps differ in pending tokens."""

    def per_token(self) -> float:
        return self.slope() if self.spread() > 1e-9 * self.n * self.sxx else 0.0


@dataclass
class Bucket:
    spec: Arm
    plain: Arm
    gap: int  # steps between two tries of the losing arm
    since: int = 0
    best: bool = True
    spec_warmup: int = 0  # measured steps with drafts before comparing (0: a smaller batch was measured)
    trying: bool = False  # playing the losing arm until it has one measured step
    earned_gap: int = 0  # the gap the arm best before a try's switch had earned (0: none to restore)
    spell: int = 0  # steps since the last switch
    tried_tokens: int = 0  # what the current try of drafts emitted, and in how long (measured or not)
    tried_seconds: float = 0.0
    tried_steps: int = 0  # drafting steps of the current try


class SpeculationGate:
    """warmup: measured steps each arm plays first at a new batch size (drafts first)."""

    def __init__(self, explore: int = 8, max_gap: int = 64, decay: float = 0.9, warmup: tuple[int, int] = (4, 2),
                 explore_share: float = 0.05, longest_gap: int = 1024, margin: float = 1.25):
        self.explore, self.max_gap, self.decay, self.warmup = explore, max_gap, decay, warmup
        self.explore_share, self.longest_gap, self.margin = explore_share, longest_gap, margin
        self.buckets: dict[int, Bucket] = {}
        self.current: Bucket | None = None
        self.on = True
        self.drafted_last = True  # whether the step before drafted (a draft model is then caught up)
        self.catch_up_tokens = 0  # what this step's drafters run beyond one token a request (a catch-up)
        self.catch_up = CatchUpCost()

    def begin_step(self, batch_size: int, pending: int = 0) -> bool:
        """Whether this step's requests draft; pending: the tokens their drafters would run before
        drafting (`Drafter.pending`)."""
        self.catch_up_tokens = max(pending - batch_size, 0)
        key = max(batch_size, 1).bit_length()
        if key not in self.buckets or self.warmup_cut_short(key):
            below = self.measured_below(key)
            won = below is None or below.spec.rate() >= self.margin * below.plain.rate()
            self.buckets[key] = Bucket(Arm(), Arm(), self.explore if won else max(below.gap, self.max_gap),
                                       best=below is None, spec_warmup=self.warmup[0] if below is None else 0)
        b = self.current = self.buckets[key]
        if b.spec.steps < b.spec_warmup or b.plain.steps < self.warmup[1]:
            self.on = b.spec.steps < b.spec_warmup
            return self.on
        if b.trying:
            self.on = not b.best
            return self.on
        best = b.spec.rate() >= b.plain.rate()
        b.spell += 1
        if best != b.best:  # a switch
            if b.earned_gap and b.spell <= self.explore:  # back a few steps after a try's switch: it was lucky
                b.gap, b.earned_gap, b.since = b.earned_gap, 0, 0
            else:  # a try's measurement just made this switch (since 0): keep the gap, in case it was lucky
                b.gap, b.earned_gap = self.explore, b.gap if b.since == 0 else 0
            b.best, b.spell = best, 0
        b.since += 1
        b.trying = b.since >= b.gap and (best or self.switch_fits(b))
        self.on = best != b.trying
        return self.on

    def switch_fits(self, b: Bucket) -> bool:
        """Whether switching drafts on now costs a catch-up within `explore_share` of the plain steps
        since the last try."""
        if self.drafted_last:
            return True
        catch_up = self.catch_up.per_token() * self.catch_up_tokens
        return catch_up <= self.explore_share * b.since * b.plain.seconds / b.plain.weight

    def drafted(self, pending: int, seconds: float) -> None:
        """A step's drafting ran `pending` tokens first and took `seconds` in all."""
        self.catch_up.add(pending, seconds)

    def warmup_cut_short(self, key: int) -> bool:
        """Whether this batch size's drafts-first warm-up would resume after plain steps (a catch-up)
        although a smaller batch has been measured since."""
        b = self.buckets[key]
        return b.spec.steps < b.spec_warmup and not self.drafted_last and self.measured_below(key) is not None

    def measured_below(self, key: int) -> Bucket | None:
        """The largest smaller batch where both arms have been measured."""
        measured = [k for k, b in self.buckets.items() if k < key and b.spec.steps and b.plain.steps]
        return self.buckets[max(measured)] if measured else None

    def end_step(self, tokens: int, seconds: float) -> None:
        """A step of only decoding requests emitted `tokens` in `seconds` (drafting included)."""
        b, catching_up = self.current, self.on and (not self.drafted_last or self.catch_up_tokens > 0)
        self.drafted_last = self.on
        if b.trying and self.on:
            b.tried_tokens, b.tried_seconds = b.tried_tokens + tokens, b.tried_seconds + seconds
            b.tried_steps += 1
        if catching_up and b.tried_steps < TRY_STEPS:  # what switching or a new request costs, not what drafting does
            return
        (b.spec if self.on else b.plain).add(tokens, seconds, 0.0 if b.trying else self.decay)
        if b.trying:
            self.tried(b)

    def tried(self, b: Bucket) -> None:
        """A try is over: the gap to the next one doubles (past `max_gap` while drafts lose by more
        than `margin`), and where drafts lost, also keeps the try's excess time (over what plain steps
        take for its tokens) within `explore_share` of the gap."""
        b.trying, b.since = False, 0
        drafts_lost_widely = not b.best and self.margin * b.spec.rate() < b.plain.rate()
        gap = min(2 * b.gap, self.longest_gap if drafts_lost_widely else self.max_gap)
        if b.tried_tokens and b.plain.tokens and b.spec.rate() < b.plain.rate():
            plain_step = b.plain.seconds / b.plain.weight
            excess = b.tried_seconds - b.tried_tokens / b.plain.rate()
            gap = max(gap, round(excess / plain_step / self.explore_share))
        b.gap = min(gap, self.longest_gap)
        b.tried_tokens, b.tried_seconds, b.tried_steps = 0, 0.0, 0
