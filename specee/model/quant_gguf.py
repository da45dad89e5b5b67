"""GGUF Q4_K, Q6_K, Q5_0 and Q8_0 tensors run from their own blocks (model/kernels/kquant.cpp): the
blocks are repacked per 16 outputs (kernels/kquant_repack.cpp, at load) into vectors the integer dot
products read directly, byte for byte as large as the file's (Q4_K 4.5 bits a weight, Q6_K 6.5625,
Q5_0 5.5, Q8_0 8.5), where the int4 repack took 5 bits and the int8 one 8 (and Q5_0 and Q8_0 lost
their scale per 32 to one per row). Activations are quantized per block of 32 to int8, as the int4
kernel's default."""
from __future__ import annotations

import numpy as np
import torch

from . import huge_pages
from .gguf_blocks import GGUFWeight
from .quant import QuantizationError, _KernelLinear, _present

TILE = 16  # outputs per tile: one 16-lane vector
BLOCK = {"Q4_K": 256, "Q6_K": 256, "Q5_0": 32, "Q8_0": 32}  # what kquant.cpp runs: inputs per block


def fits(parts: list) -> bool:
    """Whether every part is a GGUF matrix of a type in BLOCK whose shape tiles: rows by 16, one
    width for all, a multiple of every part's block (Qwen2.5-0.5B's 896 takes Q5_0, not Q4_K)."""
    return all(isinstance(p, GGUFWeight) and p.qtype.name in BLOCK and p.data.dtype == np.uint8
               and p.shape[0] % TILE == 0 and p.shape[1] % BLOCK[p.qtype.name] == 0 for p in parts) \
        and len({p.shape[1] for p in parts}) == 1


def kernel_for(parts: list, device: torch.device):
    """The compiled kernels when `parts` can run as stored here (a CPU, the kernels built, int8
    activations: the K-quant kernel has no bf16 path), else None."""
    if torch.device(device).type != "cpu" or not fits(parts):
        return None
    from .kernels import ACTIVATIONS, int4_kernel

    kernel = int4_kernel()
    return kernel if kernel is not None and ACTIVATIONS[kernel.int4_activations()] == "int8" else None


class KQuantLinear(_KernelLinear):
    """Fused GGUF parts (q/k/v, gate/up, or one matrix) of types Q4_K / Q6_K / Q5_0 / Q8_0, each
    tile of 16 outputs run by its own type's kernel; keeps the parts (memory-mapped blocks) for rows
    and dequantize, which are exact: the kernel's weights are the blocks' own."""

    def __init__(self, parts: list[GGUFWeight], bias: torch.Tensor | None, kernel):
        if not fits(parts):  # what kernel_for checks
            raise QuantizationError("K-quant kernel: Q4_K / Q6_K / Q5_0 / Q8_0 parts with rows in multiples of 16 "
                                    "and one input width, a multiple of their blocks (256 or 32)")
        self.parts, self.bias, self.kernel = parts, bias, kernel
        self.out_features, self.in_features = sum(p.shape[0] for p in parts), parts[0].shape[1]
        # written once, where it stays (a copy onto huge pages took Qwen2.5-Coder-1.5B's load 2 s)
        self.packed = huge_pages.empty((sum(p.data.size for p in parts),), torch.uint8, torch.device("cpu"))
        tiles, at = [], 0
        for p in parts:  # the file's bytes (a tensor, no copy) repacked; each tile's entry for kquant_mm
            tiles.append(kernel.kquant_repack(p._table().contiguous(), int(p.qtype), self.in_features,
                                              self.packed[at:at + p.data.size], at))
            at += p.data.size
        self.tiles = torch.cat(tiles)
        kernel.kquant_check(self.packed, self.tiles, self.in_features)  # once here, not in every product

    def _kernel_input(self, x2d: torch.Tensor) -> torch.Tensor:
        """float32 and bf16 go in as they are: the kernel quantizes them itself."""
        return x2d if x2d.dtype in (torch.float32, torch.bfloat16) else x2d.float()

    def _matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        return self.kernel.kquant_mm(x2d, self.packed, self.tiles)

    def _part_rows(self, ids: torch.Tensor) -> list[tuple[GGUFWeight, torch.Tensor, torch.Tensor]]:
        """(part, positions in ids, rows within the part) for each part that ids reach."""
        out, start = [], 0
        for p in self.parts:
            n = p.shape[0]
            sel = ((ids >= start) & (ids < start + n)).nonzero().flatten()
            if len(sel):
                out.append((p, sel, ids[sel] - start))
            start += n
        return out

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if len(self.parts) == 1:  # a head, every token (the split below took 20 of SmolLM2's 33 us)
            return self.parts[0].rows(flat).view(*ids.shape, self.in_features)
        w = torch.empty(len(flat), self.in_features)
        for p, sel, local in self._part_rows(flat):
            w[sel] = p.rows(local)
        return w.view(*ids.shape, self.in_features)

    def take_rows(self, ids: torch.Tensor | slice) -> "KQuantLinear":
        """A linear of rows `ids` in increasing order (the k/v rows of a fused q/k/v)."""
        flat = torch.arange(self.out_features)[ids] if isinstance(ids, slice) else ids.reshape(-1)
        if len(flat) > 1 and bool((flat[1:] <= flat[:-1]).any()):
            raise QuantizationError("K-quant take_rows: rows must be in increasing order")
        parts = [GGUFWeight(p.qtype, p.data[local.numpy()]) for p, _, local in self._part_rows(flat)]
        return KQuantLinear(parts, None if self.bias is None else self.bias[ids], self.kernel)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def tensors(self) -> list[torch.Tensor]:
        """What it holds resident (the parts stay memory-mapped: read only by rows and dequantize)."""
        return _present(self.packed, self.tiles, self.bias)
