// int4 weights times int8 activations: llama.cpp's arithmetic for Q4_1 x Q8_1, on specee's weight
// layout (int4_common.h). Each row's activations are quantized per block of 32 inputs (the weight
// groups; quantize_q8.cpp) to x_q with scale d. Per group and output the dot product of the nibbles
// q (0..15) with x_q is an exact int32 (at most 32 x 15 x 127), and
//     y += (s d) acc + (z - 8 s) (d sum_k x_q,k)        (float32)
// since W = (q - 8) s + z. Why: integer dot products are 64 multiply-adds per `vpdpbusd` against
// 32 per `vdpbf16ps`, so a verification pass's extra rows cost little next to reading the weights.
// Paths (the level int4_matmul.cpp dispatches on): avx512 `vpdpbusd` (u8 x s8); avx2 `vpmaddubsw`
// (pairs of inputs into one wrapping int16 sum per output and group, exact as sum (q - 8) x_q: rows_avx2);
// portable int32 loops. The int32 sums are the same at every level; the float32
// combination differs only by FMA against multiply-then-add. Up to 8 rows share each tile's
// unpacking; a row's operations are the same whatever rows share the call.
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>

#include "int4_common.h"
#include "int4_matmul.h"
#include "scratch.h"

namespace specee_int4 {
namespace {

using specee_scratch::Scratch;

// Quantized activations of some rows: q [R][K] int8 (read 4 at a time as int32), and per row and
// group d and d times the group's sum of q.
struct Q8 {
  const int8_t* q;
  const float* d;
  const float* ds;
  const int32_t* pairs;  // the AVX2 path's copy of q (pairs_avx2), [R][K / 2]; null at other levels
  const int32_t* sums;   // the AVX2 path's sums of q per 16 inputs [R][K / 16] (quantize_activations); null elsewhere
  int32_t q4(int64_t K, int r, int64_t i) const {  // inputs 4 i .. 4 i + 3 of row r
    int32_t v;
    std::memcpy(&v, q + r * K + 4 * i, 4);
    return v;
  }
};

// A 64-output block's weights and scales. rows_avx2's `next`: the block a unit streams into L2 while it works
// from cache, the next block of the thread's units when this unit is the last of several over its own block
// (already read by the first), else none (w null). Why: an 8-row step's first 4-row unit of a block read it
// from memory at 4 rows' pace and the second read nothing, so the reads came in bursts at the memory's limit
// (SmolLM2 Q4_1, 2 AMD EPYC Zen 3 cores: 8 rows over every layer 12.9 ms from memory, 11.4 from cache).
struct Block {
  const uint8_t* w;
  const uint16_t* sz;
};

// The R rows' 64 outputs of a block at y (row r at y + r N) set to zero, for the paths that add
// each group into them. On x86 in 16-byte stores: GCC made std::fill_n a `rep stos`, whose start-up took
// 4% of rows_avx2's samples (AMD EPYC Zen 3)
void zero_rows(float* y, int R, int64_t N) {
#ifdef SPECEE_X86
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 64; i += 4) _mm_storeu_ps(y + r * N + i, _mm_setzero_ps());
#else
  for (int r = 0; r < R; ++r) std::fill_n(y + r * N, 64, 0.f);
#endif
}


#ifdef SPECEE_X86
// One row's 16 float sums f of a tile plus a group: f + (s d) acc + (z - 8 s) ds (d, ds: the row's
// activation step and step times sum), the combination both AVX-512 paths use, so a row's bits do
// not depend on the path it took.
SPECEE_INT4_AVX512 inline __m512 add_group(__m512 f, __m512i acc, const TileScales& sc, float d, float ds) {
  const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(sc.s, _mm512_set1_ps(d)), f);
  return _mm512_fmadd_ps(sc.z8, _mm512_set1_ps(ds), v);
}

// 1 to 4 rows x group g of one 64-output block, added into y (row r's block at y + r N).
template <int R>
SPECEE_INT4_AVX512 __attribute__((always_inline)) inline void group_avx512(const uint8_t* w, const uint16_t* sz,
                                                                           const Q8& x, int64_t K, int64_t g, float* y,
                                                                           int64_t N) {
  const int64_t G = K / kGroup;
  __m512i acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < 4; ++t) acc[r][t] = _mm512_setzero_si512();
