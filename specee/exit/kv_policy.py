"""What happens to the KV cache of the layers an exited token skipped: one strategy per policy.

A token that exits after layer e has no K/V at layers e+1..L-1; later tokens read those
layers. The three answers (see ../shared/notes/early-exit-kv.md):

- SkipKV: leave the holes; deeper layers attend only to the slots they hold.
- PropagateKV: write the skipped layers' K/V from the exit hidden state (CALM).
- RecomputeKV: carry the exited rows' remaining layers along as extra rows of the next
  step's forward, so every K/V entry equals the full model's before anyone reads it (the
  basis of lossless mode: a carried row that completes the last layer verifies its token).

Early exit's decoding (engine/early_exit.py) keeps one policy per request, over that request's own
cache (a run of the engine's block pool), and calls the same hooks whatever the policy for a pass of
one row (one-token early exit) or several (a verification pass: the last token and its drafts);
each policy also keeps the cache's per-layer fill state (`cache.filled`) true.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from ..model.kv_cache import KVCache
from ..model.llama import Transformer
from ..model.step_inputs import StepInputs


@dataclass
class Pending:
    """A row that still owes layers resume..L-1 (recompute policy)."""

    slot: int
    resume: int
    hidden: torch.Tensor  # [B, 1, H]: its output of layer resume-1, per request


class KVPolicy:
    """The hooks a step calls; the defaults are those of a policy with no holes and no carried rows."""

    name: ClassVar[str]
    masks_layers: ClassVar[bool] = False  # True: `layer_inputs` must be asked at every layer (skip's holes)

    def __init__(self, model: Transformer, cache: KVCache, inputs: Callable[[int, int], StepInputs]):
        """inputs(start, count): the step inputs of the rows at slots start..start+count-1 (the decode
        loop's: it knows each request's positions)."""
        self.model, self.cache, self.num_layers, self.inputs = model, cache, model.cfg.num_layers, inputs
        self.pending: list[Pending] = []  # carried rows (recompute only)

    def begin_step(self, n: int, rows: int = 1) -> list[Pending]:
        """A pass feeds `rows` rows at slots n..n+rows-1; returns the carried rows that join it, by
        resume layer."""
        return []

    def layer_inputs(self, layer: int, step_in: StepInputs, n: int) -> StepInputs:
        """The inputs layer `layer` attends with (skip: only the slots that layer holds)."""
        return step_in

    def after_exit(self, e: int, h: torch.Tensor, active: list[int]) -> None:
        """The rows at `active` slots (contiguous) left after layer e (h: their hidden states
        [B, rows, H])."""
        self.cache.filled[:, :, active[0]:active[-1] + 1] = True

    def after_full_depth(self, active: list[int]) -> None:
        """The rows at `active` slots ran every layer."""
        self.cache.filled[:, :, active[0]:active[-1] + 1] = True

    def truncate(self, length: int) -> None:
        """Forget everything at or past slot `length` (a lossless rollback)."""
        self.cache.truncate(length)
        self.pending = [p for p in self.pending if p.slot < length]


class SkipKV(KVPolicy):
    name = "skip"
    masks_layers = True

    def begin_step(self, n: int, rows: int = 1) -> list[Pending]:
        self.cache.filled[:, :, n:n + rows] = True  # own slots readable; unmarked past the exit
        return []

    def layer_inputs(self, layer: int, step_in: StepInputs, n: int) -> StepInputs:
        """The rows read through the layer's holes: a mask, never a chain's or a causal prefix's
        shortcut (which would read every slot up to the row's own, holes included)."""
        if step_in.slots.shape[0] == 1:  # one row: the slots this layer holds, no causal part
            mask = self.cache.filled[layer, :, None, None, : n + 1]
        else:
            mask = self.cache.attention_mask(layer, step_in.slots, step_in.kv_len)
        return replace(step_in, reads="mask", mask=mask)

    def after_exit(self, e: int, h: torch.Tensor, active: list[int]) -> None:
        self.cache.filled[e + 1:, :, active[0]:active[-1] + 1] = False

    def after_full_depth(self, active: list[int]) -> None:
        pass  # begin_step marked every layer


class PropagateKV(KVPolicy):
    name = "propagate"

    def after_exit(self, e: int, h: torch.Tensor, active: list[int]) -> None:
        step_in = self.inputs(active[0], len(active))
        for j in range(e + 1, self.num_layers):
            self.model.project_kv(j, h, step_in, self.cache)
        super().after_exit(e, h, active)


class RecomputeKV(KVPolicy):
    name = "recompute"

    def begin_step(self, n: int, rows: int = 1) -> list[Pending]:
        return sorted(self.pending, key=lambda p: (p.resume, p.slot))

    def after_exit(self, e: int, h: torch.Tensor, active: list[int]) -> None:
        """Every row of this step resumes at e + 1 in a later step."""
        self.cache.filled[: e + 1, :, active[0]:active[-1] + 1] = True
        carried = [Pending(slot, e + 1, h[:, j:j + 1]) for j, slot in enumerate(active)]
        self.pending = [p for p in self.pending if p.slot not in active] + carried

    def after_full_depth(self, active: list[int]) -> None:
        """Every carried row joined (resume layers are <= L-1) and completed."""
        self.pending = []
        super().after_full_depth(active)


POLICY_CLASSES: dict[str, type[KVPolicy]] = {p.name: p for p in (SkipKV, PropagateKV, RecomputeKV)}


def join_rows(waiting: list[Pending], layer: int, h: torch.Tensor | None,
              active: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Prepend the carried rows that resume at `layer` (older slots first, so slot order holds)."""
    group = []
    while waiting and waiting[0].resume == layer:
        group.append(waiting.pop(0))
    parts = [p.hidden for p in group] + ([] if h is None else [h])
    return torch.cat(parts, dim=1), [p.slot for p in group] + active
