// int4 weights times int8 activations: llama.cpp's arithmetic for Q4_1 x Q8_1, on specee's weight
// layout (int4_common.h). Each row's activations are quantized per block of 32 inputs (the weight
// groups): d = max|x| / 127, x_q = round(x / d) to nearest even (x times the float32 1/d, as
// llama.cpp), and their sum. Per group and output the dot product of the nibbles q (0..15) with x_q
// is an exact int32 (at most 32 x 15 x 127), and
//     y += (s d) acc + (z - 8 s) (d sum_k x_q,k)        (float32)
// since W = (q - 8) s + z. Why: integer dot products are 64 multiply-adds per `vpdpbusd` against
// 32 per `vdpbf16ps`, so a verification pass's extra rows cost little next to reading the weights.
// Paths (the level int4_matmul.cpp dispatches on): avx512 `vpdpbusd` (u8 x s8); avx2 `vpmaddubsw`
// (pairs, exact in int16 for a whole group: at most 16 x 15 x 127) then `vpmaddwd`; portable int32
// loops. The int32 sums are the same at every level; the float32 combination differs only by FMA
// against multiply-then-add. Up to 8 rows share each tile's unpacking; a row's operations are the
// same whatever rows share the call.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

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
  int32_t q4(int64_t K, int r, int64_t i) const {  // inputs 4 i .. 4 i + 3 of row r
    int32_t v;
    std::memcpy(&v, q + r * K + 4 * i, 4);
    return v;
  }
};

float round_even(float v) {
#ifdef SPECEE_X86
  return static_cast<float>(_mm_cvtss_si32(_mm_set_ss(v)));  // the MXCSR's rounding: nearest even
#else
  return std::nearbyint(v);
#endif
}

// The R rows' 64 outputs of a block at y (row r at y + r N) set to zero, for the paths that add
// each group into them
void zero_rows(float* y, int R, int64_t N) {
  for (int r = 0; r < R; ++r) std::fill_n(y + r * N, 64, 0.f);
}

// Row by row, block by block: the same scalar operations at every level (what the tests rebuild);
// s16 (if not null): the int32 sums of q per 16 inputs (kquant.cpp's Q6_K halves). A block holding
// NaN or Inf gets d = NaN, so its row's outputs are NaN (the engine ends that request with an
// error): rounded, a NaN became code 0 and INT_MIN in the sum, finite numbers no check could see.
void quantize(const float* x, int64_t blocks, int8_t* q, float* d, float* ds, int32_t* s16) {
  for (int64_t i = 0; i < blocks; ++i) {
    const float* xb = x + i * kGroup;
    float amax = 0.f;
    bool finite = true;
    for (int64_t k = 0; k < kGroup; ++k) {
      amax = std::max(amax, std::fabs(xb[k]));
      finite = finite && std::isfinite(xb[k]);
    }
    const float step = amax / 127.f, inv = step != 0.f ? 1.f / step : 0.f;
    int32_t half[2] = {0, 0};
    for (int64_t k = 0; k < kGroup; ++k) {
      const int32_t v = static_cast<int32_t>(round_even(xb[k] * inv));
      q[i * kGroup + k] = static_cast<int8_t>(v);
      half[k / 16] += v;
    }
    d[i] = finite ? step : NAN;
    ds[i] = d[i] * static_cast<float>(half[0] + half[1]);
    if (s16) s16[2 * i] = half[0], s16[2 * i + 1] = half[1];
  }
}

