"""Where a token exits: SpecEE's decision after a decoder layer, for the rows of one pass.

A pass feeds rows [x_n, d_1..d_m]: the last committed token and m draft tokens (m = 0 in
one-token early exit). Row j's output predicts position n+j+1; its speculative tokens are
the drafter's top-k there (`Drafter.row_candidates`). At a scheduled layer:

  1. the predictors read every row's features (exit/features.py) in one batch: fire[j];
  2. each row's choice at this layer is its best speculative token; the drafts the choices
     agree with give the layer's tentative acceptance a (verify.accept_chain);
  3. the pass settles when every row that can still be accepted (rows 0..a: a row past the
     first disagreement is built on a draft this layer already rejects) has fired, here or at
     an earlier checked layer of this pass (rows settle at different depths, as tokens do).
     Steps 1-3 end in one device read (settled, a), shared with every request checked after this layer;
  4. a settled pass pays the full LM head for rows 0..a at this layer (it replaces the final
     one) and exits only if each row's argmax, up to the acceptance the argmaxes give, is one
     of its speculative tokens: a second (shared) read, which also returns the accepted tokens. If not,
     the predictors were wrong: every row is unsettled again.

Why the one-token bank serves: a row matters only if every draft before it is accepted, and
then its history equals the target's own continuation, which is what calibration recorded, so
its features are the one-token features at that position (tested). Its exits are measured to
be less precise than one token's (BENCHMARKS.md), and thresholds for passes are not calibrated.

Tests inject `ForcedExits` (a rule of (token index, layer)) instead of the predictors, so the
hot loop holds no test hooks.
"""
from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch

from ..clock import StageTimer
from ..model.llama import Transformer
from ..speculative.verify import accept_chain
from .bank import PredictorBank
from .features import exit_features, spec_rows
from .scheduler import TwoLevelScheduler


@dataclass
class ExitHit:
    layer: int
    tokens: list[int]  # what the pass emits (greedy): the accepted drafts, then the layer's own choice
    logits: torch.Tensor  # [len(tokens), V] at that layer: the distributions for sampling and lossless


class ExitController:
    """Runs the predictors of the scheduled layers over a pass's rows and confirms a settled pass
    with the LM head."""

    def __init__(self, model: Transformer, bank: PredictorBank, thresholds: list[float]):
        self.model, self.bank = model, bank.to(model.device, torch.float32)  # trained and thresholded in float32
        self.thresholds = thresholds
        self.candidates = self.rows = self.draft = None
        self.row_index = torch.arange(1, device=model.device)  # 0..R-1, grown once to the longest pass
        self.fired = torch.zeros(1, dtype=torch.bool, device=model.device)  # rows that fired in this pass
        self.predictor_calls = self.rejected = 0
        self.timer = StageTimer(model.device)  # "predictors" and "verification" (the LM head of a settled layer)

    def layers(self, scheduler: TwoLevelScheduler) -> list[bool]:
        """Per layer: whether to `check` after it for this pass."""
        return scheduler.layers()

    def begin_pass(self, candidates: torch.Tensor, draft: torch.Tensor, token_index: int) -> None:
        """candidates [R, k]: each row's speculative tokens; draft [R - 1]: the pass's draft tokens;
        token_index: the position of row 0's prediction among the generated tokens. Gathers the
        candidates' LM-head rows once per pass; every checked layer reuses them."""
        self.candidates, self.draft = candidates, draft
        self.rows = spec_rows(self.model, candidates)  # [R, k, H]
        R = candidates.shape[0]
        if self.row_index.shape[0] < R:
            self.row_index = torch.arange(R, device=candidates.device)
            self.fired = torch.zeros(R, dtype=torch.bool, device=candidates.device)
        self.needed, self.fired_rows = self.row_index[:R], self.fired[:R].zero_()

    def fires(self, layer: int, feats: torch.Tensor) -> torch.Tensor:
        """The predictor of `layer` on the rows' features [R, 3k]: [R] bool."""
        return self.bank.prob(layer, feats) > self.thresholds[layer]

    def check(self, layer: int, h_in: torch.Tensor, h: torch.Tensor) -> Generator[torch.Tensor, list[int], ExitHit | None]:
        """Whether the pass leaves after `layer` (h_in, h: that layer's input and output of the
        pass's rows, [R, H]): a generator that yields each device tensor it must read (at most two)
        and is sent its values; it returns the hit, or None. The runner reads the tensors of every
        request checked after the same layer in one host read (engine/runner.py, `run_checks`)."""
        t = self.timer.start()
        self.predictor_calls += 1
        feats = exit_features(self.model, h_in, h, self.rows)  # [R, 3k]; the first k: the candidates' logits
        fired = self.fired_rows.logical_or_(self.fires(layer, feats))
        best = self.candidates.gather(1, feats[:, : self.candidates.shape[1]].argmax(dim=-1, keepdim=True))
        accepted = accept_chain(self.draft, best.view(-1))[0]
        settled = (fired | (self.needed > accepted)).all()
        self.timer.stop("predictors", t)
        settled, a = yield torch.stack([settled.long(), accepted])
        if not settled:
            return None
        t = self.timer.start()
        logits = self.model.logits(h[: a + 1])  # [a + 1, V]: replaces the final LM head for these rows
        choice = logits.argmax(dim=-1)
        verdict = accept_chain(self.draft[:a], choice)  # the argmaxes may accept fewer drafts
        among = (self.candidates[: a + 1] == choice[:, None]).any(dim=-1)
        ok = (among | (self.needed[: a + 1] > verdict[0])).all()
        self.timer.stop("verification", t)
        ok, accepted, *tokens = yield torch.cat([ok.long().view(1), verdict])
        if not ok:
            self.rejected += 1
            self.fired_rows.zero_()
            return None
        return ExitHit(layer, tokens[: accepted + 1], logits[: accepted + 1])


class ForcedExits(ExitController):
    """Exits decided by `rule(token index, layer)` instead of the predictors (asked at every layer
    but the last, whatever the schedule): every row of the pass fires together; argmaxes must
    still be speculative tokens."""

    def __init__(self, model: Transformer, bank: PredictorBank, thresholds: list[float],
                 rule: Callable[[int, int], bool]):
        super().__init__(model, bank, thresholds)
        self.rule, self.token_index = rule, 0
        self.every_layer = [True] * (model.cfg.num_layers - 1) + [False]

    def layers(self, scheduler: TwoLevelScheduler) -> list[bool]:
        return self.every_layer

    def begin_pass(self, candidates: torch.Tensor, draft: torch.Tensor, token_index: int) -> None:
        super().begin_pass(candidates, draft, token_index)
        self.token_index = token_index

    def fires(self, layer: int, feats: torch.Tensor) -> torch.Tensor:
        return torch.full((feats.shape[0],), self.rule(self.token_index, layer), device=feats.device)
