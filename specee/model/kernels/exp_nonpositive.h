// e^x for x <= 0 in AVX-512 and in AVX2 (the softmax of row_attention.cpp and prompt_attention.cpp,
// the SiLU of activation.cpp).
#pragma once
#include <immintrin.h>

// x log2(e) = n + f, |f| <= 1/2, 2^f by its Taylor polynomial to f^6 (relative error ~1e-7; Horner's
// rule from the f^6 term), then scaled by 2^n; below -87 the result is clamped to e^-87 (the softmax's
// and SiLU's zero).
constexpr float kExp2Poly[7] = {1.5403530393381606e-4f, 1.3333558146428443e-3f, 9.6181291076284772e-3f,
                                5.5504108664821580e-2f, 2.4022650695910071e-1f, 6.9314718055994531e-1f, 1.0f};

__attribute__((target("avx512f"))) inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly[i]));
  return _mm512_scalef_ps(p, n);
}

// The same in 8 lanes, the same bits: 2^n (n >= -126, so a normal float) is built in the exponent
// field, and p 2^n rounds as scalef does (exactly, or once where the result is subnormal).
__attribute__((target("avx2,fma"))) inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[i]));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}