#ifdef SPECEE_X86
// quantize's results bit for bit, 16 inputs an instruction (a prompt's rows took as long to quantize
// one at a time as to multiply): vmaxps returns its second operand where the first is NaN, so NaN
// inputs drop out of the maximum as from std::max(amax, |x|); vcvtps2dq rounds as _mm_cvtss_si32
// (the MXCSR's nearest even, INT_MIN for NaN) and vpmovdb keeps the low byte as the int8 cast.
SPECEE_INT4_AVX512 void quantize_avx512(const float* x, int64_t blocks, int8_t* q, float* d, float* ds, int32_t* s16) {
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t i = 0; i < blocks; ++i) {
    const __m512 a = _mm512_loadu_ps(x + i * kGroup), b = _mm512_loadu_ps(x + i * kGroup + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(b), _mm512_max_ps(_mm512_abs_ps(a), zero)));
    const float step = amax / 127.f, inv = step != 0.f ? 1.f / step : 0.f;
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv)));
    const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inv)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i * kGroup), _mm512_cvtepi32_epi8(qa));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i * kGroup + 16), _mm512_cvtepi32_epi8(qb));
    const int32_t sa = _mm512_reduce_add_epi32(qa), sb = _mm512_reduce_add_epi32(qb);
    // x - x is NaN exactly where x is NaN or Inf
    const bool finite = (_mm512_cmp_ps_mask(_mm512_sub_ps(a, a), zero, _CMP_UNORD_Q) |
                         _mm512_cmp_ps_mask(_mm512_sub_ps(b, b), zero, _CMP_UNORD_Q)) == 0;
    d[i] = finite ? step : NAN;
    ds[i] = d[i] * static_cast<float>(sa + sb);
    if (s16) s16[2 * i] = sa, s16[2 * i + 1] = sb;
  }
}
#endif

// The same in AVX2, 8 inputs an instruction: vmaxps as above; vcvtps2dq, then each int32's low byte
// gathered by a byte shuffle (the int8 cast, NaN's INT_MIN included).
SPECEE_INT4_AVX2 void quantize_avx2(const float* x, int64_t blocks, int8_t* q, float* d, float* ds, int32_t* s16) {
  const __m256 zero = _mm256_setzero_ps(), magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i low_bytes = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,  //
                                             0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i gather = _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1);  // the two lanes' 4 bytes, in order
  for (int64_t i = 0; i < blocks; ++i) {
    __m256 v[4], amax = zero, unordered = zero;
    for (int k = 0; k < 4; ++k) {
      v[k] = _mm256_loadu_ps(x + i * kGroup + 8 * k);
      amax = _mm256_max_ps(_mm256_and_ps(v[k], magnitude), amax);
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(_mm256_sub_ps(v[k], v[k]), zero, _CMP_UNORD_Q));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    const float top = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
    const float step = top / 127.f, inv = step != 0.f ? 1.f / step : 0.f;
    __m256i qi[4];
    for (int k = 0; k < 4; ++k) {
      qi[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], _mm256_set1_ps(inv)));
      const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(qi[k], low_bytes), gather);
      _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i * kGroup + 8 * k), _mm256_castsi256_si128(bytes));
    }
    int32_t half[2];
    for (int h = 0; h < 2; ++h) {
      const __m256i s8 = _mm256_add_epi32(qi[2 * h], qi[2 * h + 1]);
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
      half[h] = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1)));
    }
    d[i] = _mm256_movemask_ps(unordered) == 0 ? step : NAN;
    ds[i] = d[i] * static_cast<float>(half[0] + half[1]);
    if (s16) s16[2 * i] = half[0], s16[2 * i + 1] = half[1];
  }
}

