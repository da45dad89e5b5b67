// int4 weights (groups of 32, W = (q - 8) s + z, s and z bf16) times activations rounded to bf16,
// float32 sums: the arithmetic of PyTorch's int4 CPU kernel, which on this class of CPU spends more
// time widening each weight to float32 than reading it. Three paths, chosen at run time (CPUID, or
// lower with int4_set_level: SPECEE_CPU_LEVEL in Python; avx512 also needs BF16, else avx2 runs:
// int4_bf16_level), each row's outputs computed by the same
// operations whatever rows share the call (speculative verification stays equal to one-token steps):
//   avx512  a nibble becomes a bf16 in two integer ops: 0x4300 | q is the bf16 of 128 + q, exact, so
//           one `vdpbf16ps` multiplies 16 outputs x 2 inputs and per group
//               sum_k x_k W_k = s sum_k x_k (128 + q_k) + (z - 136 s) sum_k x_k,
//           every product exact in float32;
//   avx2    q widened to float32 and FMA: s sum_k x_k q_k + (z - 8 s) sum_k x_k (products exact);
//   portable the avx2 path's sums in plain loops (multiply, then add).
// The paths differ only in float32 summation order. A weight tile is unpacked once for up to 4
// rows, so a verification pass's extra rows cost their products, not another pass of unpacking.
// The output is float32 (PyTorch's kernel rounds it to bf16). int4_set_activations(1) sends every
// product to the int8-activation kernel instead (int4_q8.cpp); the layout: int4_common.h.
#include "int4_matmul.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>

#include "int4_common.h"
#include "scratch.h"

namespace {

using specee_scratch::Scratch;

using namespace specee_int4;
std::atomic<int64_t> g_level{-1};  // -1: the best this CPU runs, read on first use
std::atomic<int64_t> g_activations{0};  // 0 bf16, 1 int8

#ifdef SPECEE_X86

// R rows (1 to 4) x one block of 64 outputs. xp: the rows' bf16 activations as pairs [R][K/2];
// xs: their sums per group [R][G]; y: row r's outputs at y + r N.
template <int R>
SPECEE_INT4_AVX512_BF16 void block_avx512(const uint8_t* w, const uint16_t* sz, const uint32_t* xp, const float* xs,
                                          int64_t K, float* y, int64_t N) {
  constexpr int T = 4;
  const int64_t G = K / kGroup;
  __m512 out[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) out[r][t] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi16(0x000F), bf16_128 = _mm512_set1_epi16(0x4300);
  for (int64_t g = 0; g < G; ++g) {
    prefetch_group(w, sz, g, R);
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
      const __m512 s = bf16x16_to_float(szg + t * 16);
      const __m512 z136 = _mm512_fnmadd_ps(_mm512_set1_ps(136.f), s, bf16x16_to_float(szg + 64 + t * 16));
      for (int r = 0; r < R; ++r) {
        out[r][t] = _mm512_fmadd_ps(acc[r][t], s, out[r][t]);
        out[r][t] = _mm512_fmadd_ps(z136, _mm512_set1_ps(xs[r * G + g]), out[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) _mm512_storeu_ps(y + r * N + 16 * t, out[r][t]);
}

// 8 outputs x inputs k..k+3 for R rows: the 16 bytes at p as 8 uint32 (byte 2 lane + e at bits
// 8 e) hold input k + 0..3 as (v >> 0, 8, 4, 12) & 15.
template <int R>
SPECEE_INT4_AVX2 __attribute__((always_inline)) inline void half_avx2(const uint8_t* p, const float* x, int64_t K,
                                                                 __m256 (&acc)[R]) {
  const __m256i nibble = _mm256_set1_epi32(0xF);
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256 q0 = _mm256_cvtepi32_ps(_mm256_and_si256(v, nibble));
  const __m256 q1 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 8), nibble));
  const __m256 q2 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 4), nibble));
  const __m256 q3 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 12), nibble));
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_fmadd_ps(q0, _mm256_broadcast_ss(x + r * K + 0), acc[r]);
    acc[r] = _mm256_fmadd_ps(q1, _mm256_broadcast_ss(x + r * K + 1), acc[r]);
    acc[r] = _mm256_fmadd_ps(q2, _mm256_broadcast_ss(x + r * K + 2), acc[r]);
    acc[r] = _mm256_fmadd_ps(q3, _mm256_broadcast_ss(x + r * K + 3), acc[r]);
  }
}

