"""Which requests of a step draft, and how many tokens, where a chain costs nothing to look up (n-gram).

A draft token is one more row of the step's forward: it costs what a row costs (b, from `StepCost`, a
line a + b * rows through recent decode steps), and it is accepted with a chance that `Acceptance`
counts per length of the matched suffix (session 35: 1-token matches accept 0.10 a row, 3-token
ones 0.65), from verified chains and from chains looked up but not drafted, checked against what the
request emitted next. An accepted token saves what it is worth later:
- its own row in a later step (b), always;
- a step's fixed cost (a), as far as it brings the batch's end closer: a B-th of a step for each
  token while requests wait (a slot comes free sooner); with nobody waiting, a whole step for the
  request the batch waits for (the most tokens left), times the chance that the others tied with it
  draft an accepted token too (all of them must move for the end to), and nothing for the others:
  their lead only moves their work earlier (a closed batch of 8 ran 7% slower drafting them).
A draft pays when chance * worth > b. So one request drafts what is likely enough, and a compute-
bound batch (b large against a) drafts little. Chains are looked up only where a draft may pay, so
that what was measured keeps being measured: after `EXPLORE` steps without a lookup one request's
chain is looked up anyway (a shadow), and after `PROBE` steps without a draft the likeliest chain
looked up drafts its first token (a row more, so the line's slope is measured where the batch is
now; one slow step once made it too steep for good). Drafters whose chains cost a forward are
switched by trying (gate.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from .gate import Line

EXPLORE = 16  # steps without a lookup before one request's chain is looked up anyway
PROBE = 64  # steps without a draft before the likeliest chain looked up drafts its first token


class Acceptance:
    """Decayed counts, per match length and draft position, of positions reached and accepted; a
    chance is (accepted + 1) / (reached + 2) (an unseen position: one half)."""

    def __init__(self, max_match: int, positions: int, decay: float = 0.998):
        self.decay = decay
        self.accepted = [[0.0] * positions for _ in range(max_match + 1)]
        self.seen = [[0.0] * positions for _ in range(max_match + 1)]

    def record(self, match: int, drafted: int, accepted: int) -> None:
        """A chain of `drafted` tokens from a `match`-token suffix had its first `accepted` accepted."""
        acc, seen = self.accepted[match], self.seen[match]
        for j in range(min(accepted + 1, drafted)):  # positions after the first rejection were not reached
            acc[j] = acc[j] * self.decay + (j < accepted)
            seen[j] = seen[j] * self.decay + 1

    def best_first(self, shortest: int) -> float:
        """The highest chance of a chain's first draft, over match lengths from `shortest` on."""
        return max((a[0] + 1) / (s[0] + 2) for a, s in zip(self.accepted[shortest:], self.seen[shortest:]))

    def chances(self, match: int, length: int) -> list[float]:
        """The chance that the first j + 1 drafts are all accepted, for j < length."""
        out, p = [], 1.0
        for a, s in zip(self.accepted[match][:length], self.seen[match][:length]):
            p *= (a + 1) / (s + 2)
            out.append(p)
        return out


class StepCost(Line):
    """seconds = a + b * rows, a least-squares line through decode steps, weighted towards recent ones
    (b unknown until their rows have varied)."""

    def __init__(self, decay: float = 0.99):
        super().__init__(decay)
        self.a = self.b = 0.0
        self.known = False

    def add(self, rows: int, seconds: float) -> None:
        super().add(rows, seconds)
        if self.spread() > 1e-3 * self.n * self.n:  # rows varied enough to see a slope
            self.b, self.known = self.slope(), True
        self.a = self.intercept(self.b)


@dataclass
class Shadow:
    """A chain a row looked up but did not draft, checked against the tokens the row emits next."""

    match: int
    tokens: list[int]
    checked: int = 0