#pragma GCC unroll 8  // else GCC copies every accumulator around each destructive vpdpbusd
  for (int c = 0; c < kGroup / 4; ++c) {
    for (int t = 0; t < 4; ++t) {
      const __m512i u = unpack16(w + (g * (kGroup / 4) + c) * 128 + t * 32);
      for (int r = 0; r < R; ++r)
        acc[r][t] = _mm512_dpbusd_epi32(acc[r][t], u, _mm512_set1_epi32(x.q4(K, r, g * (kGroup / 4) + c)));
    }
  }
  for (int t = 0; t < 4; ++t) {
    const TileScales sc = tile_scales(sz + g * 128, t);
    for (int r = 0; r < R; ++r) {
      float* o = y + r * N + 16 * t;
      _mm512_storeu_ps(o, add_group(_mm512_loadu_ps(o), acc[r][t], sc, x.d[r * G + g], x.ds[r * G + g]));
    }
  }
}

// 5 to 8 rows: two of the block's 4 tiles at a time over all groups, the float sums in registers
// until the end. The group-by-group path has no registers left past 4 rows (R x 4 int32 sums), so
// it ran rows 5-8 from a copy of the unpacked tiles in memory and stored and reloaded the float sums
// every group. 8 rows on one AMD EPYC Zen 4 core, GMAC/s: 102-114 -> 146-150 with the weights in
// cache, 77 -> 111 from memory. (One tile a pass ran 147-153 in cache and 98 from memory, too little
// arithmetic to hide the reads; 3-4 rows gain in cache and lose from memory, so they stay group by
// group.) Both paths combine each group with add_group. tiles: the block's unpacked tiles (unpack_avx512) when
// Unpacked, read instead of widening w's (a prompt's rows, kUnpackUnitsAvx512). half: 0 or 1 for one pass
// (tiles 0-1 or 2-3: int4_mm_q8's half-block units), -1 for both.
template <int R, bool Unpacked>
SPECEE_INT4_AVX512 void rows_avx512(const uint8_t* w, const uint16_t* sz, const Q8& x, int64_t K, float* y, int64_t N,
                                    const uint8_t* tiles, int half) {
  constexpr int T = 2;
  const int64_t G = K / kGroup;
  for (int t0 = std::max(0, 2 * half); t0 < (half < 0 ? 4 : 2 * half + 2); t0 += T) {
    __m512 f[R][T];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) f[r][t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      if (!Unpacked && t0 == std::max(0, 2 * half)) prefetch_group(w, sz, g, R);  // a later pass finds it in cache
      __m512i acc[R][T];
      for (int r = 0; r < R; ++r)
        for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int c = 0; c < kGroup / 4; ++c) {
        __m512i u[T];
        for (int t = 0; t < T; ++t) {
          const int64_t at = (g * (kGroup / 4) + c) * 128 + (t0 + t) * 32;
          u[t] = Unpacked ? _mm512_loadu_si512(tiles + 2 * at) : unpack16(w + at);
        }
        for (int r = 0; r < R; ++r) {
          const __m512i xb = _mm512_set1_epi32(x.q4(K, r, g * (kGroup / 4) + c));
          for (int t = 0; t < T; ++t) acc[r][t] = _mm512_dpbusd_epi32(acc[r][t], u[t], xb);
        }
      }
      for (int t = 0; t < T; ++t) {
        const TileScales sc = tile_scales(sz + g * 128, t0 + t);
        for (int r = 0; r < R; ++r) f[r][t] = add_group(f[r][t], acc[r][t], sc, x.d[r * G + g], x.ds[r * G + g]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) _mm512_storeu_ps(y + r * N + 16 * (t0 + t), f[r][t]);
  }
}

// 1-4 rows group by group, so the weights stream once; more: rows_avx512. y written.
template <int R>
SPECEE_INT4_AVX512 void block_avx512(const uint8_t* w, const uint16_t* sz, const Q8& x, int64_t K, float* y, int64_t N,
                                     const uint8_t* tiles, int half) {
  if constexpr (R > 4) {
    if (tiles)
      rows_avx512<R, true>(w, sz, x, K, y, N, tiles, half);
    else
      rows_avx512<R, false>(w, sz, x, K, y, N, tiles, half);
  } else {
    zero_rows(y, R, N);
    for (int64_t g = 0; g < K / kGroup; ++g) {
      prefetch_group(w, sz, g, R);
      group_avx512<R>(w, sz, x, K, g, y, N);
    }
  }
}

