"""Whether a step speculates: measured, per batch size, as the step's emitted tokens per second.

Extra draft rows are nearly free at batch 1 on a memory-bound machine and cost full price once the
batch makes the products compute-bound; where that happens depends on the model, the CPU and the
drafter (vLLM's `disable_by_batch_size` is a fixed number for this). The gate keeps, per batch size
(in powers of two), the recent throughput of steps with and without drafts, plays the better one
and tries the other now and then. A step without drafts runs full depth's row and choice (the
drafter still sees the token), so the output does not depend on the choice (greedy stays full
depth's tokens).

Trying drafts again is what costs (Qwen2.5-Coder-1.5B with its 0.5B draft model, 4 requests x 64
tokens: 0.63x of full depth's decode with drafts explored twice after losing alone), so:
- a draft model first catches up on every token it skipped: the first drafting step after plain
  ones is not measured (it says what switching costs, not what drafting does), nor is one whose
  drafters run more than a token a request first (a new request's prompt: on an Intel Xeon the Qwen
  pair's first drafting step of a request took 150-190 ms, later ones 100-105, plain ones 45, and
  charging it to drafting lost 2 of 5 requests' drafts), and a try lasts until one step is, or until
  its TRY_STEPS-th drafting step, measured whatever it caught up. (After a fully accepted chain a
  draft model runs 2 tokens a request first: at 4 Qwen requests every step of a try counted as a
  catch-up, and the try ran on for 20 steps at 0.66x of plain steps' rate. Measuring all such
  steady steps instead cost one request 5-10%: its drafting spells broke up.) An
  n-gram drafter has nothing to catch up on, but measuring its first step too (a one-step try) lost
  on two AMD EPYCs: n-gram / full depth at 8 SmolLM2 requests 0.86-0.96x against 0.92-1.14x with
  two-step tries (cheaper tries come more often, and one lucky step flips the arm);
- the gap between tries doubles while the same arm wins, up to `max_gap`, and is at least what
  keeps a losing try's excess time under `explore_share` of the steps between tries. While drafts
  lose by more than `margin` it keeps doubling (up to `longest_gap`): a wide loss seldom turns, and
  tries every `max_gap` steps cost 8 SmolLM2 requests about 3.5% of their decode speed (n-gram
  drafts ran 0.6-0.7x of plain steps there; held off, the speculative path ran as fast as full depth);
- a larger batch seen for the first time starts without drafts once a smaller one has been
  measured, and tries them after `explore` steps where they won there by `margin`, else after
  `max_gap` steps at least (extra rows only cost more as the batch grows, so a narrow win turns
  into a loss). Drafts first would cost more: a draft model's first step over 4 new requests
  prefills their prompts too (430-460 ms against 28 ms for a plain step, Qwen pair, where drafts
  won alone by 0-5%), and one plain step too many costs one step's gain;
- a batch size whose warm-up with drafts was cut short (a 2-request warm-up call of 8 tokens) and
  comes back after plain steps starts over as a new one: resuming its drafts first cost the Qwen
  pair a catch-up of 3 requests (260 ms of a 6.2 s run) as a 4-request batch shrank;
- a try's measurement replaces the losing arm's (one step slowed by anything else kept its arm
  losing for the rest of a run while newer tries only nudged a decaying sum);
- an arm that a try made best and that loses again within `explore` steps was one lucky step, not a
  turn: the old arm comes back with the gap it had earned, not `explore` (8 SmolLM2 requests on
  an Intel Xeon: a lucky n-gram try, 24 tokens in 34 ms against plain steps' 8 in 12.5, set off tries
  every 8-16 steps; n-gram against full depth in paired steps went from 0.940-0.959x to 0.968-0.984x.
  A window of the whole earned gap also caught drafts' own turns: Qwen's n-gram alone 1.01x, not 1.06x);
- a try of drafts that would first catch a draft model up waits until its expected catch-up (the
  tokens pending times the seconds per token the drafter's steps have shown, `CatchUpCost`) is within
  `explore_share` of the plain steps since the last try: the first try at 4 new Qwen requests caught
  the 0.5B draft model up on their prompts in 719-805 ms, 13-15 plain steps, and the 64-token
  requests never repaid it (0.83x of full depth). A drafter that skips nothing (n-gram, EAGLE) pends
  no tokens and tries as before.
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
class CatchUpCost:
    """Seconds a drafting step spends per pending token (a token of the history a draft model has not
    run: a new request's prompt, or everything emitted while the batch did not draft): the slope of
    a least-squares line through every drafting step's (pending tokens, drafting seconds). Unknown (0)
    until the steps differ in pending tokens."""

    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def add(self, pending: int, seconds: float) -> None:
        self.n, self.sx, self.sy = self.n + 1, self.sx + pending, self.sy + seconds
        self.sxx, self.sxy = self.sxx + pending * pending, self.sxy + pending * seconds

    def per_token(self) -> float:
        spread = self.n * self.sxx - self.sx * self.sx
        if spread <= 1e-9 * self.n * self.sxx:
            return 0.0
        return max(0.0, (self.n * self.sxy - self.sx * self.sy) / spread)


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
