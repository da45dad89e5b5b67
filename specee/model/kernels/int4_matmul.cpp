// int4 weights (groups of 32, W = (q - 8) s + z, s and z bf16) times activations quantized per
// group of 32 to int8, with AVX-512 VNNI integer dot products: how llama.cpp multiplies its Q4
// blocks. Why: PyTorch's CPU int4 kernel widens every weight to float32, which on this class of
// CPU costs more than reading it (Qwen2.5-1.5B's gate/up, 1 row: 0.80 ms against 0.64 here, 2
// rows 0.98 against 0.69). The activations' int8 rounding is this kernel's one approximation
// (model/quant.py tests it against the product with those rounded activations, to float error).
//
// Layout (model/quant.py packs it): 64 outputs at a time, 4 tiles of 16; for each 8 inputs c, the
// 4 tiles' 64 bytes each: byte j of tile t holds output 16 t + j / 4, input 8 c + j % 4 in its low
// nibble and input 8 c + 4 + j % 4 in its high nibble, so one load, two masks and two VNNI dot
// products (16 lanes x 4 inputs) cover 16 outputs x 8 inputs. Scales: bf16 [N/64][G][s, z][64].
#include "int4_matmul.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>

namespace {

constexpr int64_t kGroup = 32;

#define SPECEE_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))

SPECEE_VNNI inline __m512 bf16_to_float(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// R rows (1 to 4) x one 64-output block (T = 4 tiles of 16): x8 [R][K/4] int8 quads, dx (scale) and
// xs (sum of the rounded activations) [R][G]. The R x T integer accumulators live in registers; the
// float sums too for up to 2 rows, else in a small array in L1 (taking the tiles two at a time
// instead would read the weights twice where a block outgrows L2).
template <int R>
SPECEE_VNNI void block(const uint8_t* w, const uint16_t* sz, const int32_t* x8, const float* dx, const float* xs,
                       int64_t K, float* y, int64_t N) {
  constexpr int T = 4;
  const int64_t G = K / kGroup;
  constexpr bool in_registers = R <= 2;
  __m512 reg[in_registers ? R : 1][in_registers ? T : 1];
  alignas(64) float mem[in_registers ? 1 : R][in_registers ? 1 : T][16] = {};
  if constexpr (in_registers)
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) reg[r][t] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < G; ++g) {
    __m512i acc[R][T];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_si512();
    for (int c = 0; c < kGroup / 8; ++c) {
      const uint8_t* wc = w + (g * (kGroup / 8) + c) * 256;
      __m512i lo_x[R], hi_x[R];
      for (int r = 0; r < R; ++r) {
        const int64_t quad = (g * kGroup + c * 8) / 4;
        lo_x[r] = _mm512_set1_epi32(x8[r * (K / 4) + quad]);
        hi_x[r] = _mm512_set1_epi32(x8[r * (K / 4) + quad + 1]);
      }
      for (int t = 0; t < T; ++t) {
        const __m512i v = _mm512_loadu_si512(wc + t * 64);
        const __m512i lo = _mm512_and_si512(v, nibble);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        for (int r = 0; r < R; ++r) {
          acc[r][t] = _mm512_dpbusd_epi32(acc[r][t], lo, lo_x[r]);
          acc[r][t] = _mm512_dpbusd_epi32(acc[r][t], hi, hi_x[r]);
        }
      }
    }
    // sum_k W x = s dx sum(q x8) + (z - 8 s) sum(x): per group, per output
    const uint16_t* szg = sz + g * 128;
    for (int t = 0; t < T; ++t) {
      const __m512 s = bf16_to_float(szg + t * 16);
      const __m512 z8 = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), s, bf16_to_float(szg + 64 + t * 16));
      for (int r = 0; r < R; ++r) {
        __m512 o;
        if constexpr (in_registers) o = reg[r][t]; else o = _mm512_load_ps(mem[r][t]);
        o = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][t]), _mm512_mul_ps(s, _mm512_set1_ps(dx[r * G + g])), o);
        o = _mm512_fmadd_ps(z8, _mm512_set1_ps(xs[r * G + g]), o);
        if constexpr (in_registers) reg[r][t] = o; else _mm512_store_ps(mem[r][t], o);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) {
      if constexpr (in_registers) _mm512_storeu_ps(y + r * N + 16 * t, reg[r][t]);
      else std::copy(mem[r][t], mem[r][t] + 16, y + r * N + 16 * t);
    }
}

}  // namespace

bool int4_supported() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
}

std::vector<at::Tensor> int4_quantize_activations(const at::Tensor& x) {
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t M = xf.size(0), K = xf.size(1), G = K / kGroup;
  TORCH_CHECK(xf.dim() == 2 && K % kGroup == 0, "int4_mm: activations [M, K] with K a multiple of 32");
  at::Tensor x8 = at::empty({M, K}, at::kChar), dx = at::empty({M, G}, at::kFloat), xs = at::empty({M, G}, at::kFloat);
  const float* X = xf.data_ptr<float>();
  int8_t* Q = x8.data_ptr<int8_t>();
  float* D = dx.data_ptr<float>();
  float* S = xs.data_ptr<float>();
  for (int64_t i = 0; i < M * G; ++i) {
    const float* xg = X + i * kGroup;
    float mx = 0.f;
    for (int j = 0; j < kGroup; ++j) mx = std::max(mx, std::fabs(xg[j]));
    const float d = mx / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
    int32_t sum = 0;
    for (int j = 0; j < kGroup; ++j) {
      const int v = static_cast<int>(std::nearbyint(xg[j] * inv));
      Q[i * kGroup + j] = static_cast<int8_t>(v);
      sum += v;
    }
    D[i] = d;
    S[i] = d * static_cast<float>(sum);
  }
  return {x8, dx, xs};
}

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0), N = blocks * 64, G = K / kGroup;
  TORCH_CHECK(packed.dim() == 4 && packed.size(1) == K / 8 && scales.size(0) == blocks && scales.size(1) == G,
              "int4_mm: weight packed for another shape");
  const std::vector<at::Tensor> q = int4_quantize_activations(x);
  at::Tensor y = at::empty({M, N}, at::kFloat);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const uint16_t* sz = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  const int32_t* x8 = reinterpret_cast<const int32_t*>(q[0].data_ptr());
  const float* dx = q[1].data_ptr<float>();
  const float* xs = q[2].data_ptr<float>();
  float* out = y.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* wb = w + b * (K / 8) * 256;
      const uint16_t* sb = sz + b * G * 128;
      int64_t r = 0;
      auto rows = [&](auto kernel) { kernel(wb, sb, x8 + r * (K / 4), dx + r * G, xs + r * G, K, out + r * N + b * 64, N); };
      for (; r + 4 <= M; r += 4) rows(block<4>);
      if (M - r == 3) rows(block<3>);
      else if (M - r == 2) rows(block<2>);
      else if (M - r == 1) rows(block<1>);
    }
  });
  return y;
}