// Rows an AVX2 call takes: a row needs one int16 sum a tile (rows_avx2), and 8 sums, the weights and a
// broadcast fill 16 registers. The units int4_mm_q8 hands its threads hold at most this many rows, so an
// 8-row step's blocks split evenly over 2 threads (SmolLM2's 9 blocks of 64 outputs: 18 units, not 9 as 5
// against 4, which left a thread waiting a tenth of the step).
constexpr int kAvx2Rows = 4;

// Each row's quantized inputs as rows_avx2 reads them: per 4 inputs x0..x3 the 32-bit words (x0 x1 x0 x1)
// and (x2 x3 x2 x3), so one broadcast serves a tile's low nibbles (each output's inputs 0 and 1) and one
// its high nibbles (inputs 2 and 3). n: a multiple of 16.
SPECEE_INT4_AVX2 void pairs_avx2(const int8_t* q, int64_t n, int32_t* pairs) {
  const __m256i spread = _mm256_setr_epi8(0, 1, 0, 1, 2, 3, 2, 3, 4, 5, 4, 5, 6, 7, 6, 7,  //
                                          8, 9, 8, 9, 10, 11, 10, 11, 12, 13, 12, 13, 14, 15, 14, 15);
  for (int64_t i = 0; i < n; i += 16) {
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs + i / 2), _mm256_shuffle_epi8(v, spread));
  }
}

