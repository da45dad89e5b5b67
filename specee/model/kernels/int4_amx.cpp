// A prompt's int4 products on AMX tiles (Intel Xeon 4th generation and later): the weights of a
// 32-output unit dequantized once to bf16, W = (q - 8) s + z rounded once (an FMA, then round to
// nearest even), the activations rounded to bf16, and `tdpbf16ps` summing 16 rows x 16 outputs x 32
// inputs an instruction into float32 over all of K. Why: a prompt's rows are compute-bound, and the
// int8 path's per-group scales cap AMX int8 tiles at 1.24-1.35x of VNNI (BENCHMARKS.md, sessions 25
// and 30); with the scales folded into the weights nothing interrupts the tiles' sums, and SmolLM2's
// products run 2.3-3.2x the VNNI kernel's speed from ~64 rows.
//
// A row's outputs are the same whatever rows share the call: every (row, output) sum runs the same
// instructions over K in the same order. The arithmetic is not the decode rows' (int8 activations),
// so decode_layer.cpp sends only a prompt's rows here, by a rule that depends on the request alone.
#include "int4_amx.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>

#include "int4_common.h"

#if defined(SPECEE_X86) && (defined(__clang__) ? __clang_major__ >= 12 : __GNUC__ >= 11)
#define SPECEE_AMX_BUILT 1
#include <sys/syscall.h>
#include <unistd.h>
#define SPECEE_AMX_BF16 __attribute__((target("avx512f,avx512bw,avx512bf16,amx-tile,amx-bf16")))
#endif

namespace {

std::atomic<bool> g_enabled{true};

#ifdef SPECEE_AMX_BUILT
using namespace specee_int4;

constexpr int64_t kUnit = 32;             // outputs a thread's unit computes: two 16-output tiles
constexpr int64_t kTileElems = 16 * 32;   // one B tile: 16 rows of input pairs x 16 outputs x 2 bf16
constexpr int64_t kPanelRows = 128;       // rows every unit runs before the next rows (they stay in L2)
constexpr int64_t kConvertGrain = 16384;  // activations worth rounding in a parallel region

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0, tmm1: A (rows 0-15 and 16-31 of 32 bf16 inputs); tmm2, tmm3: B (the unit's two output
// tiles); tmm4..7: C (A0 B0, A0 B1, A1 B0, A1 B1). r1 = 0 leaves tmm1, 6 and 7 unused.
SPECEE_AMX_BF16 void configure(int r0, int r1) {
  TileConfig c;
  c.rows[0] = c.rows[4] = c.rows[5] = r0;
  c.rows[1] = c.rows[6] = c.rows[7] = r1;
  c.rows[2] = c.rows[3] = 16;
  for (int i = 0; i < 8; ++i) c.colsb[i] = c.rows[i] ? 64 : 0;
  // GCC 12's _tile_loadconfig tells the compiler it reads 8 bytes, which lets it drop stores to the rest
  __asm__ volatile("ldtilecfg %0" ::"m"(c));
}

// One unit (64-output block w/sz of the packed layout, half h) as B tiles [G][2][16][32] bf16: row
// 2c + j of a group's tile holds inputs 4c + 2j and 4c + 2j + 1 of each of 16 outputs, which is the
// packed layout's byte 2 lane + e, low nibble (j = 0) or high (j = 1): no shuffle, only widening.
SPECEE_AMX_BF16 void dequantize_unit(const uint8_t* w, const uint16_t* sz, int64_t G, int h, uint16_t* out) {
  const __m512i dup_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i dup_hi = _mm512_add_epi32(dup_lo, _mm512_set1_epi32(8));
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (int64_t g = 0; g < G; ++g)
    for (int tt = 0; tt < 2; ++tt) {
      const int t = 2 * h + tt;
      const __m512 s = bf16x16_to_float(sz + g * 128 + t * 16);
      const __m512 z8 = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), s, bf16x16_to_float(sz + g * 128 + 64 + t * 16));
      const __m512 s0 = _mm512_permutexvar_ps(dup_lo, s), s1 = _mm512_permutexvar_ps(dup_hi, s);
      const __m512 z0 = _mm512_permutexvar_ps(dup_lo, z8), z1 = _mm512_permutexvar_ps(dup_hi, z8);
      uint16_t* o = out + (g * 2 + tt) * kTileElems;
      for (int c = 0; c < kGroup / 4; ++c) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (g * (kGroup / 4) + c) * 128 + t * 32));
        const __m256i q[2] = {_mm256_and_si256(v, nibble), _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble)};
        for (int j = 0; j < 2; ++j) {
          const __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(q[j])));
          const __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(q[j], 1)));
          const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(f1, s1, z1), _mm512_fmadd_ps(f0, s0, z0));
          _mm512_store_si512(o + (2 * c + j) * 32, (__m512i)b);
        }
      }
    }
}

