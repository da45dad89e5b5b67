// Activations quantized to int8 per block of 32 inputs, as llama.cpp's Q8_1 (int4_q8.cpp's products and
// kquant.cpp's): d = max|x| / 127, x_q = round(x / d) to nearest even (x times the float32 1/d, as
// llama.cpp), and d times the block's sum of x_q. The same results at every level (AVX-512, AVX2,
// portable), bit for bit.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "int4_common.h"

namespace specee_int4 {
namespace {

float round_even(float v) {
#ifdef SPECEE_X86
  return static_cast<float>(_mm_cvtss_si32(_mm_set_ss(v)));  // the MXCSR's rounding: nearest even
#else
  return std::nearbyint(v);
#endif
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

}  // namespace

void quantize_groups(const float* x, int64_t g0, int64_t g1, int64_t level, int8_t* q, float* d, float* ds,
                     int32_t* s16) {
  if (g1 > g0)
    quantize_at(level)(x + g0 * kGroup, g1 - g0, q + g0 * kGroup, d + g0, ds + g0, s16 ? s16 + 2 * g0 : nullptr);
}

void quantize_activations(const float* x, int64_t M, int64_t K, int64_t level, int8_t* q, float* d, float* ds,
                          int32_t* s16) {
  const int64_t G = K / kGroup;
  at::parallel_for(0, M, std::max<int64_t>(1, kQuantizeGrain / K),
                   [&](int64_t r0, int64_t r1) { quantize_groups(x, r0 * G, r1 * G, level, q, d, ds, s16); });
}


}  // namespace specee_int4