// One of rows_avx2's int16 sums, k = t R + r: tile t's low (h 0) or high (h 1) nibbles times row r's
// pairs. The empty asm keeps each sum in its own register: without it GCC 12 kept some on the stack or
// moved them between registers every step (with 16 registers).
#define SPECEE_AVX2_SUM(k)                                                                      \
  if constexpr (k < R * T) {                                                                    \
    a##k = _mm256_add_epi16(a##k, _mm256_maddubs_epi16(u[k / R][h], b[k % R]));                 \
    asm volatile("" : "+x"(a##k));                                                              \
  }

// A tile's 32 bytes at p split into its low nibbles (u[0], int16 lane o: inputs 0, 1 of output o) and its
// high nibbles (u[1]: inputs 2, 3), one per byte
SPECEE_INT4_AVX2 inline void nibbles(const uint8_t* p, __m256i (&u)[2]) {
  const __m256i nibble = _mm256_set1_epi8(0x0F), raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  u[0] = _mm256_and_si256(raw, nibble);
  u[1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
}

// A block's tiles unpacked for rows_avx2<R, true>: per 32 bytes of w (a tile's 4 inputs), its low nibbles'
// 32 bytes, then its high nibbles'. int4_mm_q8 unpacks a block once for all of a prompt's 4-row units over
// it, where each unit unpacked it again (an AND, a shift and an AND a tile and 4 inputs, beside 8
// multiply-adds and 8 adds). SmolLM2's four products of a layer at 512 rows, 2 AMD EPYC Zen 3 cores, old and
// new build alternating: 19.7 -> 17.5 ms (median of 10 pairs' ratios 1.09x), the same bits. With few units a
// block unpacking first costs more than it saves (kUnpackUnits).
SPECEE_INT4_AVX2 void unpack_avx2(const uint8_t* w, int64_t K, uint8_t* tiles) {
  for (int64_t i = 0; i < (K / 4) * 128; i += 32) {
    __m256i u[2];
    nibbles(w + i, u);
    _mm256_store_si256(reinterpret_cast<__m256i*>(tiles + 2 * i), u[0]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(tiles + 2 * i + 32), u[1]);
  }
}

// A block's tiles unpacked for rows_avx512<R, true>: unpack16 of each tile's 32 bytes, 64 bytes each in w's order.
SPECEE_INT4_AVX512 void unpack_avx512(const uint8_t* w, int64_t K, uint8_t* tiles) {
  for (int64_t i = 0; i < (K / 4) * 128; i += 32) _mm512_storeu_si512(tiles + 2 * i, unpack16(w + i));
}

// 1 to 4 rows, T tiles of 16 outputs side by side (R T <= 8 sums). A tile's 32 bytes split into low nibbles
// (int16 lane o: inputs 0, 1 of output o) and high nibbles (inputs 2, 3): two ANDs and a shift, not
// block_avx512's widening. One int16 sum per row and tile covers a whole group: it starts at -8 sum_k x_q,k
// (mod 2^16) and the pairs' products add with wrapping adds, so it ends at sum_k (q_k - 8) x_q,k, at most
// 32 x 8 x 127 < 2^15 and so exact, though sum_k q_k x_q,k itself does not fit. Widened (even outputs, odd
// outputs) and plus 8 sum_k x_q,k it is the int32 sum of the other levels, and the float32 combination is
// theirs, so the outputs are the same bits. Half the sums of a pair per output (lo, hi) let 4 rows take 2
// tiles a pass, one broadcast of a row's pair serving both (one AMD EPYC Zen 3 core, 576 x 3072 in cache,
// against the lo/hi pairs: 4 rows 3-5%, 2 rows 11%, 1 row the same).
// tiles: the block's unpacked tiles (unpack_avx2) when Unpacked, read instead of unpacking w.
template <int R, bool Unpacked, int T = (R <= 2 ? 4 : 2)>
SPECEE_INT4_AVX2 void rows_avx2(const uint8_t* w, const uint16_t* sz, const Q8& x, int64_t K, float* y, int64_t N,
                                const Block& next, const uint8_t* tiles) {
  const int64_t G = K / kGroup;
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  zero_rows(y, R, N);
  for (int64_t g = 0; g < G; ++g) {
    if (next.w)
      prefetch_block_group(next.w, next.sz, g);
    else
      prefetch_group(w, sz, g, R);
    const int32_t* xg[R];        // each row's pairs of group g
    float d[R], ds[R];           // and its activation step and step times sum (read once, not per tile)
    __m256i start[R], eight[R];  // -8 and 8 times its sum of x_q (unsigned: NaN rows' sums are garbage)
    for (int r = 0; r < R; ++r) {
      xg[r] = x.pairs + r * (K / 2) + g * (kGroup / 2), d[r] = x.d[r * G + g], ds[r] = x.ds[r * G + g];
      const uint32_t sum = static_cast<uint32_t>(x.sums[r * 2 * G + 2 * g]) + static_cast<uint32_t>(x.sums[r * 2 * G + 2 * g + 1]);
      start[r] = _mm256_set1_epi16(static_cast<int16_t>(static_cast<uint16_t>(0u - 8u * sum)));
      eight[r] = _mm256_set1_epi32(static_cast<int32_t>(8u * sum));
    }
    for (int t0 = 0; t0 < 4; t0 += T) {
      __m256i a0 = start[0], a1 = start[1 % R], a2 = start[2 % R], a3 = start[3 % R], a4 = start[4 % R],
              a5 = start[5 % R], a6 = start[6 % R], a7 = start[7 % R];
      const int64_t at = g * (kGroup / 4) * 128 + t0 * 32;  // the pass's first tile in w (in tiles: twice that)
#pragma GCC unroll 1
      for (int c = 0; c < kGroup / 4; ++c) {
        __m256i u[T][2];  // tile t's low (h 0) and high (h 1) nibbles
        for (int t = 0; t < T; ++t) {
          if constexpr (Unpacked) {
            const uint8_t* p = tiles + 2 * (at + c * 128 + t * 32);
            u[t][0] = _mm256_load_si256(reinterpret_cast<const __m256i*>(p));
            u[t][1] = _mm256_load_si256(reinterpret_cast<const __m256i*>(p + 32));
          } else {
            nibbles(w + at + c * 128 + t * 32, u[t]);
          }
        }
        for (int h = 0; h < 2; ++h) {
          __m256i b[R];
          for (int r = 0; r < R; ++r) b[r] = _mm256_set1_epi32(xg[r][2 * c + h]);
          SPECEE_AVX2_SUM(0) SPECEE_AVX2_SUM(1) SPECEE_AVX2_SUM(2) SPECEE_AVX2_SUM(3)
          SPECEE_AVX2_SUM(4) SPECEE_AVX2_SUM(5) SPECEE_AVX2_SUM(6) SPECEE_AVX2_SUM(7)
        }
      }
      const __m256i sums[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
      for (int t = 0; t < T; ++t) {
        const uint16_t* szt = sz + g * 128 + (t0 + t) * 16;  // bf16: even outputs the low halves of 32-bit lanes
        const __m256i s16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(szt));
        const __m256i z16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(szt + 64));
        const __m256 s[2] = {_mm256_castsi256_ps(_mm256_slli_epi32(s16, 16)), _mm256_castsi256_ps(_mm256_and_si256(s16, high))};
        const __m256 z8[2] = {
            _mm256_fnmadd_ps(_mm256_set1_ps(8.f), s[0], _mm256_castsi256_ps(_mm256_slli_epi32(z16, 16))),
            _mm256_fnmadd_ps(_mm256_set1_ps(8.f), s[1], _mm256_castsi256_ps(_mm256_and_si256(z16, high)))};
        for (int r = 0; r < R; ++r) {
          const __m256i a = sums[t * R + r];
          const __m256i acc[2] = {_mm256_add_epi32(_mm256_srai_epi32(_mm256_slli_epi32(a, 16), 16), eight[r]),
                                  _mm256_add_epi32(_mm256_srai_epi32(a, 16), eight[r])};
          for (int e = 0; e < 2; ++e) {
            float* o = y + r * N + (t0 + t) * 16 + e * 8;
            const __m256 sd = _mm256_mul_ps(s[e], _mm256_set1_ps(d[r]));
            const __m256 v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[e]), sd, _mm256_loadu_ps(o));
            _mm256_storeu_ps(o, _mm256_fmadd_ps(z8[e], _mm256_set1_ps(ds[r]), v));
          }
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < 4; ++t) {  // even outputs, odd outputs -> 0-15
      float* o = y + r * N + t * 16;
      const __m256 even = _mm256_loadu_ps(o), odd = _mm256_loadu_ps(o + 8);
      const __m256 lo = _mm256_unpacklo_ps(even, odd), hi = _mm256_unpackhi_ps(even, odd);  // 0-3 8-11, 4-7 12-15
      _mm256_storeu_ps(o, _mm256_permute2f128_ps(lo, hi, 0x20));
      _mm256_storeu_ps(o + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
    }
}
#undef SPECEE_AVX2_SUM

#endif  // SPECEE_X86

// The same int32 sums in plain loops (any CPU); multiply, then add; y written.
template <int R>
void block_portable(const uint8_t* w, const uint16_t* sz, const Q8& x, int64_t K, float* y, int64_t N) {
  const int64_t G = K / kGroup;
  zero_rows(y, R, N);
  for (int64_t g = 0; g < G; ++g) {
    const uint16_t* szg = sz + g * 128;
    for (int t = 0; t < 4; ++t) {
      int32_t acc[R][16] = {};
      for (int c = 0; c < kGroup / 4; ++c) {
        const uint8_t* wc = w + (g * (kGroup / 4) + c) * 128 + t * 32;
        int32_t q[16][4];  // unpacked once for all rows: byte 2 lane + e -> inputs e and 2 + e
        for (int lane = 0; lane < 16; ++lane)
          for (int e = 0; e < 2; ++e) q[lane][e] = wc[2 * lane + e] & 15, q[lane][2 + e] = wc[2 * lane + e] >> 4;
        for (int r = 0; r < R; ++r) {
          const int8_t* xq = x.q + r * K + g * kGroup + c * 4;
          for (int lane = 0; lane < 16; ++lane)
            acc[r][lane] += q[lane][0] * xq[0] + q[lane][1] * xq[1] + q[lane][2] * xq[2] + q[lane][3] * xq[3];
        }
      }
      for (int lane = 0; lane < 16; ++lane) {
        const float s = bf16_to_float(szg[t * 16 + lane]), z8 = bf16_to_float(szg[64 + t * 16 + lane]) - 8.f * s;
        for (int r = 0; r < R; ++r) {
          float& out = y[r * N + t * 16 + lane];
          const float sd = s * x.d[r * G + g];
          out += static_cast<float>(acc[r][lane]) * sd;
          out += z8 * x.ds[r * G + g];
        }
      }
    }
  }
}

template <int R>
void rows_at(int64_t level, const uint8_t* w, const uint16_t* sz, const Q8& x, int64_t K, float* y, int64_t N,
             const Block& next, const uint8_t* tiles, int half) {
#ifdef SPECEE_X86
  if (level == kAvx512) return block_avx512<R>(w, sz, x, K, y, N, tiles, half);
  if constexpr (R <= kAvx2Rows)  // int4_mm_q8's units at AVX2 hold no more
    if (level == kAvx2)
      return tiles ? rows_avx2<R, true>(w, sz, x, K, y, N, next, tiles) : rows_avx2<R, false>(w, sz, x, K, y, N, next, tiles);
#endif
  block_portable<R>(w, sz, x, K, y, N);
}

constexpr int kMaxRows = 8;  // a verification pass's rows share each tile's unpacking
// unpack_avx2 runs where a block has at least this many 4-row units (a prompt's part, not a decode step or a
// verification pass of up to 20 rows) and its tiles fit L2 beside the activations (K x 64 bytes: SmolLM2's 36
// and 96 KB). One AMD EPYC Zen 3 core, SmolLM2's shapes, unpacking first against as they go: 12-16 rows (3-4
// units) 0.92-0.97x, 20 rows 0.94-1.02x, 24 rows 1.00-1.09x, 32 rows 1.02-1.05x, 512 rows 1.06-1.21x.
constexpr int64_t kUnpackUnits = 6;
// At AVX-512 each 8-row unit widens every tile's 32 bytes (unpack16) in each of its two passes; a block unpacked
// first (unpack_avx512) pays from 16 units. SmolLM2's 120 products, 2 AMD EPYC Zen 4 cores, the two ways
// alternating in one process: 64 rows 0.97x, 128 rows 1.03x, 256 1.04x, 512 1.03x, 1,010 1.06-1.07x.
constexpr int64_t kUnpackUnitsAvx512 = 16;
constexpr int64_t kUnpackMaxInputs = 4096;
// Activations whose quantization the threads share inside a product's parallel region (int4_mm_q8): from
// 4 SmolLM2 rows of 576 inputs (18 groups a row)
constexpr int64_t kSplitQuantizeGroups = 72;

// The calling thread's buffer for one block's unpacked tiles (K x 64 bytes), kept between calls; reached only
// where a product unpacks, so a decode step's products do not touch it
uint8_t* thread_tiles(int64_t K) {
  thread_local Scratch buf;
  return buf.at_least<uint8_t>(K * 64);
}

constexpr decltype(&rows_at<1>) kRows[kMaxRows + 1] = {nullptr,     rows_at<1>, rows_at<2>, rows_at<3>, rows_at<4>,
                                                       rows_at<5>, rows_at<6>, rows_at<7>, rows_at<8>};

}  // namespace

at::Tensor int4_mm_q8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t level,
                      const at::Tensor& out_rows) {
  const at::Tensor xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);  // bf16 widens exactly
  const int64_t M = xf.size(0), K = xf.size(1), blocks = packed.size(0), N = blocks * 64, G = K / kGroup;
  thread_local Scratch q_buf, d_buf, ds_buf;  // the calling thread's, kept between calls
  int8_t* q = q_buf.at_least<int8_t>(M * K);
  float* d = d_buf.at_least<float>(M * G);
  float* ds = ds_buf.at_least<float>(M * G);
  thread_local Scratch pairs_buf, sums_buf;
  int32_t* const pairs = level == kAvx2 ? pairs_buf.at_least<int32_t>(M * K / 2) : nullptr;
  int32_t* const sums = level == kAvx2 ? sums_buf.at_least<int32_t>(M * K / 16) : nullptr;
  at::Tensor y = product_output(out_rows, M, N, false);
  const float* xs = xf.data_ptr<float>();
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const uint16_t* sz = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  float* out = y.data_ptr<float>();
  // units of (64-output block, up to kMaxRows rows, kAvx2Rows at AVX2), block by block (its weights stay in
  // cache over its rows): the threads split a prompt's rows, not only its blocks (SmolLM2's 9 or 15 blocks
  // of 64 outputs left one of two threads idle a tenth of the time). Where a step's few rows (one unit a
  // block) leave the blocks uneven over the threads, units are half blocks (AVX-512, 5-8 rows: rows_avx512's
  // passes), so each thread takes the same share (SmolLM2's o and down: 9 blocks, 4.5 each)
  const int64_t threads = std::max(1, at::get_num_threads());
  const int64_t unit = level == kAvx2 ? kAvx2Rows : kMaxRows;
  const int64_t chunks = (M + unit - 1) / unit;
  const int64_t halves = level == kAvx512 && chunks == 1 && M > 4 && blocks % threads ? 2 : 1;
  const int64_t units = blocks * chunks * halves;
  const int64_t unpack_units = level == kAvx2 ? kUnpackUnits : level == kAvx512 ? kUnpackUnitsAvx512 : 0;
  const bool unpack = unpack_units && chunks >= unpack_units && K <= kUnpackMaxInputs;
  const auto block = [&](int64_t b) { return Block{w + b * (K / 4) * 128, sz + b * G * 128}; };
  // One parallel region: each share first quantizes its part of the activations (groups of 32, row after
  // row), meets the others, then runs its units (as at::parallel_for would split them). Why: quantized
  // before the region, a decode step's 8 rows took one thread 9 us a SmolLM2 layer (5% of it) while the
  // other waited. Fewer activations (kSplitQuantizeGroups) are quantized first, as before: for one row the
  // meeting cost more than the split saved (AMD EPYC Zen 4, 2.92-3.05 -> 3.04-3.13 ms a SmolLM2 token).
  const int64_t groups = M * G;
  const bool split = threads > 1 && groups >= kSplitQuantizeGroups;
  const auto quantize_share = [&](int64_t g0, int64_t g1) {
    quantize_groups(xs, g0, g1, level, q, d, ds, sums);
#ifdef SPECEE_X86
    if (pairs) pairs_avx2(q + g0 * kGroup, (g1 - g0) * kGroup, pairs + g0 * kGroup / 2);
#endif
  };
  if (!split) quantize_share(0, groups);
  std::atomic<int64_t> quantized{split ? 0 : threads};
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    if (split) {
      const int64_t share = (groups + threads - 1) / threads;
      quantize_share(std::min(groups, t0 * share), std::min(groups, t1 * share));
      quantized.fetch_add(t1 - t0, std::memory_order_acq_rel);
      wait_for(quantized, threads);
    }
    const int64_t per = (units + threads - 1) / threads;
    const int64_t h0 = std::min(units, t0 * per), h1 = std::min(units, t1 * per);
    if (h0 == h1) return;
    uint8_t* const tiles = unpack ? thread_tiles(K) : nullptr;
    const int64_t u0 = h0 / halves, u1 = (h1 + halves - 1) / halves;
    for (int64_t u = u0; u < u1; ++u) {
      // a half block where the share holds one of its halves: the first (tiles 0-1) or the second (2-3)
      const int half = halves == 1 || (2 * u >= h0 && 2 * u + 2 <= h1) ? -1 : 2 * u < h0 ? 1 : 0;
      const int64_t b = u / chunks, r = u % chunks * unit, R = std::min<int64_t>(unit, M - r);
      const Q8 rows{q + r * K, d + r * G, ds + r * G, pairs ? pairs + r * (K / 2) : nullptr,
                    sums ? sums + r * (K / 16) : nullptr};
      const bool streams_next = chunks > 1 && u % chunks == chunks - 1 && (b + 1) * chunks < u1;
      const Block own = block(b), next = streams_next ? block(b + 1) : Block{nullptr, nullptr};
#ifdef SPECEE_X86
      if (unpack && (u == u0 || u % chunks == 0))  // the thread's first unit over block b
        level == kAvx2 ? unpack_avx2(own.w, K, tiles) : unpack_avx512(own.w, K, tiles);
#endif
      kRows[R](level, own.w, own.sz, rows, K, out + r * N + b * 64, N, next, tiles, half);
    }
  });
  return y;
}

}  // namespace specee_int4
