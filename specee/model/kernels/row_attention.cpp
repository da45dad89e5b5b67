// One query row's attention over its own prefix of the cache (a decode step's row, one row of a
// chain being verified, or one row of a prefill), in AVX-512 or AVX2: scores, a softmax with a
// polynomial exp, the weighted sum of values, each in a fixed order. Why: ATen's scaled dot-product attention costs ~37 us a call for
// one row (SmolLM2, 2026-11 AMD EPYC), 72% of a step with 8 requests, whose rows attend one at a
// time; this takes a few. Every single-row attention of the C++ layer goes through here (decode
// rows, chain rows, prefill rows, alone or batched), so a row's numbers never depend on what shares its step.
// The cache may hold float16 (the default where this runs): each key and value widens on load.
// The query heads that share a kv head go together (tile), so each key and value is read and widened
// once for all of them; scores come 16 keys at a time through a transpose-style sum (fold), or 4 (fold4).
#include "row_attention.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "exp_nonpositive.h"
#include "int4_matmul.h"

namespace {

// f(std::integral_constant<int, n>{}) for a run-time n in 1..Max: the head size, a tile's heads and a value
// pass's columns are template arguments (so sums and accumulators stay in registers), chosen per call
template <int Max, typename F>
void with_count(int64_t n, F&& f) {
  if constexpr (Max > 1)
    if (n < Max) return with_count<Max - 1>(n, f);
  f(std::integral_constant<int, Max>{});
}

#define SPECEE_AVX512 __attribute__((target("avx512f")))
// inlined all the way down, so q and the partial sums stay in registers across the recursion
#define SPECEE_INLINE __attribute__((target("avx512f"), always_inline)) inline

// 16 keys' or values' floats from the cache, stored as float32 or float16
SPECEE_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
SPECEE_AVX512 inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Folds two vectors of partial sums into one, keeping each key's sums apart: 2 keys' 16 lanes into
// halves, 2 such into 128-bit quarters (4 keys), then lane pairs (8 keys), then single lanes (16 keys),
// lane 4q + j holding key q + 4j: 15 adds and 31 shuffles or blends per 16 dot products, where a
// horizontal sum per key takes 8 (16 keys: 128).
template <int Keys>
SPECEE_INLINE __m512 fold(__m512 a, __m512 b) {
  if constexpr (Keys == 2) return _mm512_add_ps(_mm512_mask_blend_ps(0xFF00, a, b), _mm512_shuffle_f32x4(a, b, 0x4E));
  if constexpr (Keys == 4) return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  if constexpr (Keys == 8)
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))));
  if constexpr (Keys == 16) return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}

// The dot products of `Keys` consecutive keys (rows of 16 C floats) with each of H query heads, folded per head
template <int Keys, typename KV, int C, int H>
SPECEE_INLINE void dots(const __m512 (&q)[H][C], const KV* k, __m512 (&out)[H]) {
  if constexpr (Keys == 1) {
    for (int c = 0; c < C; ++c) {
      const __m512 kc = load16(k + 16 * c);  // widened once for all H heads
      for (int h = 0; h < H; ++h) out[h] = c ? _mm512_fmadd_ps(q[h][c], kc, out[h]) : _mm512_mul_ps(q[h][c], kc);
    }
  } else {
    __m512 lo[H], hi[H];
    dots<Keys / 2>(q, k, lo);
    dots<Keys / 2>(q, k + Keys / 2 * 16 * C, hi);
    for (int h = 0; h < H; ++h) out[h] = fold<Keys>(lo[h], hi[h]);
  }
}

// The block of `width` keys (rows of D) from key t on, n of them real: in the cache, or, for a last
// block of fewer, a copy padded with zeros (not read past the cache's rows)
template <typename KV>
inline const KV* key_block(const KV* K, int64_t t, int64_t n, int64_t width, int64_t D, KV* padded) {
  const KV* k = K + t * D;
  if (n == width) return k;
  std::fill(std::copy(k, k + n * D, padded), padded + width * D, KV(0));
  return padded;
}