// One half's group sums into row r's outputs: out += acc s + (z - 8 s) sum_k x_k.
template <int R>
SPECEE_INT4_AVX2 __attribute__((always_inline)) inline void finish_avx2(const uint16_t* szh, const float* xs, int64_t G,
                                                                   const __m256 (&acc)[R], float* y, int64_t N) {
  const __m256 s = bf16x8_to_float(szh);
  const __m256 z8 = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), s, bf16x8_to_float(szh + 64));
  for (int r = 0; r < R; ++r) {
    const __m256 o = _mm256_fmadd_ps(acc[r], s, _mm256_loadu_ps(y + r * N));
    _mm256_storeu_ps(y + r * N, _mm256_fmadd_ps(z8, _mm256_set1_ps(xs[r * G]), o));
  }
}

// As block_avx512 with xf: the rows' bf16 activations widened to float32 [R][K], and y zeroed.
// Eight outputs at a time (half a tile: 16 bytes per 4 inputs), summed per group in registers;
// J such halves side by side, so that few rows still give several independent chains of FMAs
// (one chain waits on each FMA's latency: a single row ran at a third of the speed).
template <int R, int J = (R <= 2 ? 4 : 1)>
SPECEE_INT4_AVX2 void block_avx2(const uint8_t* w, const uint16_t* sz, const float* xf, const float* xs, int64_t K,
                            float* y, int64_t N) {
  const int64_t G = K / kGroup;
  for (int64_t g = 0; g < G; ++g) {
    prefetch_group(w, sz, g, R);
    for (int j0 = 0; j0 < 8; j0 += J) {
      __m256 acc[J][R];
      for (int j = 0; j < J; ++j)
        for (int r = 0; r < R; ++r) acc[j][r] = _mm256_setzero_ps();
      for (int c = 0; c < kGroup / 4; ++c)
        for (int j = 0; j < J; ++j)
          half_avx2<R>(w + (g * (kGroup / 4) + c) * 128 + (j0 + j) * 16, xf + g * kGroup + c * 4, K, acc[j]);
      for (int j = 0; j < J; ++j) finish_avx2<R>(sz + g * 128 + (j0 + j) * 8, xs + g, G, acc[j], y + (j0 + j) * 8, N);
    }
  }
}
#endif  // SPECEE_X86

// block_avx2's arithmetic in plain C++ (any CPU): per output, the same sums with a multiply and an add.
template <int R>
void block_portable(const uint8_t* w, const uint16_t* sz, const float* xf, const float* xs, int64_t K, float* y,
                    int64_t N) {
  const int64_t G = K / kGroup;
  for (int64_t g = 0; g < G; ++g) {
    const uint16_t* szg = sz + g * 128;
    for (int t = 0; t < 4; ++t) {
      float acc[R][16] = {};
      for (int c = 0; c < kGroup / 4; ++c) {
        const uint8_t* wc = w + (g * (kGroup / 4) + c) * 128 + t * 32;
        float lo[32], hi[32];  // unpacked once for all rows: byte 2 lane + e -> inputs e and 2 + e
        for (int i = 0; i < 32; ++i) lo[i] = wc[i] & 15, hi[i] = wc[i] >> 4;
        for (int r = 0; r < R; ++r) {
          const float* x = xf + r * K + g * kGroup + c * 4;
          for (int lane = 0; lane < 16; ++lane)
            acc[r][lane] = acc[r][lane] + lo[2 * lane] * x[0] + lo[2 * lane + 1] * x[1] + hi[2 * lane] * x[2] +
                           hi[2 * lane + 1] * x[3];
        }
      }
      for (int lane = 0; lane < 16; ++lane) {
        const float s = bf16_to_float(szg[t * 16 + lane]), z8 = bf16_to_float(szg[64 + t * 16 + lane]) - 8.f * s;
        for (int r = 0; r < R; ++r) {
          float& out = y[r * N + t * 16 + lane];
          out += acc[r][lane] * s;
          out += z8 * xs[r * G + g];
        }
      }
    }
  }
}

