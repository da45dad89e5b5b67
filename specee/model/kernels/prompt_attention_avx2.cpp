// A prompt's attention in AVX2 float32, where the kernels run at their AVX2 level (AMD Zen 2-3, desktop
// Intel) or at AVX-512 without AMX tiles (AMD Zen 4-5; Zen 4 runs a 512-bit operation as two 256-bit halves,
// and a 16-lane version was not measured): per kv head the prompt's keys are widened once into blocks of 8
// keys stored dimension-major; a tile of up to 6 query vectors (a row's head) scores 16 keys at a time, each
// score a float32 FMA chain over the head's dimensions in order with the query times 1/sqrt(D), so no
// horizontal sums; a softmax over each row's own prefix (the polynomial exp of exp_nonpositive.h); and P V,
// 16 dimensions of every vector of the tile at a time, an FMA chain over the keys in slot order. Why:
// row_attention.cpp takes a prompt one row at a time, each row reading and widening every key and value of
// its prefix and folding 4 keys' sums across lanes; the 769-token bench prompt's attention was ~17% of the 8
// bench prompts' prefill (AMD EPYC Zen 3, BENCHMARKS.md session 48). At the AVX-512 level it took over from
// row_attention.cpp's AVX-512 rows: the 8 bench prompts' prefill 1.03-1.09x, the 769-token one 1.06x (AMD
// EPYC Zen 4, session 50).
//
// decode_layer.cpp sends a prompt here by the rule of the AMX tiles (prompt_attention.cpp): a causal
// segment of kTilePromptRows rows or more, so a request's tokens depend on its own prompt, never on what
// shares its step. A row's numbers depend neither on the other rows of its tile nor on where its part of a
// chunked prefill starts: each score sums the same products in the same order, keys past a row's prefix
// add exact zeros to its sums, and key blocks count from slot 0.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>

#include "exp_nonpositive.h"
#include "prompt_attention.h"
#include "row_attention.h"
#include "scratch.h"

namespace {

using specee_scratch::Scratch;

#define SPECEE_AVX2 __attribute__((target("avx2,fma,f16c")))
#define SPECEE_INLINE_AVX2 __attribute__((target("avx2,fma,f16c"), always_inline)) inline

constexpr int kVectors = 6;       // query vectors a tile takes: 2 x 6 sums + 2 keys + a broadcast fill 15 registers
constexpr int64_t kKeys = 16;     // keys a score tile takes (two blocks of 8)
constexpr int64_t kUnitRows = 16;  // rows of one kv head's group a unit of work takes

SPECEE_INLINE_AVX2 __m256 half8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Keys of one kv head as blocks of 8: kt[(s / 8) 8 D + 8 d + s % 8] = K[s][d]; slots S .. L - 1 zero.
SPECEE_AVX2 void pack_keys(const c10::Half* K, int64_t S, int64_t L, int64_t D, float* kt) {
  for (int64_t b = 0; b < L / 8; ++b)
    for (int64_t c = 0; c < D / 8; ++c) {
      __m256 r[8];
      for (int e = 0; e < 8; ++e) r[e] = 8 * b + e < S ? half8(K + (8 * b + e) * D + 8 * c) : _mm256_setzero_ps();
      // 8 x 8 transpose: key e's dims 8c..8c+7 -> dim 8c + e's keys
      const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
      const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
      const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
      const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
      const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
      const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
      const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
      const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
      const __m256 out[8] = {_mm256_permute2f128_ps(u0, u4, 0x20), _mm256_permute2f128_ps(u1, u5, 0x20),
                             _mm256_permute2f128_ps(u2, u6, 0x20), _mm256_permute2f128_ps(u3, u7, 0x20),
                             _mm256_permute2f128_ps(u0, u4, 0x31), _mm256_permute2f128_ps(u1, u5, 0x31),
                             _mm256_permute2f128_ps(u2, u6, 0x31), _mm256_permute2f128_ps(u3, u7, 0x31)};
      for (int e = 0; e < 8; ++e) _mm256_store_ps(kt + (b * D + 8 * c + e) * 8, out[e]);
    }
}

// Scores of V query vectors (q[v]: D floats, already scaled) against keys 0 .. pairs x 16 - 1: sc[v][t]
template <int V>
SPECEE_AVX2 void scores(const float* const* q, const float* kt, int64_t pairs, int64_t D, float* const* sc) {
  for (int64_t b = 0; b < pairs; ++b) {
    const float* k = kt + 2 * b * 8 * D;
    __m256 a[V][2];
    for (int v = 0; v < V; ++v) a[v][0] = a[v][1] = _mm256_setzero_ps();
#pragma GCC unroll 2
    for (int64_t d = 0; d < D; ++d) {
      const __m256 k0 = _mm256_load_ps(k + 8 * d), k1 = _mm256_load_ps(k + 8 * D + 8 * d);
      for (int v = 0; v < V; ++v) {
        const __m256 x = _mm256_broadcast_ss(q[v] + d);
        a[v][0] = _mm256_fmadd_ps(x, k0, a[v][0]);
        a[v][1] = _mm256_fmadd_ps(x, k1, a[v][1]);
      }
    }
    for (int v = 0; v < V; ++v) {
      _mm256_store_ps(sc[v] + kKeys * b, a[v][0]);
      _mm256_store_ps(sc[v] + kKeys * b + 8, a[v][1]);
    }
  }
}

// The vectors' outputs over dims 8 c0 .. 8 c0 + 15: sum over keys 0 .. len - 1 of p[v][t] V[t], times inv[v]
template <int V>
SPECEE_AVX2 void values(const float* const* p, const c10::Half* Vh, int64_t len, int64_t D, int64_t c0,
                        const float* inv, float* const* out) {
  __m256 a[V][2];
  for (int v = 0; v < V; ++v) a[v][0] = a[v][1] = _mm256_setzero_ps();
#pragma GCC unroll 2
  for (int64_t t = 0; t < len; ++t) {
    const __m256 v0 = half8(Vh + t * D + 8 * c0), v1 = half8(Vh + t * D + 8 * c0 + 8);
    for (int v = 0; v < V; ++v) {
      const __m256 x = _mm256_broadcast_ss(p[v] + t);
      a[v][0] = _mm256_fmadd_ps(x, v0, a[v][0]);
      a[v][1] = _mm256_fmadd_ps(x, v1, a[v][1]);
    }
  }
  for (int v = 0; v < V; ++v) {
    _mm256_storeu_ps(out[v] + 8 * c0, _mm256_mul_ps(a[v][0], _mm256_set1_ps(inv[v])));
    _mm256_storeu_ps(out[v] + 8 * c0 + 8, _mm256_mul_ps(a[v][1], _mm256_set1_ps(inv[v])));
  }
}

// A row's softmax over its prefix of `len` keys, in place over keys 0 .. n - 1 (keys past len set to 0);
// returns 1 / the sum
SPECEE_AVX2 float softmax(float* s, int64_t len, int64_t n) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 best = _mm256_set1_ps(-INFINITY);
  for (int64_t t = 0; t < len; t += 8) {
    const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(len - t)), lane));
    best = _mm256_max_ps(best, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_load_ps(s + t), live));
  }
  return softmax_avx2(s, len, n, best);
}

