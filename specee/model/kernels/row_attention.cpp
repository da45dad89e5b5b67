// One query row's attention over its own prefix of the cache (a decode step's row, or one row of a
// chain being verified), in AVX-512: scores, a softmax with a polynomial exp, the weighted sum of
// values, each in a fixed order. Why: ATen's scaled dot-product attention costs ~37 us a call for
// one row (SmolLM2, 2026-11 AMD EPYC), 72% of a step with 8 requests, whose rows attend one at a
// time; this takes a few. Every single-row attention of the C++ layer goes through here (decode
// rows, chain rows, alone or batched), so a row's numbers never depend on what shares its step.
// The cache may hold float16 (the default where this runs): each key and value widens on load.
#include "row_attention.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "int4_matmul.h"

namespace {

#define SPECEE_AVX512 __attribute__((target("avx512f")))

// 2^x * e^0 for x <= 0 as e^x: x log2(e) = n + f, |f| <= 1/2, 2^f by its Taylor polynomial to f^6
// (relative error ~1e-7), then scaled by 2^n.
SPECEE_AVX512 inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// 16 keys' or values' floats from the cache, stored as float32 or float16
SPECEE_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
SPECEE_AVX512 inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <typename KV>
SPECEE_AVX512 void head_avx512(const float* q, const KV* K, const KV* V, int64_t len, int64_t D, float* scores,
                               float* out) {
  const int64_t C = D / 16;  // 16-float chunks of a head (D <= 256: at most 16 registers)
  __m512 qv[16];
  const __m512 scale = _mm512_set1_ps(1.0f / std::sqrt(static_cast<float>(D)));
  for (int64_t c = 0; c < C; ++c) qv[c] = _mm512_mul_ps(_mm512_loadu_ps(q + 16 * c), scale);
  float best = -INFINITY;
  for (int64_t t = 0; t < len; ++t) {
    const KV* k = K + t * D;
    __m512 acc = _mm512_mul_ps(qv[0], load16(k));
    for (int64_t c = 1; c < C; ++c) acc = _mm512_fmadd_ps(qv[c], load16(k + 16 * c), acc);
    scores[t] = _mm512_reduce_add_ps(acc);
    best = std::max(best, scores[t]);
  }
  const __m512 m = _mm512_set1_ps(best);
  __m512 total = _mm512_setzero_ps();
  for (int64_t t = 0; t < len; t += 16) {
    const __mmask16 live = len - t >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (len - t)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(live, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, scores + t), m)));
    _mm512_mask_storeu_ps(scores + t, live, e);
    total = _mm512_add_ps(total, e);
  }
  __m512 acc[16];
  for (int64_t c = 0; c < C; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < len; ++t) {
    const __m512 p = _mm512_set1_ps(scores[t]);
    const KV* v = V + t * D;
    for (int64_t c = 0; c < C; ++c) acc[c] = _mm512_fmadd_ps(p, load16(v + 16 * c), acc[c]);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
  for (int64_t c = 0; c < C; ++c) _mm512_storeu_ps(out + 16 * c, _mm512_mul_ps(acc[c], inv));
}

template <typename KV>
void attend_heads(const float* q, int64_t q_stride, const KV* K, int64_t k_stride, const KV* V, int64_t v_stride,
                  int64_t len, int64_t head_dim, int64_t heads, int64_t kv_heads, float* out) {
  thread_local std::vector<float> scores;
  if (static_cast<int64_t>(scores.size()) < len + 16) scores.resize(len + 16);
  const int64_t group = heads / kv_heads;
  for (int64_t h = 0; h < heads; ++h) {
    const int64_t g = h / group;
    head_avx512(q + h * q_stride, K + g * k_stride, V + g * v_stride, len, head_dim, scores.data(), out + h * head_dim);
  }
}

SPECEE_AVX512 void to_half_avx512(const float* x, c10::Half* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm512_cvtps_ph(_mm512_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; i < n; ++i) out[i] = c10::Half(x[i]);
}

}  // namespace

bool row_attention_available(int64_t head_dim) {
  return head_dim % 16 == 0 && head_dim <= 256 && int4_level() == 2;  // 2: the AVX-512 level (int4_matmul.cpp)
}

void row_attention(const float* q, int64_t q_stride, const float* K, int64_t k_stride, const float* V,
                   int64_t v_stride, int64_t len, int64_t head_dim, int64_t heads, int64_t kv_heads, float* out) {
  attend_heads(q, q_stride, K, k_stride, V, v_stride, len, head_dim, heads, kv_heads, out);
}

void row_attention(const float* q, int64_t q_stride, const c10::Half* K, int64_t k_stride, const c10::Half* V,
                   int64_t v_stride, int64_t len, int64_t head_dim, int64_t heads, int64_t kv_heads, float* out) {
  attend_heads(q, q_stride, K, k_stride, V, v_stride, len, head_dim, heads, kv_heads, out);
}

void to_half(const float* x, c10::Half* out, int64_t n) {
  if (int4_level() == 2) {
    to_half_avx512(x, out, n);
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = c10::Half(x[i]);  // round to nearest even, as torch's .half()
  }
}