// R rows of one 64-output block at `level`.
template <int R>
void rows_at(int64_t level, const uint8_t* w, const uint16_t* sz, const uint32_t* xp, const float* xf,
             const float* xs, int64_t K, float* y, int64_t N) {
#ifdef SPECEE_X86
  if (level == kAvx512) return block_avx512<R>(w, sz, xp, xs, K, y, N);
  if (level == kAvx2) return block_avx2<R>(w, sz, xf, xs, K, y, N);
#endif
  block_portable<R>(w, sz, xf, xs, K, y, N);
}

// Rows sharing one unpacking of a weight tile: more did not pay (BENCHMARKS.md, "int4 kernel
// levels"): past 4 rows the dot products, not the unpacking, take the time.
constexpr int kMaxRows = 4;
constexpr decltype(&rows_at<1>) kRows[kMaxRows + 1] = {nullptr, rows_at<1>, rows_at<2>, rows_at<3>, rows_at<4>};

int64_t best_level() {
#ifdef SPECEE_X86
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni"))
    return kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
#endif
  return kPortable;
}

}  // namespace

int64_t int4_best_level() { return best_level(); }

int64_t int4_bf16_level() {
#ifdef SPECEE_X86
  static const bool bf16 = best_level() == kAvx512 && __builtin_cpu_supports("avx512bf16");
#else
  constexpr bool bf16 = false;
#endif
  const int64_t level = int4_level();
  return level == kAvx512 && !bf16 ? kAvx2 : level;
}

int64_t int4_level() {
  if (g_level.load() < 0) g_level.store(best_level());
  return g_level.load();
}

void int4_set_level(int64_t level) {
  TORCH_CHECK(level >= kPortable && level <= best_level(), "int4 kernel level ", level,
              " is not available on this CPU (best: ", best_level(), ")");
  g_level.store(level);
}

int64_t int4_activations() { return g_activations.load(); }

void int4_set_activations(int64_t mode) {
  TORCH_CHECK(mode == 0 || mode == 1, "int4 activations: 0 (bf16) or 1 (int8), not ", mode);
  g_activations.store(mode);
}

bool int4_prefetch() { return g_prefetch.load(); }

void int4_set_prefetch(bool on) { g_prefetch.store(on); }

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& out_rows) {
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), blocks = packed.size(0), N = blocks * 64, G = K / kGroup;
  TORCH_CHECK(xc.dim() == 2 && (xc.scalar_type() == at::kFloat || xc.scalar_type() == at::kBFloat16) &&
              packed.dim() == 4 && packed.size(1) == K / 4 && scales.size(0) == blocks && scales.size(1) == G,
              "int4_mm: float32 or bf16 activations and a weight packed for their shape");
  if (g_activations.load() == 1) return int4_mm_q8(xc, packed, scales, int4_level(), out_rows);
  const int64_t level = int4_bf16_level();
  // the activations rounded to bf16 (as `x.to(torch.bfloat16)` rounds) and their sums per group, in
  // plain loops: in a decode step this runs for every product, where ATen calls cost more than the work
  thread_local Scratch xb_buf, sums_buf, xf_buf;  // the calling thread's, kept between calls
  c10::BFloat16* xb = xb_buf.at_least<c10::BFloat16>(M * K);
  float* sums = sums_buf.at_least<float>(M * G);
  float* xf = level == kAvx512 ? nullptr : xf_buf.at_least<float>(M * K);
  if (xc.scalar_type() == at::kFloat)
    std::copy(xc.data_ptr<float>(), xc.data_ptr<float>() + M * K, xb);  // float -> bf16, nearest even
  else
    std::copy(xc.data_ptr<c10::BFloat16>(), xc.data_ptr<c10::BFloat16>() + M * K, xb);
  std::fill(sums, sums + M * G, 0.f);
  for (int64_t i = 0; i < M * K; ++i) sums[i / kGroup] += static_cast<float>(xb[i]);
  if (xf) std::copy(xb, xb + M * K, xf);
  at::Tensor y = product_output(out_rows, M, N, level != kAvx512);  // avx2, portable add into it
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const uint16_t* sz = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(xb);
  float* out = y.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t r = 0; r < M; r += kMaxRows)
        kRows[std::min<int64_t>(kMaxRows, M - r)](level, w + b * (K / 4) * 128, sz + b * G * 128, xp + r * (K / 2),
                                                  xf ? xf + r * K : nullptr, sums + r * G, K,
                                                  out + r * N + b * 64, N);
  });
  return y;
}
