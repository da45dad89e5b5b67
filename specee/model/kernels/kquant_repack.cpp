// GGUF Q4_K / Q6_K / Q5_0 / Q8_0 blocks rewritten into kquant.cpp's layout (its header comment) in
// one pass, a group of tiles per task. Why here and not numpy: the same bytes came out of a dozen
// whole-array numpy passes at 1.7-4.7 ms a million weights (a third of Qwen2.5-Coder-1.5B's load
// on an Intel Xeon); tests/kquant_layout.py keeps that numpy version as the reference.
//
// Codes per block, ggml-quants.c's dequantize_row_* (tests/test_gguf_load.py checks block_codes,
// the same reading in numpy, against gguf's dequantization):
//   Q8_0  d, 32 int8: code = q + 128
//   Q5_0  d, 32 fifth bits (little-endian word), 16 bytes: input j low nibble, j + 16 high
//   Q4_K  d, dmin, 12 scale bytes, 128 bytes: run r of 64 inputs, 32 bytes, l low, 32 + l high
//   Q6_K  128 bytes low (per half of 128: 64), 64 bytes high 2 bits (per half: 32), 16 int8 scales, d
#include "kquant.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

constexpr int kLanes = 16;  // outputs in a tile

struct Format {
  int64_t inputs, bytes;  // one block in the file
  int64_t vectors, tail;  // a tile's 64-byte vectors and tail bytes per block
};

Format format(int64_t qtype) {
  switch (qtype) {
    case kQ80: return {32, 34, 8, 32};
    case kQ50: return {32, 22, 5, 32};
    case kQ4K: return {256, 144, 36, 0};
    case kQ6K: return {256, 210, 52, 32};
  }
  TORCH_CHECK(false, "kquant_repack: GGML type ", qtype, " has no kquant.cpp layout (Q5_0, Q8_0, Q4_K, Q6_K do)");
}