decltype(&quantize) quantize_at(int64_t level) {
#ifdef SPECEE_X86
  if (level == kAvx512) return quantize_avx512;
  if (level == kAvx2) return quantize_avx2;
#endif
  return quantize;
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
// group.) Both paths combine each group with add_group.
template <int R>
SPECEE_INT4_AVX512 void rows_avx512(const uint8_t* w, const uint16_t* sz, const Q8& x, int64_t K, float* y, int64_t N) {
  constexpr int T = 2;
  const int64_t G = K / kGroup;
  for (int t0 = 0; t0 < 4; t0 += T) {
    __m512 f[R][T];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) f[r][t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      if (t0 == 0) prefetch_group(w, sz, g, R);  // later passes find the block in cache
      __m512i acc[R][T];
      for (int r = 0; r < R; ++r)
        for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int c = 0; c < kGroup / 4; ++c) {
        __m512i u[T];
        for (int t = 0; t < T; ++t) u[t] = unpack16(w + (g * (kGroup / 4) + c) * 128 + (t0 + t) * 32);
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
SPECEE_INT4_AVX512 void block_avx512(const uint8_t* w, const uint16_t* sz, const Q8& x, int64_t K, float* y, int64_t N) {
  if constexpr (R > 4) {
    rows_avx512<R>(w, sz, x, K, y, N);
  } else {
    zero_rows(y, R, N);
    for (int64_t g = 0; g < K / kGroup; ++g) {
      prefetch_group(w, sz, g, R);
      group_avx512<R>(w, sz, x, K, g, y, N);
    }
  }
}

// Eight outputs (half a tile, 16 bytes) as block_avx512's unpack16.
SPECEE_INT4_AVX2 inline __m256i unpack8(const uint8_t* p) {
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_and_si256(_mm256_or_si256(v, _mm256_slli_epi32(v, 12)), _mm256_set1_epi32(0x0F0F0F0F));
}

// 1 to 4 rows as block_avx512, eight outputs at a time, J such halves side by side (independent chains
// for few rows), each row's activations broadcast once for the J halves; y written, each group added into
// it. The loop over a group's inputs stays rolled: fully unrolled (as the AVX-512 paths are, with 32
// registers), GCC 12 kept the int16 sums on the stack and hoisted every row's broadcast, so with only 16
// registers each step waited on a store and a reload (one AMD EPYC Zen 3 core, 576 x 3072 in cache,
// GMAC/s: 2 rows 31-33 -> 39-51, 4 rows 32 -> 41).
template <int R, int J = (R <= 2 ? 4 : 2)>
SPECEE_INT4_AVX2 void rows_avx2(const uint8_t* w, const uint16_t* sz, const Q8& x, int64_t K, float* y, int64_t N) {
  const int64_t G = K / kGroup;
  const __m256i ones = _mm256_set1_epi16(1);
  zero_rows(y, R, N);
  for (int64_t g = 0; g < G; ++g) {
    prefetch_group(w, sz, g, R);
    const int8_t* xg[R];  // each row's inputs of group g
    for (int r = 0; r < R; ++r) xg[r] = x.q + r * K + g * kGroup;
    for (int j0 = 0; j0 < 8; j0 += J) {
      __m256i acc[J][R];  // int16 pair sums
      for (int j = 0; j < J; ++j)
        for (int r = 0; r < R; ++r) acc[j][r] = _mm256_setzero_si256();
      const uint8_t* wg = w + g * (kGroup / 4) * 128 + j0 * 16;
#pragma GCC unroll 1
      for (int c = 0; c < kGroup / 4; ++c) {
        __m256i u[J];
        for (int j = 0; j < J; ++j) u[j] = unpack8(wg + c * 128 + j * 16);
        for (int r = 0; r < R; ++r) {
          int32_t v;
          std::memcpy(&v, xg[r] + 4 * c, 4);
          const __m256i b = _mm256_set1_epi32(v);
          for (int j = 0; j < J; ++j) acc[j][r] = _mm256_add_epi16(acc[j][r], _mm256_maddubs_epi16(u[j], b));
        }
      }
      for (int j = 0; j < J; ++j) {
        const uint16_t* szh = sz + g * 128 + (j0 + j) * 8;
        const __m256 s = bf16x8_to_float(szh);
        const __m256 z8 = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), s, bf16x8_to_float(szh + 64));
        for (int r = 0; r < R; ++r) {
          float* o = y + r * N + (j0 + j) * 8;
          const __m256 sd = _mm256_mul_ps(s, _mm256_set1_ps(x.d[r * G + g]));
          const __m256 a = _mm256_cvtepi32_ps(_mm256_madd_epi16(acc[j][r], ones));
          const __m256 v = _mm256_fmadd_ps(a, sd, _mm256_loadu_ps(o));
          _mm256_storeu_ps(o, _mm256_fmadd_ps(z8, _mm256_set1_ps(x.ds[r * G + g]), v));
        }
      }
    }
  }
}

// 5 to 8 rows in two passes of up to 4 over the block (the second finds its weights in cache): 8 rows in
// one pass need 8 sums, 8 broadcasts and the weights, more than 16 registers (8 rows, the same core and
// shape: 26-30 -> 44-58 GMAC/s). A row's operations are those of rows_avx2 whatever rows share the call.
template <int R>
SPECEE_INT4_AVX2 void block_avx2(const uint8_t* w, const uint16_t* sz, const Q8& x, int64_t K, float* y, int64_t N) {
  if constexpr (R > 4) {
    constexpr int first = (R + 1) / 2;
    const int64_t G = K / kGroup;
    rows_avx2<first>(w, sz, x, K, y, N);
    rows_avx2<R - first>(w, sz, Q8{x.q + first * K, x.d + first * G, x.ds + first * G}, K, y + first * N, N);
  } else {
    rows_avx2<R>(w, sz, x, K, y, N);
  }
}
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
void rows_at(int64_t level, const uint8_t* w, const uint16_t* sz, const Q8& x, int64_t K, float* y, int64_t N) {
#ifdef SPECEE_X86
  if (level == kAvx512) return block_avx512<R>(w, sz, x, K, y, N);
  if (level == kAvx2) return block_avx2<R>(w, sz, x, K, y, N);
#endif
  block_portable<R>(w, sz, x, K, y, N);
}

constexpr int kMaxRows = 8;  // a verification pass's rows share each tile's unpacking
constexpr int64_t kQuantizeGrain = 16384;  // activations worth quantizing in a parallel region
constexpr decltype(&rows_at<1>) kRows[kMaxRows + 1] = {nullptr,     rows_at<1>, rows_at<2>, rows_at<3>, rows_at<4>,
                                                       rows_at<5>, rows_at<6>, rows_at<7>, rows_at<8>};

}  // namespace