// Software prefetch kPrefetch bytes ahead of the reading, which goes through K's `bytes`, then V's:
// with the hardware's prefetch alone, a thread read caches from memory at ~17 of the ~35 GB/s it can
// stream (2 AMD EPYC cores, 256 MB of caches); with this at ~30. Nothing past either: bytes read for
// nothing. Issued per 4 keys: all of a 16-key block's at once slowed D = 128 by 20% from L2. Into L2
// (prefetcht1), as the int4 products' (int4_common.h): on the Intel Xeon with AMX, 8 SmolLM2 requests
// of 800-token prompts, five alternating pairs, 18.06 -> 17.00 ms a decode step (faster in four pairs,
// equal in one). Not yet measured on the AMD EPYCs.
constexpr int64_t kPrefetch = 4096;
struct Prefetch {
  const char *K, *V;
  int64_t bytes;
  // the n bytes kPrefetch past byte `at` of the reading
  __attribute__((always_inline)) inline void fetch(int64_t at, int64_t n) const {
    const int64_t from = at + kPrefetch, to = from + n;
    for (int64_t b = from; b < std::min(to, bytes); b += 64) _mm_prefetch(K + b, _MM_HINT_T1);
    for (int64_t b = std::max(from, bytes); b < std::min(to, 2 * bytes); b += 64)
      _mm_prefetch(V + b - bytes, _MM_HINT_T1);
  }
};

// H query heads sharing one kv head (q: head h at q + h * q_stride), together: each key and value is
// loaded and widened once for all of them, and their q chunks and accumulators stay in registers
// (spilling a few of the score pass's partial sums at H C = 24: still faster than two tiles).
// scores: H rows of `ss` floats. A head's numbers do not depend on the tile it is in.
template <typename KV, int C, int H>
SPECEE_AVX512 void tile(const float* q, int64_t q_stride, const KV* K, const KV* V, int64_t len, float* scores,
                        int64_t ss, float* out) {
  constexpr int64_t D = 16 * C, row = D * sizeof(KV);  // a key's or value's bytes
  const Prefetch ahead{reinterpret_cast<const char*>(K), reinterpret_cast<const char*>(V), len * row};
  const __m512 scale = _mm512_set1_ps(1.0f / std::sqrt(static_cast<float>(D)));
  __m512 qv[H][C], best[H];
  for (int h = 0; h < H; ++h) {
    for (int c = 0; c < C; ++c) qv[h][c] = _mm512_mul_ps(_mm512_loadu_ps(q + h * q_stride + 16 * c), scale);
    best[h] = _mm512_set1_ps(-INFINITY);
  }
  alignas(64) KV padded[16 * D];
  const __m512i key_order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  for (int64_t t = 0; t < len; t += 16) {
    const int64_t n = std::min<int64_t>(16, len - t);
    const KV* k = key_block(K, t, n, 16, D, padded);
    const __mmask16 live = static_cast<__mmask16>((1u << n) - 1);
    __m512 x[4][H];
    for (int j = 0; j < 4; ++j) {
      ahead.fetch((t + 4 * j) * row, 4 * row);
      dots<4>(qv, k + 4 * j * D, x[j]);
    }
    for (int h = 0; h < H; ++h) {
      const __m512 s = _mm512_permutexvar_ps(key_order, fold<16>(fold<8>(x[0][h], x[1][h]), fold<8>(x[2][h], x[3][h])));
      _mm512_storeu_ps(scores + h * ss + t, s);  // lane j: key t + j
      best[h] = _mm512_mask_max_ps(best[h], live, best[h], s);
    }
  }
  float inv[H];
  for (int h = 0; h < H; ++h) {
    float* sh = scores + h * ss;
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(best[h]));
    __m512 total = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; t += 16) {
      const __mmask16 live = static_cast<__mmask16>((1u << std::min<int64_t>(16, len - t)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(live, exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(sh + t), m)));
      _mm512_storeu_ps(sh + t, e);
      total = _mm512_add_ps(total, e);
    }
    inv[h] = 1.0f / _mm512_reduce_add_ps(total);
  }
  __m512 acc[H][C];
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < C; ++c) acc[h][c] = _mm512_setzero_ps();
  for (int64_t t0 = 0; t0 < len; t0 += 4) {
    ahead.fetch((len + t0) * row, 4 * row);
    for (int64_t t = t0; t < std::min(t0 + 4, len); ++t) {
      const KV* v = V + t * D;
      __m512 p[H];
      for (int h = 0; h < H; ++h) p[h] = _mm512_set1_ps(scores[h * ss + t]);
      for (int c = 0; c < C; ++c) {
        const __m512 vc = load16(v + 16 * c);
        for (int h = 0; h < H; ++h) acc[h][c] = _mm512_fmadd_ps(p[h], vc, acc[h][c]);
      }
    }
  }
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < C; ++c)
      _mm512_storeu_ps(out + h * D + 16 * c, _mm512_mul_ps(acc[h][c], _mm512_set1_ps(inv[h])));
}

