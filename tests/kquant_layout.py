"""kquant.cpp's weight layout written in numpy: the reference kernels/kquant_repack.cpp is checked
against (tests/test_gguf_load.py), byte for byte. This was specee's repack until the C++ one; it
reads the codes from the blocks' bits (`all_codes`, checked against gguf's own dequantization in
test_gguf_load.py) and copies scales and d verbatim."""
from __future__ import annotations

import numpy as np

from specee.model.gguf_blocks import GGUFWeight, block_codes
from specee.model.quant import QuantizationError

TILE, GROUP, SUPER = 16, 4, 256
BLOCK = {"Q4_K": SUPER, "Q6_K": SUPER, "Q5_0": 32, "Q8_0": 32}


def all_codes(w: GGUFWeight) -> np.ndarray:
    """The unsigned codes uint8 [N, K] of any type here or an int4 one (block_codes): Q5_0 0..31,
    Q6_K 0..63, Q8_0 the int8 plus 128 (ggml-quants.c's dequantize_row_*)."""
    from gguf.quants import GGML_QUANT_SIZES

    if w.qtype.name in ("Q4_0", "Q4_1", "Q4_K"):
        return block_codes(w)
    N, K = w.shape
    b = np.ascontiguousarray(w.data).reshape(-1, GGML_QUANT_SIZES[w.qtype][1])
    if w.qtype.name == "Q5_0":  # d, a 32-bit word of 5th bits, then Q4_0's nibbles
        high = np.unpackbits(b[:, 2:6], axis=1, bitorder="little") << 4
        qs = b[:, 6:22]
        out = np.concatenate([qs & 15, qs >> 4], axis=1) | high
    elif w.qtype.name == "Q6_K":  # two halves of 128: ql 64 bytes, qh 32 bytes; 4 runs of 32 inputs each
        ql = b[:, :128].reshape(-1, 2, 1, 2, 32)  # half, -, run pair (l, l + 32), l
        qh = b[:, 128:192].reshape(-1, 2, 1, 1, 32)
        low = np.concatenate([ql & 15, ql >> 4], axis=2)  # half, nibble, pair, l: run 2 nibble + pair
        out = low | ((qh >> (2 * np.arange(4, dtype=np.uint8).reshape(2, 2, 1))) & 3) << 4  # run r: bits 2r, 2r+1
    elif w.qtype.name == "Q8_0":
        out = b[:, 2:34] ^ np.uint8(128)
    else:
        raise ValueError(f"{w.qtype.name} has no codes here")
    return np.ascontiguousarray(out).reshape(N, K)


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
    codes = all_codes(w)
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
