"""Two-level predictor scheduling: which layers run an exit predictor for the next pass.

Offline level: a fixed set chosen at calibration from where exits first become correct
(the exit-layer distribution is skewed). Online level: the layers around the exit layers
of the last few tokens (neighbouring tokens exit at similar depths). A predictor only runs
where its layer has a finite threshold, never on the last layer (nothing to skip), and only
while it pays (`ExitPayoff`): a check costs a fraction of a layer, so a layer whose exits
save less than that per check is not checked.
"""
from __future__ import annotations

import math

RETRY_AFTER = 64  # passes before a layer that stopped paying is checked again


class ExitPayoff:
    """Per layer: the layers its predictor saved per check lately (a moving average over about
    16 checks: exits x layers skipped), against a check's cost in target-layer equivalents.
    Starts from calibration's one-token exit rates (`prior`), so it is derived from data twice:
    the bank's, then this engine's own passes (a verification pass settles less often than one
    token). A layer that stops paying is retried after RETRY_AFTER passes. cost 0: always pays."""

    def __init__(self, num_layers: int, cost: float, prior: list[float] | None = None, rate: float = 1 / 16):
        self.num_layers, self.cost, self.rate = num_layers, cost, rate
        self.saving = list(prior) if prior is not None else [2 * cost] * num_layers
        self.paying = [s >= cost for s in self.saving]
        self.retry_at = [0 if p else RETRY_AFTER for p in self.paying]
        self.next_retry = min((r for r, p in zip(self.retry_at, self.paying) if not p), default=math.inf)
        self.passes = 0

    @staticmethod
    def prior_from(summary: dict, num_layers: int) -> list[float] | None:
        """Layers saved per check at each layer from a bank's calibration summary (first exits
        there x layers skipped), or None when the bank does not say."""
        dist = (summary or {}).get("exit_distribution")
        if not dist or len(dist) != num_layers or not sum(dist):
            return None
        total = sum(dist)
        return [dist[i] / total * (num_layers - 1 - i) for i in range(num_layers)]

    def observe(self, layer: int, exited: bool) -> bool:
        """A check at `layer` ended; returns True when the layer stopped paying."""
        if not self.cost:
            return False
        gain = self.num_layers - 1 - layer if exited else 0
        self.saving[layer] += self.rate * (gain - self.saving[layer])
        if self.paying[layer] and self.saving[layer] < self.cost:
            self.paying[layer], self.retry_at[layer] = False, self.passes + RETRY_AFTER
            self.next_retry = min(self.next_retry, self.retry_at[layer])
            return True
        return False

    def tick(self) -> bool:
        """A pass begins; returns True when a layer is due for a retry (it pays again until checked)."""
        self.passes += 1
        if self.passes < self.next_retry:  # the common case: nothing is due
            return False
        for i, paying in enumerate(self.paying):
            if not paying and self.retry_at[i] <= self.passes:
                self.paying[i], self.saving[i] = True, self.cost
        self.next_retry = min((r for r, p in zip(self.retry_at, self.paying) if not p), default=math.inf)
        return True


class TwoLevelScheduler:
    def __init__(self, num_layers: int, offline_layers: list[int], thresholds: list[float],
                 online_window: int = 4, online_radius: int = 1, payoff: ExitPayoff | None = None):
        if online_window < 0 or online_radius < 0:
            raise ValueError("online_window and online_radius must be >= 0")
        self.num_layers = num_layers
        self.usable = [i < num_layers - 1 and math.isfinite(t) for i, t in enumerate(thresholds)]
        self.offline = [False] * num_layers
        for layer in offline_layers:
            if not 0 <= layer < num_layers:
                raise ValueError(f"offline layer {layer} outside 0..{num_layers - 1}")
            self.offline[layer] = self.usable[layer]
        self.radius, self.window = online_radius, online_window
        self.payoff = payoff or ExitPayoff(num_layers, 0.0)
        self.exits: list[int] = []  # exit layer of every token so far (a rollback forgets some)
        self._update()

    @property
    def offline_layers(self) -> list[int]:
        return [i for i, on in enumerate(self.offline) if on]

    def online_layers(self) -> list[int]:
        recent = self.exits[-self.window:] if self.window else []
        return sorted({j for e in recent for j in range(e - self.radius, e + self.radius + 1)
                       if 0 <= j < self.num_layers and self.usable[j]})

    def layers(self) -> list[bool]:
        """Per layer: run the predictor there in the next pass (recomputed only when something changed)."""
        if self.payoff.tick():
            self._update()
        return self._mask

    def observe(self, layer: int, exited: bool) -> None:
        """A predictor check at `layer` ended, with an exit or not."""
        if self.payoff.observe(layer, exited):
            self._update()

    def record(self, exit_layer: int) -> None:
        """The layer the last token left at (num_layers - 1 for a full-depth token)."""
        self.exits.append(exit_layer)
        if self.window:
            self._update()

    def forget_last(self, count: int) -> None:
        """Drop the last `count` tokens' exit layers (a lossless rollback discarded them)."""
        if count:
            del self.exits[-count:]
            self._update()

    def _update(self) -> None:
        mask = list(self.offline)
        for j in self.online_layers():
            mask[j] = True
        self._mask = [on and paying for on, paying in zip(mask, self.payoff.paying)]