#define SPECEE_AVX2 __attribute__((target("avx2,fma,f16c")))
#define SPECEE_INLINE_AVX2 __attribute__((target("avx2,fma,f16c"), always_inline)) inline

SPECEE_INLINE_AVX2 __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
SPECEE_INLINE_AVX2 __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Four keys' partial sums into one lane each, in key order
SPECEE_INLINE_AVX2 __m128 fold4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));  // a b c d per 128-bit half
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Columns of a head's values one AVX2 value pass covers: H Cols accumulators + H probabilities + a value <= 16
template <int H>
constexpr int kValueCols = (15 - H) / H;

// tile_avx2's value pass over Cols (a compile-time count) 8-float chunks of each of its H heads, from chunk
// c0: out += sum_t p_t v_t, times the head's 1 / sum. A run-time count kept the accumulators on the stack
// (a load, an FMA and a store a value chunk): with that and the score pass's queries loaded by each FMA,
// one row's attention over 64-900 keys (in cache, one AMD EPYC Zen 3 core; SmolLM2's, the Qwen2.5s' and
// 32-wide heads) took 1.32-1.59x as long, for the same bits.
template <typename KV, int H, int Cols>
SPECEE_AVX2 void values_avx2(const KV* V, int64_t len, int64_t D, int64_t c0, const float* scores, int64_t ss,
                             const float (&inv)[H], const Prefetch& ahead, bool fetch, float* out) {
  const int64_t row = D * static_cast<int64_t>(sizeof(KV));
  __m256 acc[H][Cols];
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < Cols; ++c) acc[h][c] = _mm256_setzero_ps();
  for (int64_t t0 = 0; t0 < len; t0 += 4) {
    if (fetch) ahead.fetch((len + t0) * row, 4 * row);  // later passes find the values in cache
    for (int64_t t = t0; t < std::min(t0 + 4, len); ++t) {
      const KV* v = V + t * D + 8 * c0;
      __m256 p[H];
      for (int h = 0; h < H; ++h) p[h] = _mm256_broadcast_ss(scores + h * ss + t);
      for (int c = 0; c < Cols; ++c) {
        const __m256 vc = load8(v + 8 * c);
        for (int h = 0; h < H; ++h) acc[h][c] = _mm256_fmadd_ps(p[h], vc, acc[h][c]);
      }
    }
  }
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < Cols; ++c)
      _mm256_storeu_ps(out + h * D + 8 * (c0 + c), _mm256_mul_ps(acc[h][c], _mm256_set1_ps(inv[h])));
}

