"""GGUF Q4_K, Q6_K, Q5_0 and Q8_0 tensors run from their own blocks (model/kernels/kquant.cpp): the
blocks are repacked per 16 outputs into vectors the integer dot products read directly, byte for
byte as large as the file's (Q4_K 4.5 bits a weight, Q6_K 6.5625, Q5_0 5.5, Q8_0 8.5), where the
int4 repack took 5 bits and the int8 one 8 (and Q5_0 and Q8_0 lost their scale per 32 to one per
row). Activations are quantized per block of 32 to int8, as the int4 kernel's default.

Codes come from the blocks' bits (gguf_blocks.block_codes, checked against gguf's dequantization);
scales and d are copied verbatim."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from . import huge_pages
from .gguf_blocks import GGUFWeight, block_codes
from .quant import QuantizationError, _KernelLinear, _present

TILE = 16  # outputs per tile: one 16-lane vector
GROUP = 4  # tiles whose super-blocks interleave (kquant.cpp's kGroupTiles)
SUPER = 256  # inputs per K-quant block
CHUNK_WEIGHTS = 1 << 20  # weights repacked at a time (a chunk's codes, 1 MB, and temporaries stay in an L2)
BLOCK = {"Q4_K": SUPER, "Q6_K": SUPER, "Q5_0": 32, "Q8_0": 32}  # what kquant.cpp runs: inputs per block


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


def _words(x: np.ndarray, word: int) -> np.ndarray:
    """x [..., word] uint8 as one unsigned integer per `word` bytes [...] (the same bytes), so the
    transposes below move 2- or 4-byte elements instead of bytes (4x faster in numpy)."""
    return np.ascontiguousarray(x).view(f"u{word}")[..., 0]


def _bytes(words: np.ndarray, *shape: int) -> np.ndarray:
    return np.ascontiguousarray(words).view(np.uint8).reshape(shape)


def _nibbles(codes: np.ndarray) -> np.ndarray:
    """Low 4 bits as [N/16, K/32, 4 vectors x 64 B]: vector a, lane o, byte e = inputs 8 a + e of
    the block (low nibble) and + 4 (high nibble). (K-quants: 8 of these blocks a super-block.)"""
    N, K = codes.shape
    v = codes.reshape(N // TILE, TILE, K // 32, 4, 2, 4)  # t, o, b, a, j, e
    pairs = _words(v[..., 0, :] & 15 | v[..., 1, :] << 4, 4)  # t, o, b, a (the uint8 shift drops high bits)
    return _bytes(pairs.transpose(0, 2, 3, 1), N // TILE, K // 32, 256)


def _quads(x: np.ndarray) -> np.ndarray:
    """Per-input values uint8 [N, K] as [N/16, K/32, 8 vectors x 64 B]: vector C, lane o, byte e =
    input 4 C + e of the block."""
    N, K = x.shape
    quads = _words(x.reshape(N // TILE, TILE, K // 32, 8, 4), 4)  # t, o, b, C
    return _bytes(quads.transpose(0, 2, 3, 1), N // TILE, K // 32, 512)


def _super(blocks: np.ndarray) -> np.ndarray:
    """Per-block vectors [N/16, K/32, n] as the super-blocks' [N/16, K/256, 8 n]."""
    return blocks.reshape(blocks.shape[0], -1, 8 * blocks.shape[-1])


