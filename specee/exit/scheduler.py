"""Two-level predictor scheduling: which layers run an exit predictor for the next token.

Offline level: a fixed set chosen at calibration from where exits first become correct
(the exit-layer distribution is skewed). Online level: the layers around the exit layers
of the last few tokens (neighbouring tokens exit at similar depths). A predictor only runs
where its layer has a finite threshold, and never on the last layer (nothing to skip).
"""
from __future__ import annotations

import math

class TwoLevelScheduler:
    def __init__(self, num_layers: int, offline_layers: list[int], thresholds: list[float],
                 online_window: int = 4, online_radius: int = 1):
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
        self.exits: list[int] = []  # exit layer of every token so far (a rollback forgets some)
        self._mask = list(self.offline)

    @property
    def offline_layers(self) -> list[int]:
        return [i for i, on in enumerate(self.offline) if on]

    def online_layers(self) -> list[int]:
        recent = self.exits[-self.window:] if self.window else []
        return sorted({j for e in recent for j in range(e - self.radius, e + self.radius + 1)
                       if 0 <= j < self.num_layers and self.usable[j]})

    def layers(self) -> list[bool]:
        """Per layer: run the predictor there for the next token (recomputed only when history changes)."""
        return self._mask

    def record(self, exit_layer: int) -> None:
        """The layer the last token left at (num_layers - 1 for a full-depth token)."""
        self.exits.append(exit_layer)
        self._update()

    def forget_last(self, count: int) -> None:
        """Drop the last `count` tokens' exit layers (a lossless rollback discarded them)."""
        if count:
            del self.exits[-count:]
            self._update()

    def _update(self) -> None:
        if not self.window:
            return
        mask = list(self.offline)
        for j in self.online_layers():
            mask[j] = True
        self._mask = mask
