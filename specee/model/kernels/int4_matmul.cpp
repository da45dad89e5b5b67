// int4 weights (groups of 32, W = (q - 8) s + z, s and z bf16) times activations rounded to bf16,
// with AVX-512 BF16 dot products: the arithmetic of PyTorch's int4 CPU kernel (bf16 activations,
// float32 sums), which on this class of CPU spends more time widening each weight to float32 than
// reading it. Here a nibble becomes a bf16 in two integer ops: 0x4300 | q is the bf16 of 128 + q,
// exact, so one `vdpbf16ps` multiplies 16 outputs x 2 inputs and per group
//     sum_k x_k W_k = s sum_k x_k (128 + q_k) + (z - 136 s) sum_k x_k,
// every product exact in float32. A weight tile is unpacked once for up to 4 rows, so a
// verification pass's extra rows cost a dot product each, not another pass of unpacking.
// The output is float32 (PyTorch's kernel rounds it to bf16).
//
// Layout (model/quant.py packs it): 64 outputs at a time, 4 tiles of 16; for every 4 inputs c the
// 4 tiles' 32 bytes each: byte 2 lane + e holds input 4 c + e of output 16 t + lane in its low
// nibble and input 4 c + 2 + e in its high nibble. Scales: bf16 [N/64][G][s, z][64].
#include "int4_matmul.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;

#define SPECEE_BF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))

SPECEE_BF16 inline __m512 bf16_to_float(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// R rows (1 to 4) x one block of 64 outputs. xp: the rows' bf16 activations as pairs [R][K/2];
// xs: their sums per group [R][G]; y: row r's outputs at y + r N.
template <int R>
SPECEE_BF16 void block(const uint8_t* w, const uint16_t* sz, const uint32_t* xp, const float* xs, int64_t K,
                       float* y, int64_t N) {
  constexpr int T = 4;
  const int64_t G = K / kGroup;
  __m512 out[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) out[r][t] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi16(0x000F), bf16_128 = _mm512_set1_epi16(0x4300);
  for (int64_t g = 0; g < G; ++g) {
    __m512 acc[R][T];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
    for (int c = 0; c < kGroup / 4; ++c) {
      const uint8_t* wc = w + (g * (kGroup / 4) + c) * 128;
      const int64_t pair = (g * kGroup + c * 4) / 2;
      __m512bh x_lo[R], x_hi[R];
      for (int r = 0; r < R; ++r) {
        x_lo[r] = (__m512bh)_mm512_set1_epi32(xp[r * (K / 2) + pair]);
        x_hi[r] = (__m512bh)_mm512_set1_epi32(xp[r * (K / 2) + pair + 1]);
      }
      for (int t = 0; t < T; ++t) {
        const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc + t * 32)));
        const __m512bh lo = (__m512bh)_mm512_ternarylogic_epi32(v, nibble, bf16_128, 0xEA);  // (v & nibble) | 0x4300
        const __m512bh hi = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(v, 4), bf16_128);
        for (int r = 0; r < R; ++r) {
          acc[r][t] = _mm512_dpbf16_ps(acc[r][t], lo, x_lo[r]);
          acc[r][t] = _mm512_dpbf16_ps(acc[r][t], hi, x_hi[r]);
        }
      }
    }
    const uint16_t* szg = sz + g * 128;
    for (int t = 0; t < T; ++t) {
      const __m512 s = bf16_to_float(szg + t * 16);
      const __m512 z136 = _mm512_fnmadd_ps(_mm512_set1_ps(136.f), s, bf16_to_float(szg + 64 + t * 16));
      for (int r = 0; r < R; ++r) {
        out[r][t] = _mm512_fmadd_ps(acc[r][t], s, out[r][t]);
        out[r][t] = _mm512_fmadd_ps(z136, _mm512_set1_ps(xs[r * G + g]), out[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) _mm512_storeu_ps(y + r * N + 16 * t, out[r][t]);
}

}  // namespace

bool int4_supported() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512bf16");
}

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), blocks = packed.size(0), N = blocks * 64, G = K / kGroup;
  TORCH_CHECK(xc.dim() == 2 && (xc.scalar_type() == at::kFloat || xc.scalar_type() == at::kBFloat16) &&
              packed.dim() == 4 && packed.size(1) == K / 4 && scales.size(0) == blocks && scales.size(1) == G,
              "int4_mm: float32 or bf16 activations and a weight packed for their shape");
  // the activations rounded to bf16 (as `x.to(torch.bfloat16)` rounds) and their sums per group, in
  // plain loops: in a decode step this runs for every product, where ATen calls cost more than the work
  std::vector<c10::BFloat16> xb(M * K);
  std::vector<float> sums(M * G, 0.f);
  if (xc.scalar_type() == at::kFloat)
    std::copy(xc.data_ptr<float>(), xc.data_ptr<float>() + M * K, xb.begin());  // float -> bf16, nearest even
  else
    std::copy(xc.data_ptr<c10::BFloat16>(), xc.data_ptr<c10::BFloat16>() + M * K, xb.begin());
  for (int64_t i = 0; i < M * K; ++i) sums[i / kGroup] += static_cast<float>(xb[i]);
  at::Tensor y = at::empty({M, N}, at::kFloat);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const uint16_t* sz = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(xb.data());
  const float* xs = sums.data();
  float* out = y.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* wb = w + b * (K / 4) * 128;
      const uint16_t* sb = sz + b * G * 128;
      int64_t r = 0;
      auto rows = [&](auto kernel) { kernel(wb, sb, xp + r * (K / 2), xs + r * G, K, out + r * N + b * 64, N); };
      for (; r + 4 <= M; r += 4) rows(block<4>);
      if (M - r == 3) rows(block<3>);
      if (M - r == 2) rows(block<2>);
      if (M - r == 1) rows(block<1>);
    }
  });
  return y;
}
