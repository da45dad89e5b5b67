// GGUF Q4_K, Q6_K, Q5_0 and Q8_0 weights run from their own blocks (kquant.cpp), repacked per 16
// outputs at load (kquant_repack.cpp), times activations quantized per block of 32 to int8.
#pragma once
#include <ATen/core/Tensor.h>

#define SPECEE_KQ_INLINE __attribute__((always_inline)) inline  // kquant_codes.h, kquant_tile.h: registers, not memory

constexpr int64_t kQ50 = 6, kQ80 = 8, kQ4K = 12, kQ6K = 14;  // GGUF type numbers
constexpr int kGroupTiles = 4;  // tiles whose blocks interleave: one group, one parallel task
constexpr int64_t kQ4Bytes = 2304, kQ6Bytes = 3360;  // a tile's bytes per 256 inputs (layout: kquant.cpp)
constexpr int64_t kQ5Bytes = 352, kQ8Bytes = 544;  // per 32 inputs

// A tile's bytes per block of its type, and the block's inputs.
constexpr int64_t kquant_block_bytes(int64_t type) {
  return type == kQ6K ? kQ6Bytes : type == kQ4K ? kQ4Bytes : type == kQ80 ? kQ8Bytes : kQ5Bytes;
}
constexpr int64_t kquant_block_inputs(int64_t type) { return type == kQ4K || type == kQ6K ? 256 : 32; }

// x [M, K] float32 or bf16; packed: uint8, the tiles' bytes; tiles: int64 [T, 4], tile t's (byte
// offset of its group's first block in packed, GGUF type: 6 Q5_0 / 8 Q8_0 / 12 Q4_K / 14 Q6_K, tiles
// in its group, its place there) for outputs 16 t .. 16 t + 15 (layout: kquant.cpp). float32 [M, 16 T].
at::Tensor kquant_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& tiles, const at::Tensor& out = {});

// Every tile's entry is a tile of one of those types inside packed, for inputs of width K (a multiple
// of its type's block): checked once when a linear is built (model/quant_gguf.py), not on every
// product of the decode loop.
void kquant_check(const at::Tensor& packed, const at::Tensor& tiles, int64_t K);

// GGUF blocks of type qtype (Q5_0 / Q8_0 / Q4_K / Q6_K), blocks uint8 [N, K / block * bytes] with N a
// multiple of 16, rewritten into out (uint8, as many bytes) in kquant.cpp's layout: tiles of 16 rows in
// groups of kGroupTiles (fewer at the end), each group's tiles at byte 16 t0 x (bytes per row) for its
// first tile t0. Returns the tiles' entries for kquant_mm (int64 [N / 16, 4]) when out starts at byte
// `at` of the packed buffer.
at::Tensor kquant_repack(const at::Tensor& blocks, int64_t qtype, int64_t K, at::Tensor& out, int64_t at);

// GGUF Q8_0 rows as float32: table uint8 [N, K / 32 * 34] (each block a float16 d, then 32 int8 q;
// w = d q, gguf's own dequantization), ids int64 [n] -> float32 [n, K]. An embedding lookup and a
// quantized head's rescored rows, every step: gguf's numpy path took 30-150 us a call of Python.
at::Tensor q8_0_rows(const at::Tensor& table, const at::Tensor& ids);
