// What the two int4 kernels share (int4_matmul.cpp: bf16 activations; int4_q8.cpp: int8
// activations): the weight layout's group, the dispatch levels, the instruction sets each level is
// compiled for, and reading the bf16 scales.
//
// Layout (model/quant.py packs it): 64 outputs at a time, 4 tiles of 16; for every 4 inputs c the
// 4 tiles' 32 bytes each: byte 2 lane + e holds input 4 c + e of output 16 t + lane in its low
// nibble and input 4 c + 2 + e in its high nibble. Scales: bf16 [N/64][G][s, z][64]; a weight is
// W = (q - 8) s + z.
#pragma once
#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <thread>

#if defined(__x86_64__)
#define SPECEE_X86 1  // the vector paths; elsewhere only the portable one is built
#include <immintrin.h>
// The avx512 level needs F, BW and VNNI (the int8 products, llama.cpp's arithmetic); the bf16 kernel's
// avx512 path needs BF16 too and, where the CPU lacks it (Ice Lake, or a hypervisor that hides it), that
// kernel runs its avx2 path while everything else stays at avx512.
#define SPECEE_INT4_AVX512 __attribute__((target("avx512f,avx512bw,avx512vnni")))
#define SPECEE_INT4_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))
#define SPECEE_INT4_AVX2 __attribute__((target("avx2,fma")))
#endif

namespace specee_int4 {

constexpr int64_t kGroup = 32;  // inputs per weight group (and per int8 activation block)

// Wait until `arrived` counts `all` (a spin barrier between a parallel region's threads); past a few thousand
// spins, yield the core: with more threads than free cores the one waited for may need it
inline void wait_for(const std::atomic<int64_t>& arrived, int64_t all) {
  for (int spins = 0; arrived.load(std::memory_order_acquire) < all; ++spins) {
    if (spins < 4096) {
#ifdef SPECEE_X86
      _mm_pause();
#endif
    } else {
      std::this_thread::yield();
    }
  }
}

enum Level : int64_t { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

inline float bf16_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Weights streamed ahead of the arithmetic go to L2 (prefetcht1), not L1: on the Intel Xeon with AMX
// (2 cores, KVM) perf put half of the 4-row K-quant product's samples on the instruction after a
// `prefetcht0`, stalled waiting for an L1 fill buffer; into L2 the loads find them 14 cycles away and
// the fill buffers stay free for the loads themselves. Qwen2.5-1.5B Q4_K_M, alternating builds: one
// row 45.7-47.1 -> 41.1-42.7 ms, 4 rows 56.8-59.6 -> 53.5-56.0; decode 21.6 -> 24.8 tokens/s (floor
// fraction 0.76 -> 0.93). Not yet measured on the AMD EPYCs.
inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

// Group g itself of the block at w, sz (weights and scales) into L2
inline void prefetch_block_group(const uint8_t* w, const uint16_t* sz, int64_t g) {
  const uint8_t* wa = w + g * (kGroup / 4) * 128;
  for (int i = 0; i < (kGroup / 4) * 128; i += 64) prefetch_l2(wa + i);
  const uint8_t* sa = reinterpret_cast<const uint8_t*>(sz + g * 128);
  for (int i = 0; i < 256; i += 64) prefetch_l2(sa + i);
}

// A group's weight bytes (kGroup / 4 x 128) and scales (2 x 64 bf16), kPrefetchGroups groups past
// group g of a block, into L2: a thread's blocks are contiguous, so this runs into its next
// block. Without it the int4 products streamed at 10-17 GB/s on an Intel Xeon whose two cores read
// 23 (SmolLM2's four products per layer 157 -> 110 us; 8 groups ahead was slower on small products).
// For a few rows it depends on the CPU's own prefetchers (an AMD EPYC Zen 4 decoded 1.26x faster
// without), so products of 1-3 rows prefetch only where g_prefetch says (int4_set_prefetch,
// measured at load: engine/threads.py); products of 4 rows or more, which compute longer per byte,
// always do (that Zen 4, 3072 x 576 from memory: 1 / 2 / 4 / 8 rows 46.0 / 50.2 / 55.0 / 101.7 us
// with, 35.8 / 39.8 / 53.9 / 122.2 without).
constexpr int64_t kPrefetchGroups = 4;
constexpr int kAlwaysPrefetchRows = 4;
inline std::atomic<bool> g_prefetch{true};
inline void prefetch_group(const uint8_t* w, const uint16_t* sz, int64_t g, int rows) {
  if (rows < kAlwaysPrefetchRows && !g_prefetch.load(std::memory_order_relaxed)) return;
  prefetch_block_group(w, sz, g + kPrefetchGroups);
}

#ifdef SPECEE_X86
SPECEE_INT4_AVX512 inline __m512 bf16x16_to_float(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// The 4-input groups of 16 outputs at p (32 bytes: byte 2 lane + e holds inputs e, 2 + e) as one
// int32 per output, bytes = inputs 0..3: (v | v << 12) & 0x0F0F0F0F on the widened byte pairs.
SPECEE_INT4_AVX512 inline __m512i unpack16(const uint8_t* p) {
  const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_ternarylogic_epi32(v, _mm512_slli_epi32(v, 12), _mm512_set1_epi32(0x0F0F0F0F), 0xA8);  // (A | B) & C
}

// Tile t's scales s and z - 8 s in a group (szg: the group's 2 x 64 bf16), once for all its rows
// (W = q s + (z - 8 s): int4_q8.cpp's products, amx_prompt.cpp's dequantization).
struct TileScales {
  __m512 s, z8;
};
SPECEE_INT4_AVX512 inline TileScales tile_scales(const uint16_t* szg, int t) {
  const __m512 s = bf16x16_to_float(szg + t * 16);
  return {s, _mm512_fnmadd_ps(_mm512_set1_ps(8.f), s, bf16x16_to_float(szg + 64 + t * 16))};
}

SPECEE_INT4_AVX2 inline __m256 bf16x8_to_float(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
#endif

constexpr int64_t kQuantizeGrain = 16384;  // activations worth quantizing in a parallel region

// Activations x [M, K] float32 quantized per block of 32 to int8 at `level`, rows split between
// threads (quantize_q8.cpp, for int4_q8.cpp and kquant.cpp): q [M, K], per block d = max|x| / 127 and d times the
// block's sum of q, and, if s16 is not null, the int32 sums of q per 16 inputs [M, K / 16].
void quantize_activations(const float* x, int64_t M, int64_t K, int64_t level, int8_t* q, float* d, float* ds,
                          int32_t* s16);

// The same for groups g0 .. g1 - 1 of x counted row after row (flat: group g at x + 32 g), one thread's share
void quantize_groups(const float* x, int64_t g0, int64_t g1, int64_t level, int8_t* q, float* d, float* ds,
                     int32_t* s16);

// int8 activations (int4_q8.cpp): x [M, K] float32 or bf16 times the packed weight, float32 [M, N].
at::Tensor int4_mm_q8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t level,
                      const at::Tensor& out = {});

}  // namespace specee_int4