// A tile of V vectors (row r[v] of the prompt, head h[v]) of one kv head: scores, softmax, values
template <int V>
SPECEE_AVX2 void tile(const float* q, int64_t start, int64_t S, int64_t D, const int64_t* r, const int64_t* h,
                      const float* kt, const c10::Half* Vh, float* out, int64_t out_stride, float* work) {
  const int64_t len = start + r[V - 1] + 1;  // the longest prefix of the tile (rows come in order)
  const int64_t n = (len + kKeys - 1) / kKeys * kKeys;
  const float* qv[V];
  float *sv[V], *ov[V], inv[V];
  const __m256 scale = _mm256_set1_ps(1.0f / std::sqrt(static_cast<float>(D)));
  for (int v = 0; v < V; ++v) {
    float* qs = work + v * D;
    const float* x = q + (h[v] * S + r[v]) * D;
    for (int64_t d = 0; d < D; d += 8) _mm256_store_ps(qs + d, _mm256_mul_ps(_mm256_loadu_ps(x + d), scale));
    qv[v] = qs;
    sv[v] = work + V * D + v * n;
    ov[v] = out + r[v] * out_stride + h[v] * D;
  }
  scores<V>(qv, kt, n / kKeys, D, sv);
  for (int v = 0; v < V; ++v) inv[v] = softmax(sv[v], start + r[v] + 1, n);
  for (int64_t c0 = 0; c0 < D / 8; c0 += 2) values<V>(sv, Vh, len, D, c0, inv, ov);
}

constexpr decltype(&tile<1>) kTiles[kVectors + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>};

}  // namespace

void prompt_attention_avx2(const float* q, int64_t start, int64_t S, int64_t D, int64_t heads, int64_t kv_heads,
                           const c10::Half* K, int64_t k_stride, const c10::Half* V, int64_t v_stride, float* out,
                           int64_t out_stride) {
  const int64_t L = (start + S + kKeys - 1) / kKeys * kKeys;  // slots 0 .. start + S - 1, padded
  thread_local Scratch packed;                               // the calling thread's: each kv head's keys
  float* kt = packed.at_least<float>(kv_heads * L * D);
  at::parallel_for(0, kv_heads, 1, [&](int64_t a, int64_t b) {
    for (int64_t g = a; g < b; ++g) pack_keys(K + g * k_stride, start + S, L, D, kt + g * L * D);
  });
  const int64_t group = heads / kv_heads, blocks = (S + kUnitRows - 1) / kUnitRows, units = blocks * kv_heads;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    thread_local Scratch work_buf;
    float* work = work_buf.at_least<float>(kVectors * (D + L));
    for (int64_t u; (u = next.fetch_add(1)) < units;) {  // the longest prefixes first
      const int64_t b = blocks - 1 - u / kv_heads, g = u % kv_heads;
      const int64_t r0 = b * kUnitRows, r1 = std::min(S, r0 + kUnitRows);
      const int64_t count = (r1 - r0) * group;  // vectors (row, head), row by row
      for (int64_t i = 0; i < count; i += kVectors) {
        const int64_t n = std::min<int64_t>(kVectors, count - i);
        int64_t r[kVectors], h[kVectors];
        for (int64_t v = 0; v < n; ++v) r[v] = r0 + (i + v) / group, h[v] = g * group + (i + v) % group;
        kTiles[n](q, start, S, D, r, h, kt + g * L * D, V + g * v_stride, out, out_stride, work);
      }
    }
  });
}
