"""The model runner: the only code in the engine that runs the target model.

One call is one ragged forward: each request of the step contributes a segment of rows (its whole
prompt when it joins, its last token when it decodes, its last token and the drafts when it
verifies) that writes and reads its own cache under its own attention description. Which layer
code runs is one rule, in the model (`Transformer.ragged_layer`): the C++ layer for a quantized
float32 model on the CPU where the kernels build, the Python layer otherwise; both take every
description a StepInputs carries (causal prefix, chain, tree mask).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.kv_cache import KVCache
from ..model.llama import RaggedInputs, StepInputs, Transformer


@dataclass
class Segment:
    """One request's rows in a forward: token ids [n] (on the device), where they go and what they read."""

    tokens: torch.Tensor
    cache: KVCache
    step: StepInputs


class ModelRunner:
    def __init__(self, model: Transformer):
        self.model = model

    def forward(self, segments: list[Segment], feature_layers: tuple[int, ...] = ()
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """All layers over the segments' rows: final hidden states [N, H] (segments in order) and the
        outputs of `feature_layers` concatenated ([N, W]; None without feature layers)."""
        model = self.model
        steps = [s.step for s in segments]
        batch = RaggedInputs(
            cos=torch.cat([s.cos for s in steps], dim=1) if len(steps) > 1 else steps[0].cos,
            sin=torch.cat([s.sin for s in steps], dim=1) if len(steps) > 1 else steps[0].sin,
            slots=torch.cat([s.slots for s in steps]) if len(steps) > 1 else steps[0].slots,
            rows=[s.tokens.shape[0] for s in segments], caches=[s.cache for s in segments], steps=steps)
        tokens = torch.cat([s.tokens for s in segments]) if len(segments) > 1 else segments[0].tokens
        h = model.embed(tokens[None, :])
        kept: dict[int, torch.Tensor] = {}
        for i in range(model.cfg.num_layers):
            h = model.ragged_layer(i, h, batch)
            if i in feature_layers:
                kept[i] = h[0]
        feats = torch.cat([kept[i] for i in feature_layers], dim=-1) if feature_layers else None
        return h[0], feats
