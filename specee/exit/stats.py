"""What an early-exit decode counts: exit layers, predictor work, lossless verification."""
from __future__ import annotations

from dataclasses import dataclass, field


def mean_layers_run(histogram: list[int]) -> float | None:
    """Mean layers run per step from an exit histogram (entry i: steps that left after layer i)."""
    steps = sum(histogram)
    return sum((i + 1) * c for i, c in enumerate(histogram)) / steps if steps else None


@dataclass
class ExitStats:
    num_layers: int
    exit_histogram: list[int] = field(init=False)  # emitted tokens per layer left at (last = full; rolled-back ones removed)
    predictor_calls: int = 0
    exits_accepted: int = 0
    exits_rejected: int = 0  # predictor fired, but the layer's argmax was not a speculative token
    forced_full: int = 0
    drafter_seconds: float = 0.0
    predictor_seconds: float = 0.0
    verify_seconds: float = 0.0
    # lossless mode
    deep_passes: int = 0
    verified_positions: int = 0
    rollbacks: int = 0
    rollbacks_at_bound: int = 0  # found by a forced full-depth step (max_pending reached) or the final flush
    discarded_tokens: int = 0

    def __post_init__(self) -> None:
        self.exit_histogram = [0] * self.num_layers

    def as_dict(self, decode_seconds: float, lossless: bool) -> dict:
        steps = sum(self.exit_histogram)
        share = (lambda s: round(s / decode_seconds, 4) if decode_seconds > 0 else 0.0)
        d = {
            "decode_steps": steps,
            "mean_exit_layer": round(mean_layers_run(self.exit_histogram), 3) if steps else float(self.num_layers),
            "num_layers": self.num_layers,
            "exit_histogram": list(self.exit_histogram),
            "predictor_calls": self.predictor_calls,
            "predictor_layers_per_token": round(self.predictor_calls / steps, 3) if steps else 0.0,
            "exits_accepted": self.exits_accepted,
            "exits_rejected": self.exits_rejected,
            "forced_full_depth": self.forced_full,
            "time_share": {"drafter": share(self.drafter_seconds), "predictors": share(self.predictor_seconds),
                           "verification": share(self.verify_seconds)},
        }
        if lossless:
            d["lossless"] = {
                "deep_passes": self.deep_passes,  # full-depth passes that completed carried rows
                "verified_positions": self.verified_positions,
                "verified_per_deep_pass": round(self.verified_positions / max(self.deep_passes, 1), 3),
                "rollbacks": self.rollbacks,
                "rollbacks_at_bound": self.rollbacks_at_bound,
                "discarded_tokens": self.discarded_tokens,
            }
        return d
