"""The model runner: the only code in the engine that runs the target model.

One call is one ragged forward: each request of the step contributes a segment of rows (its whole
prompt when it joins, its last token when it decodes, its last token and the drafts when it
verifies) that writes and reads its own cache under its own attention description. Which layer
code runs is one rule, in the model (`Transformer.ragged_layer`): the C++ layer for a quantized
float32 model on the CPU where the kernels build, the Python layer otherwise; both take every
description a StepInputs carries (causal prefix, chain, tree mask, holes). Without hooks, the layers
run as one call (`Transformer.ragged_layers`: the C++ stack where it runs); on a GPU, a step of
decode rows and verification chains replays a CUDA graph of that call instead (cuda_graphs.py).

A segment may carry early exit's hooks (`LayerHooks`, engine/early_exit.py): carried rows that
join it at the layers they resume from, a mask per layer (the skip policy's holes), and a check
after some layers, where the segment may leave the forward (its request's token exited). The other
segments run on; only a layer where some segment joins, changes its mask or leaves rebuilds the
batch's inputs. The checks after a layer read the host together: one read per round for all requests.
"""
from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from ..model.kv_cache import KVCache
from ..model.llama import Transformer
from ..model.step_inputs import RaggedInputs, StepInputs

if TYPE_CHECKING:
    from .cuda_graphs import DecodeGraphs


class LayerHooks(Protocol):
    """What an early-exit segment does between layers (engine/early_exit.py's ExitPass)."""

    events: tuple[set[int], set[int]]  # layers with something before them (joins, masks) / a check after them

    def before_layer(self, i: int, h: torch.Tensor, step: StepInputs) -> tuple[torch.Tensor, StepInputs]: ...

    def after_layer(self, i: int, h_in: torch.Tensor, h: torch.Tensor) -> Generator[torch.Tensor, list[int], bool]:
        """Whether the segment leaves after layer i; yields the device tensors it needs read (`run_checks`)."""


@dataclass
class Segment:
    """One request's rows in a forward: token ids [n] (on the device), where they go and what they read;
    exits: early exit's hooks (None: every row runs every layer)."""

    tokens: torch.Tensor
    cache: KVCache
    step: StepInputs
    exits: LayerHooks | None = None


def ragged_inputs(segments: list[Segment], steps: list[StepInputs], rows: list[int]) -> RaggedInputs:
    """The batch's inputs for the given segments (rows > 0 each), computed once per change."""
    return RaggedInputs(
        cos=torch.cat([s.cos for s in steps], dim=1) if len(steps) > 1 else steps[0].cos,
        sin=torch.cat([s.sin for s in steps], dim=1) if len(steps) > 1 else steps[0].sin,
        slots=torch.cat([s.slots for s in steps]) if len(steps) > 1 else steps[0].slots,
        rows=rows, caches=[s.cache for s in segments], steps=steps)


def run_checks(checks: dict[int, Generator[torch.Tensor, list[int], bool]]) -> dict[int, bool]:
    """Run the exit checks of one layer side by side: each round, every check still deciding hands
    a device tensor, and one host read serves them all (two rounds at most: the predictors, then the
    LM head of the passes they settle), where each request alone would read once or twice itself."""
    results: dict[int, bool] = {}
    wants: dict[int, torch.Tensor] = {}

    def advance(j: int, values: list[int] | None) -> None:
        try:
            wants[j] = checks[j].send(values)
        except StopIteration as done:
            results[j] = done.value
    for j in checks:
        advance(j, None)
    while wants:
        asked = list(wants.items())
        wants.clear()
        values = torch.cat([t.view(-1) for _, t in asked]).tolist()  # the round's one host read
        at = 0
        for j, t in asked:
            advance(j, values[at : at + t.numel()])
            at += t.numel()
    return results


