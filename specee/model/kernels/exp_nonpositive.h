// e^x for x <= 0 in AVX-512 and in AVX2 (the softmax of row_attention.cpp and prompt_attention.cpp,
// the SiLU of activation.cpp), and the AVX2 softmax that row_attention.cpp and prompt_attention_avx2.cpp share.
#pragma once
#include <immintrin.h>

#include <cstdint>

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

// A row's softmax after its scores, in AVX2: the maximum of s[0 .. len) is that of `best`'s lanes; over
// ceil(n / 8) blocks of 8 (n >= len) s[t] becomes e^(s[t] - max) for t < len and 0 past it, summed 8 lanes at a
// time in key order. Returns 1 / the sum.
__attribute__((target("avx2,fma"), always_inline)) inline float softmax_avx2(float* s, int64_t len, int64_t n,
                                                                           __m256 best) {
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(best), _mm256_extractf128_ps(best, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const __m256 m = _mm256_set1_ps(_mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4))));
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 total = _mm256_setzero_ps();
  for (int64_t t = 0; t < n; t += 8) {
    const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(len - t)), lane));
    const __m256 e = _mm256_and_ps(live, exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + t), m)));
    _mm256_storeu_ps(s + t, e);
    total = _mm256_add_ps(total, e);
  }
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(total), _mm256_extractf128_ps(total, 1));
  s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return 1.0f / _mm_cvtss_f32(_mm_add_ss(s4, _mm_movehdup_ps(s4)));
}