// tile in AVX2 (+ FMA, F16C), for CPUs without AVX-512 (AMD Zen 2-3, most desktop Intel): 16 vector
// registers, not 32, so the scaled queries stay in L1, 4 keys' partial sums per head in registers,
// and the value pass covers kValueCols 8-float chunks of the head at a time (values_avx2). head_dim =
// 8 C (C at run time), at most 3 heads a tile. Without it every row on such a CPU went to ATen's
// attention: 8 SmolLM2 requests made 240 calls of ~37 us a step.
template <typename KV, int H>
SPECEE_AVX2 void tile_avx2(const float* q, int64_t q_stride, const KV* K, const KV* V, int64_t len, int64_t C,
                           float* scores, int64_t ss, float* out) {
  const int64_t D = 8 * C, row = D * static_cast<int64_t>(sizeof(KV));
  const Prefetch ahead{reinterpret_cast<const char*>(K), reinterpret_cast<const char*>(V), len * row};
  const __m256 scale = _mm256_set1_ps(1.0f / std::sqrt(static_cast<float>(D)));
  alignas(32) float qs[H][256];
  for (int h = 0; h < H; ++h)
    for (int64_t c = 0; c < C; ++c)
      _mm256_store_ps(qs[h] + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(q + h * q_stride + 8 * c), scale));
  alignas(32) KV padded[8 * 256];
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 best[H];
  for (int h = 0; h < H; ++h) best[h] = _mm256_set1_ps(-INFINITY);
  for (int64_t t = 0; t < len; t += 8) {
    const int64_t n = std::min<int64_t>(8, len - t);
    const KV* k = key_block(K, t, n, 8, D, padded);
    __m128 half[2][H];
    for (int j = 0; j < 2; ++j) {
      ahead.fetch((t + 4 * j) * row, 4 * row);
      __m256 x[4][H];
      for (int e = 0; e < 4; ++e)
        for (int h = 0; h < H; ++h) x[e][h] = _mm256_setzero_ps();
      for (int64_t c = 0; c < C; ++c) {
        __m256 qc[H];  // in registers for the 4 keys (4 H sums + H + a key: 16 at H = 3), not a load an FMA
        for (int h = 0; h < H; ++h) qc[h] = _mm256_load_ps(qs[h] + 8 * c);
        for (int e = 0; e < 4; ++e) {
          const __m256 kc = load8(k + (4 * j + e) * D + 8 * c);  // widened once for all H heads
          for (int h = 0; h < H; ++h) x[e][h] = _mm256_fmadd_ps(qc[h], kc, x[e][h]);
        }
      }
      for (int h = 0; h < H; ++h) half[j][h] = fold4(x[0][h], x[1][h], x[2][h], x[3][h]);
    }
    const __m256 dead = _mm256_castsi256_ps(_mm256_cmpgt_epi32(lane, _mm256_set1_epi32(static_cast<int>(n - 1))));
    for (int h = 0; h < H; ++h) {
      const __m256 s = _mm256_set_m128(half[1][h], half[0][h]);  // lane j: key t + j
      _mm256_storeu_ps(scores + h * ss + t, s);
      best[h] = _mm256_max_ps(best[h], _mm256_blendv_ps(s, _mm256_set1_ps(-INFINITY), dead));
    }
  }
  float inv[H];
  for (int h = 0; h < H; ++h) inv[h] = softmax_avx2(scores + h * ss, len, len, best[h]);
  // the value pass: kValueCols chunks of each head at a time, then the rest
  int64_t c0 = 0;
  for (; c0 + kValueCols<H> <= C; c0 += kValueCols<H>)
    values_avx2<KV, H, kValueCols<H>>(V, len, D, c0, scores, ss, inv, ahead, c0 == 0, out);
  if (c0 < C)
    with_count<kValueCols<H> - 1>(C - c0, [&](auto cols) {
      values_avx2<KV, H, decltype(cols)::value>(V, len, D, c0, scores, ss, inv, ahead, c0 == 0, out);
    });
}

// The most heads a tile takes: at AVX-512, H C <= 24 registers of q chunks, and as many accumulators
// in the value pass (+ C values): SmolLM2's 3 heads a kv head in one tile, Qwen2.5-0.5B's 7 in 4 + 3,
// 1.5B's 6 in 3 + 3; at AVX2, 4 keys' sums for each head: 3 heads.
template <int C>
constexpr int kTileHeads = std::clamp(24 / C, 1, 8);
constexpr int kTileHeadsAvx2 = 3;

