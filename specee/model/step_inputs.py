"""What every layer of one forward step shares, built once per step: one sequence's rows
(`StepInputs`) or several sequences' rows in one ragged batch (`RaggedInputs`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_cache import KVCache

NO_MASK = torch.empty(0, dtype=torch.bool)  # what the C++ layer takes for "no mask"


@dataclass(frozen=True)
class StepInputs:
    """What every layer of one forward step shares, computed once per step (not per layer).

    slots: cache slots the rows write, [S]; cos/sin: RoPE rows, [B, S, 1, D] (sin signed, see rope.py);
    kv_len: how many cache slots attention reads; reads: which of them each row attends to, alone
    (no other field changes its meaning):
      "all"     every slot below kv_len (a decode row);
      "causal"  a prompt's rows, slots start..start+S-1 of an unpadded sequence, each reading the
                slots up to its own; from slot 0 (a prefill) no mask, causal attention in the fused
                kernels; from a later slot (a chunked prefill's later part) `mask` holds the rule for
                attention that is not the C++ layer's own (the Python layer, ATen's fallback);
      "chain"   each row exactly the slots up to its own (a verification chain): the C++ layer
                attends each row alone over that prefix, as a decode row; `mask` holds the same
                rule for the Python layer;
      "mask"    what `mask` [B, 1, S, kv_len] allows (a draft tree, skip's holes, left padding).
    """

    slots: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    kv_len: int
    reads: str = "all"
    mask: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.mask is None and self.reads in ("chain", "mask"):
            raise ValueError(f"reads={self.reads!r} needs a mask")
        if self.mask is not None and self.reads == "all":
            raise ValueError("reads='all' takes no mask")

    @property
    def causal(self) -> bool:
        return self.reads == "causal"

    @property
    def chain(self) -> bool:
        return self.reads == "chain"


@dataclass
class RaggedInputs:
    """Every layer's inputs for the rows of several sequences in one forward (a ragged batch),
    computed once per step: RoPE rows and cache slots of all rows concatenated, and per sequence
    (segment) its row count, its own cache and its attention description (a StepInputs); and the
    per-layer argument lists of the C++ layer, so a layer call builds nothing."""

    cos: torch.Tensor  # [1, N, 1, D]
    sin: torch.Tensor
    slots: torch.Tensor  # [N]: each row's slot in its own segment's cache
    rows: list[int]
    caches: list[KVCache]
    steps: list[StepInputs]

    def __post_init__(self) -> None:
        self.kv_lens = [s.kv_len for s in self.steps]
        self.masks = [NO_MASK if s.mask is None else s.mask for s in self.steps]
        self.causal = [s.causal for s in self.steps]
        self.chain = [s.chain for s in self.steps]
        self.k_layers = list(zip(*[c.k_layers for c in self.caches]))  # [layer][segment]: the caches' own views
        self.v_layers = list(zip(*[c.v_layers for c in self.caches]))
