"""GGUF's quantized tensors as specee reads them: raw blocks kept as they are in the file until a
linear is built (model/quant.py), then dequantized by `gguf` or, for Q4 blocks, repacked into int4
groups without a float round trip."""
from __future__ import annotations

import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from .kernels import loaded_cpu_kernels

if TYPE_CHECKING:
    import gguf


@dataclass
class GGUFWeight:
    """A GGUF tensor kept as its raw blocks: `data` is what gguf.GGUFReader gives (rows along dim 0:
    uint8 [N, bytes per row] for quantized types), `shape` the weight's (N, K)."""

    qtype: gguf.GGMLQuantizationType
    data: np.ndarray
    _bytes: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def shape(self) -> tuple[int, int]:
        from gguf.quants import quant_shape_from_byte_shape

        return tuple(quant_shape_from_byte_shape(self.data.shape, self.qtype)) if self.data.dtype == np.uint8 \
            else tuple(self.data.shape)

    def dequantize(self) -> torch.Tensor:
        """gguf's own float32 dequantization, one vectorized call over all blocks (gguf.quants.dequantize
        walks a memory map row group by row group, several times slower)."""
        from gguf.quants import dequantize

        if self.data.dtype != np.uint8 or self.qtype.name not in _GGUF_QUANTS:
            return torch.from_numpy(np.require(dequantize(self.data, self.qtype), np.float32, ["C", "W"]))
        return torch.from_numpy(_dequantize_blocks(self.qtype, self.data).reshape(self.shape))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [n] as `dequantize()` gives them, [n, K] float32: an embedding lookup that leaves
        the table in its blocks (Q8_0, SmolLM2's embedding and head: one C++ call, kquant.cpp)."""
        if not ids.numel():
            return torch.empty(0, self.shape[1])
        if self.qtype.name == "Q8_0" and self.data.dtype == np.uint8 and (kernels := loaded_cpu_kernels()) is not None:
            return kernels.q8_0_rows(self._table(), ids.reshape(-1).cpu())
        picked = np.ascontiguousarray(self.data[ids.cpu().numpy()])
        return GGUFWeight(self.qtype, picked).dequantize().reshape(len(picked), self.shape[1])

    def _table(self) -> torch.Tensor:
        """The raw blocks as a uint8 tensor over the same memory (made once; never written)."""
        if self._bytes is None:
            with warnings.catch_warnings():  # a read-only memory map: torch warns that it cannot be written
                warnings.simplefilter("ignore", UserWarning)
                self._bytes = torch.from_numpy(self.data)
        return self._bytes

    def to(self, device=None, dtype=None) -> torch.Tensor:
        """As a float tensor (the embedding, norms, or a weight the caller wants float)."""
        return self.dequantize().to(device=device, dtype=dtype)

    def native_format(self) -> str | None:
        """The kernel format nearest this tensor's own precision where its blocks do not run as stored
        (model/quant_gguf.py): Q4_0/Q4_1/Q4_K -> int4 (codes exact), other quantized types (Q5_x,
        Q6_K, Q8_0, ...) -> int8 (requantized), float types -> None."""
        from gguf import GGMLQuantizationType as T

        if self.qtype in (T.Q4_0, T.Q4_1, T.Q4_K):
            return "int4"
        return None if self.qtype in (T.F32, T.F16, T.BF16) else "int8"


CHUNK_BLOCKS = 1 << 12  # blocks dequantized at a time (their floats and gguf's temporaries stay in an L2)
_GGUF_QUANTS = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")


def _dequantize_blocks(qtype, data: np.ndarray) -> np.ndarray:
    """gguf.quants' dequantization of `qtype` applied to all blocks of `data`: float32 [blocks, block],
    CHUNK_BLOCKS at a time on the torch threads (blocks are independent, so the values are the same;
    whole-tensor passes through gguf's temporaries took Qwen2.5-Coder-1.5B's Q6_K head 5.8 s)."""
    import gguf.quants

    block, size = gguf.quants.GGML_QUANT_SIZES[qtype]
    blocks = np.ascontiguousarray(data).reshape(-1, size)
    kind = getattr(gguf.quants, qtype.name)
    out = np.empty((len(blocks), block), np.float32)

    def run(start: int) -> None:
        out[start:start + CHUNK_BLOCKS] = kind.dequantize_blocks(blocks[start:start + CHUNK_BLOCKS])

    starts = range(0, len(blocks), CHUNK_BLOCKS)
    if len(starts) == 1:  # a few rows (an embedding lookup, a head's rescored rows, every step): no pool
        run(0)
    else:
        with ThreadPoolExecutor(min(torch.get_num_threads(), len(starts))) as pool:
            list(pool.map(run, starts))
    return out


# each block's float16 scale fields (d, and m / dmin where the type has them): the rest of a block
# is small integers, so its values are finite exactly when these are
_SCALE_BYTES = {"Q4_0": slice(0, 2), "Q4_1": slice(0, 4), "Q5_0": slice(0, 2), "Q5_1": slice(0, 4),
                "Q8_0": slice(0, 2), "Q2_K": slice(-4, None), "Q3_K": slice(-2, None), "Q4_K": slice(0, 4),
                "Q5_K": slice(0, 4), "Q6_K": slice(-2, None)}


def all_finite(qtype, data: np.ndarray) -> bool:
    """Whether a GGUF tensor holds no NaN or Inf, from its raw data: float arrays directly, the
    common quantized types from their scales alone (a tenth of the bytes, no dequantization),
    other types dequantized."""
    from gguf.quants import GGML_QUANT_SIZES, dequantize

    if qtype.name in _SCALE_BYTES:
        size = GGML_QUANT_SIZES[qtype][1]
        scales = np.ascontiguousarray(np.ascontiguousarray(data).reshape(-1, size)[:, _SCALE_BYTES[qtype.name]])
        return bool(np.isfinite(scales.view(np.float16)).all())
    if data.dtype.kind == "f":
        return bool(np.isfinite(data).all())
    return bool(np.isfinite(dequantize(data, qtype)).all())


def block_codes(w: GGUFWeight) -> np.ndarray:
    """The codes 0..15 uint8 [N, K] of Q4_0 / Q4_1 / Q4_K blocks, read from their bits (ggml-quants.c's
    dequantize_row_*; tests/test_gguf_load.py checks them against gguf's own dequantization). gguf's
    float dequantization of unit-scale copies gave the same codes at 10x the time. The other types'
    codes are read where they are repacked (kernels/kquant_repack.cpp)."""
    from gguf.quants import GGML_QUANT_SIZES

    N, K = w.shape
    b = np.ascontiguousarray(w.data).reshape(-1, GGML_QUANT_SIZES[w.qtype][1])
    if w.qtype.name in ("Q4_0", "Q4_1"):  # d (and m), 16 bytes: input j low nibble, j + 16 high
        qs = b[:, 2 if w.qtype.name == "Q4_0" else 4:][:, :16]
        codes = np.concatenate([qs & 15, qs >> 4], axis=1)
    elif w.qtype.name == "Q4_K":  # d, dmin, 12 scale bytes; 4 runs of 32 bytes: 64 j + l low, 64 j + 32 + l high
        qs = b[:, 16:144].reshape(-1, 4, 1, 32)
        codes = np.concatenate([qs & 15, qs >> 4], axis=2)
    else:
        raise ValueError(f"{w.qtype.name} blocks are not int4 groups (only Q4_0, Q4_1, Q4_K are)")
    return np.ascontiguousarray(codes).reshape(N, K)


def gguf_int4_codes(w: GGUFWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 / Q4_1 / Q4_K blocks as int4 groups of 32, without a float round trip of the weights:
    (q uint8 [N, K], scales, zeros float32 [N, K // 32]) with W = (q - 8) * scale + zero.
      Q4_0: W = d (q - 8)              -> scale d,      zero 0
      Q4_1: W = d q + m                -> scale d,      zero m + 8 d
      Q4_K: W = d sc_j q - dmin m_j    -> scale d sc_j, zero 8 d sc_j - dmin m_j  (6-bit sc_j, m_j per 32)
    In float32 these scales and zeros are exact (fp16 times a 6-bit integer) up to the one rounding
    of the zero's sum; the kernel reads them in bf16, which is where the repack rounds (see README)."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import Q4_K, GGML_QUANT_SIZES

    N, K = w.shape
    size = GGML_QUANT_SIZES[w.qtype][1]
    blocks = np.ascontiguousarray(w.data).reshape(-1, size)
    f16 = lambda a: a.view(np.float16).astype(np.float32).reshape(N, -1)  # noqa: E731
    if w.qtype == T.Q4_0:
        scales, zeros = f16(blocks[:, 0:2]), None
    elif w.qtype == T.Q4_1:
        d, m = f16(blocks[:, 0:2]), f16(blocks[:, 2:4])
        scales, zeros = d, m + 8 * d
    elif w.qtype == T.Q4_K:
        d, dmin = f16(blocks[:, 0:2]), f16(blocks[:, 2:4])
        sc, m = (a.astype(np.float32).reshape(N, -1, 8) for a in Q4_K.get_scale_min(blocks[:, 4:16]))
        scales = (d.reshape(N, -1, 1) * sc).reshape(N, -1)
        zeros = (8 * d.reshape(N, -1, 1) * sc - dmin.reshape(N, -1, 1) * m).reshape(N, -1)
    else:
        raise ValueError(f"{w.qtype.name} blocks are not int4 groups (only Q4_0, Q4_1, Q4_K are)")
    q = torch.from_numpy(block_codes(w))
    scales = torch.from_numpy(np.ascontiguousarray(scales, np.float32))
    zeros = torch.zeros_like(scales) if zeros is None else torch.from_numpy(np.ascontiguousarray(zeros, np.float32))
    return q, scales, zeros