// head_dim = 16 C (C the AVX-512 tiles' template argument; with_count picks it per call)
template <typename KV, int C>
void attend_heads(const float* q, int64_t q_stride, const KV* K, int64_t k_stride, const KV* V, int64_t v_stride,
                  int64_t len, int64_t head_dim, int64_t heads, int64_t kv_heads, float* out) {
  const bool wide = avx512_level();
  const int64_t T = wide ? kTileHeads<C> : kTileHeadsAvx2;
  const int64_t ss = (len + 15) / 16 * 16;
  thread_local std::vector<float> scores;
  if (static_cast<int64_t>(scores.size()) < T * ss) scores.resize(T * ss);
  const int64_t group = heads / kv_heads;
  // each kv head's group split into tiles of near-equal size (7 heads, 6 a tile: 4 and 3, not 6 and 1)
  const int64_t tiles = (group + T - 1) / T;
  for (int64_t g = 0; g < kv_heads; ++g)
    for (int64_t i = 0, h = g * group; i < tiles; ++i) {
      const int64_t n = group / tiles + (i < group % tiles);
      const KV *Kg = K + g * k_stride, *Vg = V + g * v_stride;
      const float* qh = q + h * q_stride;
      float* oh = out + h * head_dim;
      if (wide)
        with_count<kTileHeads<C>>(n, [&](auto H) {
          tile<KV, C, decltype(H)::value>(qh, q_stride, Kg, Vg, len, scores.data(), ss, oh);
        });
      else
        with_count<kTileHeadsAvx2>(n, [&](auto H) {
          tile_avx2<KV, decltype(H)::value>(qh, q_stride, Kg, Vg, len, head_dim / 8, scores.data(), ss, oh);
        });
      h += n;
    }
}

// attend_heads at the head size's C (row_attention_available: head_dim = 16 C, C <= 16)
template <typename KV>
void attend(const float* q, int64_t q_stride, const KV* K, int64_t k_stride, const KV* V, int64_t v_stride,
            int64_t len, int64_t head_dim, int64_t heads, int64_t kv_heads, float* out) {
  with_count<16>(head_dim / 16, [&](auto C) {
    attend_heads<KV, decltype(C)::value>(q, q_stride, K, k_stride, V, v_stride, len, head_dim, heads, kv_heads, out);
  });
}

SPECEE_AVX512 void to_half_avx512(const float* x, c10::Half* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm512_cvtps_ph(_mm512_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; i < n; ++i) out[i] = c10::Half(x[i]);
}

SPECEE_AVX2 void to_half_avx2(const float* x, c10::Half* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; i < n; ++i) out[i] = c10::Half(x[i]);
}

}  // namespace

bool avx2_f16c_level() {
  static const bool f16c = __builtin_cpu_supports("f16c");
  return avx2_level() && f16c;
}

bool row_attention_available(int64_t head_dim) {
  return head_dim % 16 == 0 && head_dim <= 256 && (avx512_level() || avx2_f16c_level());
}

void row_attention(const float* q, int64_t q_stride, const float* K, int64_t k_stride, const float* V,
                   int64_t v_stride, int64_t len, int64_t head_dim, int64_t heads, int64_t kv_heads, float* out) {
  attend(q, q_stride, K, k_stride, V, v_stride, len, head_dim, heads, kv_heads, out);
}

void row_attention(const float* q, int64_t q_stride, const c10::Half* K, int64_t k_stride, const c10::Half* V,
                   int64_t v_stride, int64_t len, int64_t head_dim, int64_t heads, int64_t kv_heads, float* out) {
  attend(q, q_stride, K, k_stride, V, v_stride, len, head_dim, heads, kv_heads, out);
}

void to_half(const float* x, c10::Half* out, int64_t n) {
  if (avx512_level()) {
    to_half_avx512(x, out, n);
  } else if (avx2_f16c_level()) {
    to_half_avx2(x, out, n);
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = c10::Half(x[i]);  // round to nearest even, as torch's .half()
  }
}