void quantize_activations(const float* x, int64_t M, int64_t K, int64_t level, int8_t* q, float* d, float* ds,
                          int32_t* s16) {
  const int64_t G = K / kGroup;
  auto* const quantize_rows = quantize_at(level);
  at::parallel_for(0, M, std::max<int64_t>(1, kQuantizeGrain / K), [&](int64_t r0, int64_t r1) {
    quantize_rows(x + r0 * K, (r1 - r0) * G, q + r0 * K, d + r0 * G, ds + r0 * G, s16 ? s16 + r0 * 2 * G : nullptr);
  });
}

at::Tensor int4_mm_q8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t level,
                      const at::Tensor& out_rows) {
  const at::Tensor xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);  // bf16 widens exactly
  const int64_t M = xf.size(0), K = xf.size(1), blocks = packed.size(0), N = blocks * 64, G = K / kGroup;
  thread_local Scratch q_buf, d_buf, ds_buf;  // the calling thread's, kept between calls
  int8_t* q = q_buf.at_least<int8_t>(M * K);
  float* d = d_buf.at_least<float>(M * G);
  float* ds = ds_buf.at_least<float>(M * G);
  quantize_activations(xf.data_ptr<float>(), M, K, level, q, d, ds, nullptr);
  at::Tensor y = product_output(out_rows, M, N, false);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const uint16_t* sz = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  float* out = y.data_ptr<float>();
  // units of (64-output block, up to kMaxRows rows), block by block (its weights stay in cache over its
  // rows): the threads split a prompt's rows, not only its blocks (SmolLM2's 9 or 15 blocks of 64 outputs
  // left one of two threads idle a tenth of the time)
  const int64_t chunks = (M + kMaxRows - 1) / kMaxRows;
  at::parallel_for(0, blocks * chunks, 1, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t b = u / chunks, r = u % chunks * kMaxRows, R = std::min<int64_t>(kMaxRows, M - r);
      const Q8 rows{q + r * K, d + r * G, ds + r * G};
      kRows[R](level, w + b * (K / 4) * 128, sz + b * G * 128, rows, K, out + r * N + b * 64, N);
    }
  });
  return y;
}

}  // namespace specee_int4
