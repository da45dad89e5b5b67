// SiLU(gate) * up in AVX-512 (16 at a time) or AVX2 (8), with row_attention's polynomial exp. Why: the C++
// layer's scalar loop called libm's exp per element, 9% of SmolLM2's prefill (AMD EPYC, 2 threads).
#include "activation.h"

#include <cmath>

#include "exp_nonpositive.h"
#include "int4_matmul.h"

namespace {

// elements from .. n in scalar arithmetic (the portable level, the vector loops' tails)
void silu_mul_scalar(const float* gate, const float* up, float* out, int64_t from, int64_t n) {
  for (int64_t i = from; i < n; ++i) out[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
}

// The exponential is taken of -|g| only (no overflow): g / (1 + e^-g) where g >= 0, and the same
// value written g e^g / (1 + e^g) below. NaN stays NaN (the product with g).
__attribute__((target("avx512f"))) void silu_mul_avx512(const float* gate, const float* up, float* out, int64_t n) {
  const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.f);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 g = _mm512_loadu_ps(gate + i);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(zero, _mm512_abs_ps(g)));
    const __m512 num = _mm512_mask_mul_ps(g, _mm512_cmp_ps_mask(g, zero, _CMP_LT_OQ), g, e);
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_div_ps(num, _mm512_add_ps(one, e)), _mm512_loadu_ps(up + i)));
  }
  silu_mul_scalar(gate, up, out, i, n);
}

// The same in AVX2, 8 at a time, the same bits (exp_nonpositive.h)
__attribute__((target("avx2,fma"))) void silu_mul_avx2(const float* gate, const float* up, float* out, int64_t n) {
  const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = exp_nonpositive(_mm256_or_ps(g, sign));  // -|g|
    const __m256 num = _mm256_blendv_ps(g, _mm256_mul_ps(g, e), _mm256_cmp_ps(g, zero, _CMP_LT_OQ));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(num, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
  }
  silu_mul_scalar(gate, up, out, i, n);
}

}  // namespace

void silu_mul(const float* gate, const float* up, float* out, int64_t n) {
  if (avx512_level())
    silu_mul_avx512(gate, up, out, n);
  else if (avx2_level())
    silu_mul_avx2(gate, up, out, n);
  else
    silu_mul_scalar(gate, up, out, 0, n);
}