class RowGate:
    """min_match, max_match: the drafter's shortest and longest suffix; positions: the most drafts a chain has."""

    def __init__(self, min_match: int, max_match: int, positions: int):
        self.min_match = min_match
        self.acceptance = Acceptance(max_match, positions)
        self.cost = StepCost()
        self.rows = 0  # this step's rows (its requests and their drafts)
        self.looked: dict[int, tuple[int, list[int]]] = {}  # this step's chains looked up (match length, tokens)
        self.since_look = self.since_draft = 0  # steps since a chain was looked up, and since one was drafted

    def choose(self, rooms: list[int], waiting: bool, look: Callable[[int], tuple[int, list[int]]]) -> list[list[int]]:
        """Each request's drafts, for the tokens each may still draft (`rooms`) and `look(i)`, its
        chain's (match length, tokens). Looked up (`looked`): every request while requests wait,
        else the tied requests with the most left until one has no chain, where a draft may pay;
        one of them now and then where none may. While a row's cost is not known yet, every chain
        looked up drafts whole."""
        a, b, known = self.cost.a, self.cost.b, self.cost.known
        best = self.acceptance.best_first(self.min_match)
        top = max(rooms, default=0)
        if waiting:
            candidates = [i for i, room in enumerate(rooms) if room > 0]
            pays = best * (b + a / len(rooms)) > b
        else:  # every tied request must move for the batch's end to: one without a chain stops the search
            candidates = [i for i, room in enumerate(rooms) if room == top and room > 0]
            pays = best * (b + a * best ** (len(candidates) - 1)) > b
        self.since_look, self.since_draft = self.since_look + 1, self.since_draft + 1
        shadow_only = known and not pays  # a chain now and then, so that a low reading can recover
        if shadow_only:
            explore = candidates and self.since_look > EXPLORE
            candidates = [candidates[self.since_look % len(candidates)]] if explore else []
        self.looked = {}
        for i in candidates:
            self.looked[i] = look(i)
            if not waiting and not self.looked[i][1]:
                break  # the batch's end cannot move this step: no share below pays
        chances = {i: self.acceptance.chances(match, len(ids)) for i, (match, ids) in self.looked.items()}
        shares = self.shares(chances, waiting, len(rooms))
        takes = {i: 0 if shadow_only else sum(1 for p in ch if p * (b + a * shares[i]) > b) if known else len(ch)
                 for i, ch in chances.items()}
        if known and not any(takes.values()) and self.since_draft > PROBE and any(chances.values()):
            takes[max(chances, key=lambda i: chances[i][0] if chances[i] else 0.0)] = 1  # a probe of a row's cost
        self.since_look = 0 if self.looked else self.since_look
        self.since_draft = 0 if any(takes.values()) else self.since_draft
        self.rows = len(rooms) + sum(takes.values())
        return [self.looked[i][1][: takes[i]] if takes.get(i) else [] for i in range(len(rooms))]

    @staticmethod
    def shares(chances: dict[int, list[float]], waiting: bool, batch: int) -> dict[int, float]:
        """The share of a step an accepted token of each request saves: a B-th while requests wait, else
        the chance that the other requests looked up move too."""
        if waiting:
            return {i: 1 / batch for i in chances}
        firsts = {i: ch[0] if ch else 0.0 for i, ch in chances.items()}
        together = math.prod(firsts.values())
        return {i: together / first if first else 0.0 for i, first in firsts.items()}

    def settle(self, shadow: Shadow) -> None:
        """A shadow whose request drafts before it is settled: what it checked was accepted."""
        self.acceptance.record(shadow.match, shadow.checked, shadow.checked)

    def follow(self, shadow: Shadow, emitted: list[int]) -> Shadow | None:
        """Checks a request's shadow chain against the tokens it emitted; None once it is settled."""
        for token in emitted:
            if shadow.tokens[shadow.checked] != token:
                break
            shadow.checked += 1
            if shadow.checked == len(shadow.tokens):
                break
        else:
            return shadow
        self.acceptance.record(shadow.match, len(shadow.tokens), shadow.checked)
        return None

    def end_step(self, seconds: float) -> None:
        self.cost.add(self.rows, seconds)