def _lanes(x: np.ndarray, word: int) -> np.ndarray:
    """Per-(output, block) bytes [N, S, n] as [N/16, S, n x 16]: the n / word words in turn, each as
    16 lanes (outputs) of `word` bytes."""
    N, S, n = x.shape
    words = _words(x.reshape(N // TILE, TILE, S, n // word, word), word)  # t, o, s, w
    return _bytes(words.transpose(0, 2, 3, 1), N // TILE, S, n * TILE)


def repack(w: GGUFWeight) -> np.ndarray:
    """w's blocks as kquant.cpp's tile-blocks: uint8 [N/16, K / block, tile-block bytes]."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import GGML_QUANT_SIZES

    if w.qtype.name not in BLOCK:
        raise QuantizationError(f"{w.qtype.name} blocks have no kquant.cpp kernel (Q4_K, Q6_K, Q5_0 and Q8_0 do)")
    N, K = w.shape
    size = GGML_QUANT_SIZES[w.qtype][1]
    blocks = np.ascontiguousarray(w.data).reshape(N, K // BLOCK[w.qtype.name], size)
    codes = block_codes(w)
    if w.qtype == T.Q8_0:
        parts = [_quads(codes), _lanes(blocks[..., 0:2], 2)]  # the int8 codes + 128, then d's
    elif w.qtype == T.Q5_0:
        fifth = _quads(codes >> 4).reshape(N // TILE, K // 32, 8, 64)  # vector C: input 4 C + e's 5th bit
        fifth = sum(fifth[..., c, :] << c for c in range(8)).astype(np.uint8)  # at bit C of one vector
        parts = [_nibbles(codes), fifth, _lanes(blocks[..., 0:2], 2)]
    elif w.qtype == T.Q4_K:
        parts = [_super(_nibbles(codes)), _lanes(blocks[..., 4:16], 4), _lanes(blocks[..., 0:4], 2)]  # d's, then dmin's
    elif w.qtype == T.Q6_K:
        hi = (codes >> 4).reshape(N // TILE, TILE, K // SUPER, 8, 2, 4, 4)  # t, o, sb, b, h, cc, e
        hi = _words(hi[..., 0, :] | hi[..., 1, :] << 2 | hi[..., 2, :] << 4 | hi[..., 3, :] << 6, 4)  # t, o, sb, b, h
        parts = [_super(_nibbles(codes)), _bytes(hi.transpose(0, 2, 3, 4, 1), N // TILE, K // SUPER, 1024),
                 _lanes(blocks[..., 192:208], 4), _lanes(blocks[..., 208:210], 2)]
    return np.concatenate(parts, axis=-1)


def interleave(blocks: np.ndarray, at: int, qtype: int) -> tuple[np.ndarray, list[tuple[int, int, int, int]]]:
    """Tile-blocks [tiles, S, size] in kquant.cpp's order: groups of GROUP tiles (fewer at the end),
    per (super-)block the group's 64-byte vectors interleaved (vector v of tile j at (v g + j) 64),
    then their tails (d, 32 bytes, but Q4_K's); and each tile's (offset of its group from `at`, type,
    g, j)."""
    tiles, S, size = blocks.shape
    vectors = size // 64
    out, rows = [], []
    for g0 in range(0, tiles, GROUP):
        g = blocks[g0:g0 + GROUP]
        body = g[..., :vectors * 64].reshape(len(g), S, vectors, 64).transpose(1, 2, 0, 3).reshape(S, -1)
        tail = g[..., vectors * 64:].transpose(1, 0, 2).reshape(S, -1)
        rows += [(at + g0 * S * size, qtype, len(g), j) for j in range(len(g))]
        out.append(np.concatenate([body, tail], axis=1).reshape(-1))
    return np.concatenate(out), rows


def tile_blocks(w: GGUFWeight, at: int) -> tuple[list[np.ndarray], list[tuple[int, int, int, int]]]:
    """`interleave(repack(w), at, ...)` as pieces to concatenate, a few groups of tiles at a time on
    the torch threads: each
    chunk's temporaries stay in cache (whole-matrix passes took Qwen2.5-Coder-1.5B's load 9 s on an
    Intel Xeon), and numpy releases the GIL in them. Groups never straddle chunks, so the bytes are
    the same."""
    N, K = w.shape
    step = TILE * GROUP * max(1, CHUNK_WEIGHTS // (TILE * GROUP * K))
    starts = range(0, N, step)
    with ThreadPoolExecutor(max(1, min(torch.get_num_threads(), len(starts)))) as pool:
        chunks = list(pool.map(lambda r: repack(GGUFWeight(w.qtype, w.data[r:r + step])), starts))
    out, rows = [], []
    for chunk in chunks:
        blocks, chunk_rows = interleave(chunk, at, int(w.qtype))
        out.append(blocks)
        rows += chunk_rows
        at += blocks.size
    return out, rows


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
        packed, tiles = [], []
        for p in parts:
            pieces, rows = tile_blocks(p, sum(b.size for b in packed))
            packed += pieces
            tiles += rows
        # written once, where it stays (a copy onto huge pages took Qwen2.5-Coder-1.5B's load 2 s)
        self.packed = huge_pages.empty((sum(b.size for b in packed),), torch.uint8, torch.device("cpu"))
        np.concatenate(packed, out=self.packed.numpy())
        self.tiles = torch.tensor(tiles, dtype=torch.int64)
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
