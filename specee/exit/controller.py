"""Where a token exits: SpecEE's decision after a decoder layer.

At a scheduled layer the predictor reads the k speculative tokens' features (exit/features.py)
and fires when its probability is over the layer's threshold: one device read. When it fires,
one full LM head at that layer gives the argmax, and the token exits only if that argmax is
among the speculative tokens; membership and the token come back in a second single read.
The decode loop asks `try_exit` after each layer and stops at the first hit.

Tests inject `ForcedExits` (a rule of (token index, layer)) instead of the predictors, so the
hot loop holds no test hooks.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..clock import StageTimer
from ..model.llama import Transformer
from .bank import PredictorBank
from .features import exit_features, spec_rows
from .scheduler import TwoLevelScheduler


@dataclass
class ExitHit:
    layer: int
    token: int  # the layer's argmax (one of the speculative tokens)
    ids: torch.Tensor  # the same, [1], on the device: the next step's input without a host-to-device copy
    logits: torch.Tensor  # [1, V] at that layer: the draft distribution for sampling and lossless


class ExitController:
    """Runs the predictors of the scheduled layers and confirms a firing one with the LM head."""

    def __init__(self, model: Transformer, bank: PredictorBank, thresholds: list[float]):
        self.model, self.bank = model, bank.to(model.device, torch.float32)  # trained and thresholded in float32
        self.thresholds = thresholds
        self.spec = self.rows = None
        self.predictor_calls = self.rejected = 0
        self.timer = StageTimer(model.device)  # "predictors" and "verification" (the LM head of a firing layer)

    def layers(self, scheduler: TwoLevelScheduler) -> list[bool]:
        """Per layer: whether to ask `try_exit` after it for this token."""
        return scheduler.layers()

    def begin_token(self, spec: torch.Tensor, token_index: int) -> None:
        """spec: the drafter's k proposals [k] (device); gathers their LM-head rows once per token."""
        self.spec, self.rows = spec, spec_rows(self.model, spec)

    def fires(self, layer: int, h_in: torch.Tensor, h: torch.Tensor) -> bool:
        """The predictor of `layer` on its input h_in and output h ([1, H]): one device read."""
        feats = exit_features(self.model, h_in, h, self.rows)
        return bool(self.bank.prob(layer, feats) > self.thresholds[layer])

    def try_exit(self, layer: int, h_in: torch.Tensor, h: torch.Tensor) -> ExitHit | None:
        """Whether the token leaves after `layer` (h_in, h: that layer's input and output, [1, H])."""
        t = self.timer.start()
        self.predictor_calls += 1
        fire = self.fires(layer, h_in, h)
        self.timer.stop("predictors", t)
        if not fire:
            return None
        t = self.timer.start()
        logits = self.model.logits(h)
        choice = logits.argmax(dim=-1)
        among, token = torch.stack([(self.spec == choice).any().long(), choice[0]]).tolist()  # one read
        self.timer.stop("verification", t)
        if not among:
            self.rejected += 1
            return None
        return ExitHit(layer, token, choice, logits)


class ForcedExits(ExitController):
    """Exits decided by `rule(token_index, layer)` instead of the predictors (asked at every layer
    but the last, whatever the schedule); the argmax must still be a speculative token."""

    def __init__(self, model: Transformer, bank: PredictorBank, thresholds: list[float],
                 rule: Callable[[int, int], bool]):
        super().__init__(model, bank, thresholds)
        self.rule, self.token_index = rule, 0
        self.every_layer = [True] * (model.cfg.num_layers - 1) + [False]

    def layers(self, scheduler: TwoLevelScheduler) -> list[bool]:
        return self.every_layer

    def begin_token(self, spec: torch.Tensor, token_index: int) -> None:
        super().begin_token(spec, token_index)
        self.token_index = token_index

    def fires(self, layer: int, h_in: torch.Tensor, h: torch.Tensor) -> bool:
        return self.rule(self.token_index, layer)