class ModelRunner:
    def __init__(self, model: Transformer, graphs: DecodeGraphs | None = None):
        """graphs: the CUDA graphs that serve steps of decode rows and verification chains
        (engine/cuda_graphs.py), or None."""
        self.model = model
        self.graphs = graphs

    def forward(self, segments: list[Segment], feature_layers: tuple[int, ...] = ()
                ) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
        """All layers over the segments' rows: final hidden states [N, H] of the rows that ran every
        layer (segments in order), the outputs of `feature_layers` concatenated ([N, W]; None without
        feature layers), and each segment's number of rows in them (0: it left at an exit)."""
        if any(s.exits is not None for s in segments):
            h, rows = self._forward_with_exits(segments)
            return h, None, rows
        model = self.model
        rows = [s.tokens.shape[0] for s in segments]
        if self.graphs is not None and not feature_layers:
            h = self.graphs.forward(segments)
            if h is not None:
                return h, None, rows
        batch = ragged_inputs(segments, [s.step for s in segments], rows)
        tokens = torch.cat([s.tokens for s in segments]) if len(segments) > 1 else segments[0].tokens
        h = model.embed(tokens[None, :])
        kept: dict[int, torch.Tensor] = {}
        done = 0
        for last in sorted({*feature_layers, model.cfg.num_layers - 1}):  # runs of layers between kept outputs
            h = model.ragged_layers(done, last + 1, h, batch)
            kept[last], done = h[0], last + 1
        feats = torch.cat([kept[i] for i in feature_layers], dim=-1) if feature_layers else None
        return h[0], feats, rows

    def _forward_with_exits(self, segments: list[Segment]) -> tuple[torch.Tensor, list[int]]:
        """The layers with early exit's hooks. A segment's rows may start empty (a lossless flush:
        only carried rows, joining later); one that leaves at a check is done."""
        model = self.model
        L = model.cfg.num_layers
        parts = [model.embed(s.tokens[None, :]) for s in segments]  # per segment [1, rows, H]
        steps = [s.step for s in segments]
        hooked = [(j, s.exits) for j, s in enumerate(segments) if s.exits is not None]
        before = [[j for j, x in hooked if i in x.events[0]] for i in range(L)]
        after = [[j for j, x in hooked if i in x.events[1]] for i in range(L)]
        left = [False] * len(segments)
        h = batch = live = None
        for i in range(L):
            changed = batch is None
            if before[i]:
                parts = self._split(h, parts, live)
                for j in before[i]:
                    if not left[j]:
                        parts[j], steps[j] = segments[j].exits.before_layer(i, parts[j], steps[j])
                changed = True
            if changed:
                live = [j for j, p in enumerate(parts) if not left[j] and p.shape[1] > 0]
                if not live:
                    continue
                h = torch.cat([parts[j] for j in live], dim=1) if len(live) > 1 else parts[live[0]]
                batch = ragged_inputs([segments[j] for j in live], [steps[j] for j in live],
                                      [parts[j].shape[1] for j in live])
            if not live:
                continue
            h_in, h = h, model.ragged_layer(i, h, batch)
            exited = False
            if after[i]:
                checks, first = {}, 0
                for j, n in zip(live, batch.rows):
                    if j in after[i]:
                        checks[j] = segments[j].exits.after_layer(i, h_in[:, first:first + n], h[:, first:first + n])
                    first += n
                for j, leaves in run_checks(checks).items():
                    if leaves:
                        left[j] = exited = True
            if exited:
                parts = self._split(h, parts, live)
                batch = None
        parts = self._split(h, parts, live)
        rows = [0 if left[j] else p.shape[1] for j, p in enumerate(parts)]
        out = [parts[j][0] for j in range(len(segments)) if rows[j]]
        H = model.cfg.hidden_size
        h = torch.cat(out) if len(out) > 1 else out[0] if out else torch.empty(0, H, device=model.device)
        return h, rows

    @staticmethod
    def _split(h: torch.Tensor | None, parts: list[torch.Tensor], live: list[int] | None) -> list[torch.Tensor]:
        """Per-segment hidden states again from the batch's h (the live segments' rows, in order)."""
        if h is None or not live:
            return parts
        parts = list(parts)
        for j, p in zip(live, torch.split(h, [parts[j].shape[1] for j in live], dim=1)):
            parts[j] = p
        return parts
