"""How SpecEE early exit runs: the user's settings, checked on construction."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from .bank import PredictorBank
from .kv_policy import POLICY_CLASSES

KVPolicyName = Literal["skip", "propagate", "recompute"]
KV_POLICIES = tuple(POLICY_CLASSES)
LOSSLESS_KV_POLICY = "recompute"  # the one policy lossless mode runs: the carried rows are what verifies


@dataclass(frozen=True)
class EarlyExitConfig:
    """How early exit runs. `bank`/`draft` name files; the LLM resolves them.

    draft: a draft model directory, or "ngram" for the training-free prompt-lookup drafter.
    mode: "lossy" emits an exit layer's argmax where it exits (greedy there, whatever the sampling
    parameters); "lossless" checks each exited token against the full model (exact, sampled too).
    bank: a predictor bank directory; None calibrates one (and caches it) on first use.
    max_pending: most carried rows (recompute) or unverified positions (lossless) before a
    forced full-depth step; threshold_scale multiplies the bank's thresholds' distance from 1
    (above 1 = lower thresholds, more exits; below 1 = fewer), for sweeps. num_draft_tokens:
    0 decodes one token per pass; N > 0 drafts N tokens with the same drafter and verifies them
    in the pass (speculative decoding with exits; `LLM` sets it from `speculative_config`).
    check_cost: a predictor check's cost in target-layer equivalents (measured in the decode loop on
    CPU: 0.18-0.34 on SmolLM2-135M, 0.19-0.31 on Qwen2.5-Coder-1.5B, 0.41-0.51 on the reference
    model); a scheduled layer whose exits save less per check stops being checked
    (exit/scheduler.py ExitPayoff); 0 checks every scheduled layer.
    """

    draft: str | None = None
    bank: str | None = None
    k: int = 4
    kv_policy: KVPolicyName = "recompute"
    mode: Literal["lossy", "lossless"] = "lossy"
    offline_size: int | None = None
    online_window: int = 4
    online_radius: int = 1
    max_pending: int = 8
    threshold_scale: float = 1.0
    num_draft_tokens: int = 0
    check_cost: float = 0.2

    def __post_init__(self) -> None:
        for name in ("draft", "bank"):
            if not isinstance(getattr(self, name), (str, os.PathLike, type(None))):
                raise TypeError(f"{name} must be a path (str) or None, got {getattr(self, name)!r}")
        for name in ("threshold_scale", "check_cost"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise TypeError(f"{name} must be a number, got {value!r}")
        if self.kv_policy not in KV_POLICIES:
            raise ValueError(f"kv_policy must be one of {', '.join(KV_POLICIES)}, got {self.kv_policy!r}")
        if self.mode not in ("lossy", "lossless"):
            raise ValueError(f"mode must be 'lossy' or 'lossless', got {self.mode!r}")
        if self.mode == "lossless" and self.kv_policy != LOSSLESS_KV_POLICY:
            raise ValueError("lossless mode needs kv_policy='recompute' (the carried rows are what verifies)")
        for name, least in (("k", 1), ("max_pending", 1), ("online_window", 0), ("online_radius", 0),
                            ("num_draft_tokens", 0), ("offline_size", 0)):  # offline 0: online checks only
            value = getattr(self, name)
            if value is None and name == "offline_size":  # every layer the bank ranks
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        if not 0 < self.threshold_scale < float("inf"):
            raise ValueError(f"threshold_scale must be > 0 and finite, got {self.threshold_scale}")
        if not self.check_cost >= 0:
            raise ValueError(f"check_cost must be >= 0, got {self.check_cost}")

    def thresholds(self, bank: PredictorBank) -> list[float]:
        return [1.0 - (1.0 - t) * self.threshold_scale if t != float("inf") else t for t in bank.thresholds]