// Up to 32 rows (as configured: 16 + 16 when Two) x the unit's 32 outputs, summed over all G groups.
template <bool Two>
SPECEE_AMX_BF16 void unit_rows(const uint16_t* x, const uint16_t* b, int64_t K, int64_t G, float* y, int64_t N) {
  _tile_zero(4);
  _tile_zero(5);
  if (Two) {
    _tile_zero(6);
    _tile_zero(7);
  }
  for (int64_t g = 0; g < G; ++g) {
    _tile_loadd(0, x + g * kGroup, K * 2);
    if (Two) _tile_loadd(1, x + 16 * K + g * kGroup, K * 2);
    _tile_loadd(2, b + g * 2 * kTileElems, 64);
    _tile_loadd(3, b + (g * 2 + 1) * kTileElems, 64);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(5, 0, 3);
    if (Two) {
      _tile_dpbf16ps(6, 1, 2);
      _tile_dpbf16ps(7, 1, 3);
    }
  }
  _tile_stored(4, y, N * 4);
  _tile_stored(5, y + 16, N * 4);
  if (Two) {
    _tile_stored(6, y + 16 * N, N * 4);
    _tile_stored(7, y + 16 * N + 16, N * 4);
  }
}

// A thread's units [u0, u1): each dequantized once into the thread's scratch, then every row.
SPECEE_AMX_BF16 void run_units(const uint16_t* x, int64_t M, int64_t K, const uint8_t* w, const uint16_t* sz, float* y,
                               int64_t N, int64_t u0, int64_t u1) {
  const int64_t G = K / kGroup, unit_elems = G * 2 * kTileElems;
  thread_local at::Tensor scratch;  // 64-byte aligned; kept between calls (fresh pages cost a prompt ~5%)
  if (!scratch.defined() || scratch.numel() < (u1 - u0) * unit_elems) scratch = at::empty({(u1 - u0) * unit_elems}, at::kShort);
  uint16_t* b = reinterpret_cast<uint16_t*>(scratch.data_ptr());
  for (int64_t u = u0; u < u1; ++u)
    dequantize_unit(w + (u / 2) * (K / 4) * 128, sz + (u / 2) * G * 128, G, static_cast<int>(u % 2), b + (u - u0) * unit_elems);
  int configured = -1;
  for (int64_t p0 = 0; p0 < M; p0 += kPanelRows) {
    const int64_t p1 = std::min(M, p0 + kPanelRows);
    for (int64_t u = u0; u < u1; ++u)
      for (int64_t m = p0; m < p1; m += 32) {
        const int rows = static_cast<int>(std::min<int64_t>(32, p1 - m));
        if (rows != configured) configure(std::min(16, rows), std::max(0, rows - 16)), configured = rows;
        const uint16_t* bu = b + (u - u0) * unit_elems;
        if (rows > 16)
          unit_rows<true>(x + m * K, bu, K, G, y + m * N + u * kUnit, N);
        else
          unit_rows<false>(x + m * K, bu, K, G, y + m * N + u * kUnit, N);
      }
  }
  _tile_release();
}

SPECEE_AMX_BF16 void round_to_bf16(const float* x, uint16_t* out, int64_t n) {
  int64_t i = 0;
  for (; i + 32 <= n; i += 32)
    _mm512_storeu_si512(out + i, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i)));
  for (; i < n; ++i) out[i] = static_cast<uint16_t>(_mm256_extract_epi16((__m256i)_mm512_cvtneps_pbh(_mm512_set1_ps(x[i])), 0));
}
#endif

}  // namespace

bool amx_available() {
#ifdef SPECEE_AMX_BUILT
  // the CPU has the tiles and Linux lets this process use them (each process asks: arch_prctl
  // ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA), with the AVX-512 level the rest of the kernels run
  static const bool ok = __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
                         __builtin_cpu_supports("avx512bf16") && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
#else
  return false;
#endif
}

bool amx_enabled() { return g_enabled.load() && amx_available() && int4_level() == 2; }

void amx_set_enabled(bool on) { g_enabled.store(on); }

at::Tensor int4_mm_amx(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  TORCH_CHECK(amx_available(), "int4_mm_amx: this CPU (or its kernel) gives no AMX-BF16 tiles");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && packed.size(1) * 4 == x.size(1) &&
                  x.size(1) % specee_int4::kGroup == 0,
              "int4_mm_amx: float32 activations [M, K] and a weight packed for K");
#ifdef SPECEE_AMX_BUILT
  const at::Tensor xf = x.contiguous();
  const int64_t M = xf.size(0), K = xf.size(1), N = packed.size(0) * 64;
  at::Tensor xb = at::empty({M, K}, at::kShort);
  uint16_t* xbp = reinterpret_cast<uint16_t*>(xb.data_ptr());
  const float* xp = xf.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, kConvertGrain / K),
                   [&](int64_t r0, int64_t r1) { round_to_bf16(xp + r0 * K, xbp + r0 * K, (r1 - r0) * K); });
  at::Tensor y = at::empty({M, N}, at::kFloat);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const uint16_t* sz = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  float* out = y.data_ptr<float>();
  at::parallel_for(0, N / kUnit, 1, [&](int64_t u0, int64_t u1) { run_units(xbp, M, K, w, sz, out, N, u0, u1); });
  return y;
#else
  return {};
#endif
}