// The unsigned codes of one block (32 or 256 inputs) into q.
void codes(int64_t qtype, const uint8_t* b, uint8_t* q) {
  switch (qtype) {
    case kQ80:
      for (int i = 0; i < 32; ++i) q[i] = b[2 + i] ^ 0x80;
      break;
    case kQ50: {
      uint32_t fifth;
      std::memcpy(&fifth, b + 2, 4);  // GGUF is little-endian, as every CPU this builds for
      for (int j = 0; j < 16; ++j) {
        q[j] = (b[6 + j] & 15) | ((fifth >> j) & 1) << 4;
        q[j + 16] = (b[6 + j] >> 4) | ((fifth >> (j + 16)) & 1) << 4;
      }
      break;
    }
    case kQ4K:
      for (int r = 0; r < 4; ++r)
        for (int l = 0; l < 32; ++l) {
          q[64 * r + l] = b[16 + 32 * r + l] & 15;
          q[64 * r + 32 + l] = b[16 + 32 * r + l] >> 4;
        }
      break;
    case kQ6K:
      for (int n = 0; n < 2; ++n) {
        const uint8_t *ql = b + 64 * n, *qh = b + 128 + 32 * n;
        uint8_t* y = q + 128 * n;
        for (int l = 0; l < 32; ++l) {
          y[l] = (ql[l] & 15) | (qh[l] & 3) << 4;
          y[l + 32] = (ql[l + 32] & 15) | ((qh[l] >> 2) & 3) << 4;
          y[l + 64] = (ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4;
          y[l + 96] = (ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4;
        }
      }
      break;
  }
}

// One tile's bytes for one block: raw[o] is output o's block in the file, tb the tile-block.
void tile_block(int64_t qtype, const uint8_t* const* raw, uint8_t* tb) {
  uint8_t q[kLanes][256];
  for (int o = 0; o < kLanes; ++o) codes(qtype, raw[o], q[o]);
  auto nibbles = [&](int blocks) {  // vector 4 b + a, lane o, byte e: inputs 32 b + 8 a + e and + 4
    for (int b = 0; b < blocks; ++b)
      for (int a = 0; a < 4; ++a)
        for (int o = 0; o < kLanes; ++o)
          for (int e = 0; e < 4; ++e) {
            const uint8_t* c = q[o] + 32 * b + 8 * a + e;
            tb[256 * b + 64 * a + 4 * o + e] = (c[0] & 15) | (c[4] & 15) << 4;
          }
  };
  auto lanes = [&](uint8_t* out, int first, int n, int word) {  // the n / word words in turn, 16 lanes each
    for (int w = 0; w < n / word; ++w)
      for (int o = 0; o < kLanes; ++o) std::memcpy(out + (w * kLanes + o) * word, raw[o] + first + w * word, word);
  };
  switch (qtype) {
    case kQ80:
      for (int c = 0; c < 8; ++c)
        for (int o = 0; o < kLanes; ++o) std::memcpy(tb + 64 * c + 4 * o, q[o] + 4 * c, 4);
      lanes(tb + 512, 0, 2, 2);
      break;
    case kQ50:
      nibbles(1);
      for (int o = 0; o < kLanes; ++o)
        for (int e = 0; e < 4; ++e) {
          uint8_t bits = 0;
          for (int c = 0; c < 8; ++c) bits |= ((q[o][4 * c + e] >> 4) & 1) << c;
          tb[256 + 4 * o + e] = bits;
        }
      lanes(tb + 320, 0, 2, 2);
      break;
    case kQ4K:
      nibbles(8);
      lanes(tb + 2048, 4, 12, 4);
      lanes(tb + 2240, 0, 4, 2);
      break;
    case kQ6K:
      nibbles(8);
      for (int b = 0; b < 8; ++b)
        for (int h = 0; h < 2; ++h)
          for (int o = 0; o < kLanes; ++o)
            for (int e = 0; e < 4; ++e) {
              uint8_t bits = 0;
              for (int cc = 0; cc < 4; ++cc) bits |= ((q[o][32 * b + 16 * h + 4 * cc + e] >> 4) & 3) << (2 * cc);
              tb[2048 + 128 * b + 64 * h + 4 * o + e] = bits;
            }
      lanes(tb + 3072, 192, 16, 4);
      lanes(tb + 3328, 208, 2, 2);
      break;
  }
}

}  // namespace

at::Tensor kquant_repack(const at::Tensor& blocks, int64_t qtype, int64_t K, at::Tensor& out, int64_t at) {
  const Format f = format(qtype);
  TORCH_CHECK(blocks.dtype() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "kquant_repack: blocks must be contiguous uint8 [N, bytes per row]");
  const int64_t N = blocks.size(0), S = K / f.inputs, row = S * f.bytes;
  TORCH_CHECK(K % f.inputs == 0 && blocks.size(1) == row && N % kLanes == 0,
              "kquant_repack: ", N, " x ", K, " does not tile (rows by 16, inputs by ", f.inputs, ")");
  TORCH_CHECK(out.dtype() == at::kByte && out.is_contiguous() && out.numel() == blocks.numel(),
              "kquant_repack: out must be contiguous uint8 of the blocks' size");
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t tiles = N / kLanes, tile_bytes = kLanes * f.bytes;  // a tile-block: as many bytes as the file's
  at::Tensor entries = at::empty({tiles, 4}, at::kLong);
  int64_t* entry = entries.data_ptr<int64_t>();
  at::parallel_for(0, (tiles + kGroupTiles - 1) / kGroupTiles, 1, [&](int64_t g0, int64_t g1) {
    std::vector<uint8_t> tb(kGroupTiles * tile_bytes);
    const uint8_t* raw[kLanes];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t t0 = g * kGroupTiles, n = std::min<int64_t>(kGroupTiles, tiles - t0);
      uint8_t* o = dst + t0 * S * tile_bytes;
      for (int64_t j = 0; j < n; ++j) {  // (byte offset of the group, type, tiles in it, place)
        int64_t* e = entry + 4 * (t0 + j);
        e[0] = at + t0 * S * tile_bytes, e[1] = qtype, e[2] = n, e[3] = j;
      }
      for (int64_t s = 0; s < S; ++s) {
        for (int64_t j = 0; j < n; ++j) {
          for (int l = 0; l < kLanes; ++l) raw[l] = src + ((t0 + j) * kLanes + l) * row + s * f.bytes;
          tile_block(qtype, raw, tb.data() + j * tile_bytes);
        }
        for (int64_t v = 0; v < f.vectors; ++v)  // vector v of tile j at (v n + j) 64
          for (int64_t j = 0; j < n; ++j, o += 64) std::memcpy(o, tb.data() + j * tile_bytes + 64 * v, 64);
        for (int64_t j = 0; j < n; ++j, o += f.tail)  // then the tails
          std::memcpy(o, tb.data() + j * tile_bytes + 64 * f.vectors, f.tail);
      }
    }
  });
  return entries;
}
