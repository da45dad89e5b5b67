"""Teacher forcing through the early-exit loop: what early exit would emit at each position of a
fixed continuation (the benchmarks' agreement and perplexity), fed the continuation instead."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TeacherForcedStep:
    predicted: int  # what early exit emitted at this position
    target: int  # the token fed instead (the full model's, for agreement)
    exit_layer: int
    logprob: float  # log-probability of `target` under the distribution early exit used


class TeacherForcing:
    """A token source for early exit (EarlyExitDecoding.teacher_forced): note what early exit chose, feed the given continuation instead."""

    def __init__(self, continuation: list[int]):
        self.continuation, self.records = continuation, []
        self.logits: torch.Tensor | None = None  # the last full-depth pass's rows (set by the decoding)

    def __call__(self, index: int, predicted: int, exit_layer: int, logits: torch.Tensor) -> int:
        target = self.continuation[index]
        logprob = float(torch.log_softmax(logits[-1].float(), dim=-1)[target])
        self.records.append(TeacherForcedStep(predicted, target, exit_layer, logprob))
        return target
