// A prompt's products on AMX tiles (Intel Xeon 4th generation and later): the weights of a 32-output
// unit dequantized once a call to bf16 (int4: W = (q - 8) s + z; GGUF K-quants: gguf's own float32
// dequantization), rounded once to nearest even, the activations rounded to bf16, and `tdpbf16ps`
// summing 16 rows x 16 outputs x 32 inputs an instruction into float32 over all of K. Why: a prompt's
// rows are compute-bound, and the int8 path's per-group scales cap AMX int8 tiles at 1.24-1.35x of
// VNNI (BENCHMARKS.md, sessions 25 and 30); with the scales folded into the weights nothing interrupts
// the tiles' sums: SmolLM2's products run 2.3-3.2x the int8 kernel's speed from ~64 rows.
//
// A row's outputs are the same whatever rows share the call: every (row, output) sum runs the same
// instructions over K in the same order. The arithmetic is not the decode rows' (int8 activations),
// so decode_layer.cpp sends only a prompt's rows here, by a rule that depends on the request alone.
#include "amx_prompt.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <atomic>
#include <utility>

#include "amx_tiles.h"
#include "int4_common.h"
#include "kquant.h"

#ifdef SPECEE_AMX_BUILT
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

std::atomic<bool> g_enabled{true};

#ifdef SPECEE_AMX_BUILT
using namespace specee_int4;
using specee_scratch::Scratch;

constexpr int64_t kUnit = 32;             // outputs a thread's unit computes: two 16-output tiles
constexpr int64_t kTileElems = 16 * 32;   // one B tile: 16 rows of input pairs x 16 outputs x 2 bf16
constexpr int64_t kPanelRows = 128;       // rows every unit of a chunk runs before the next rows (they stay in L2)
constexpr int64_t kScratchBytes = 1 << 20;  // a thread's dequantized tiles at a time: half an L2 of 2 MB
constexpr int64_t kConvertGrain = 16384;  // activations worth rounding in a parallel region

// tmm0, tmm1: A (rows 0-15 and 16-31 of 32 bf16 inputs); tmm2, tmm3: B (the unit's two output
// tiles); tmm4..7: C (A0 B0, A0 B1, A1 B0, A1 B1). r1 = 0 leaves tmm1, 6 and 7 unused.
SPECEE_AMX_BF16 void configure(int r0, int r1) {
  specee_amx::TileConfig c;
  c.rows[0] = c.rows[4] = c.rows[5] = r0;
  c.rows[1] = c.rows[6] = c.rows[7] = r1;
  c.rows[2] = c.rows[3] = 16;
  for (int i = 0; i < 8; ++i) c.colsb[i] = c.rows[i] ? 64 : 0;
  specee_amx::load_config(c);
}

// A lane's weight is code x a + b (its scale and offset), as bf16: for a pair of B tile rows, a and b
// of lanes 0-7 and 8-15, each twice (a row holds an output's two inputs side by side).
struct LaneScale {
  __m512 a0, a1, b0, b1;
};
SPECEE_AMX_BF16 inline LaneScale lane_scale(__m512 a, __m512 b) {
  const __m512i lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
  return {_mm512_permutexvar_ps(lo, a), _mm512_permutexvar_ps(hi, a), _mm512_permutexvar_ps(lo, b),
          _mm512_permutexvar_ps(hi, b)};
}

// B tile rows 2c and 2c + 1 (at rows, 32 bf16 each) from a quad: 16 lanes, byte e of lane o the code
// of input 4c + e of output o (the kernels' unpacked form), w = code a + b (one FMA, one rounding).
SPECEE_AMX_BF16 inline void store_quad(__m512i quad, const LaneScale& s, uint16_t* rows) {
  const __m256i pairs[2] = {_mm512_cvtepi32_epi16(quad), _mm512_cvtepi32_epi16(_mm512_srli_epi32(quad, 16))};
  for (int j = 0; j < 2; ++j) {
    const __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(pairs[j])));
    const __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(pairs[j], 1)));
    const __m512bh w = _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(f1, s.a1, s.b1), _mm512_fmadd_ps(f0, s.a0, s.b0));
    _mm512_store_si512(rows + 32 * j, (__m512i)w);
  }
}

// int4 (int4_common.h's layout): unit u is half u % 2 of 64-output block u / 2; per group of 32
// inputs a tile's scale s and offset z - 8 s (tile_scales), and per 4 inputs its 32 bytes as a quad
// (unpack16).
struct Int4Units {
  const uint8_t* w;
  const uint16_t* sz;
  int64_t K;
  SPECEE_AMX_BF16 void operator()(int64_t u, uint16_t* out) const {
    const int64_t G = K / kGroup;
    const uint8_t* wb = w + (u / 2) * (K / 4) * 128;
    const uint16_t* sb = sz + (u / 2) * G * 128;
    for (int64_t g = 0; g < G; ++g)
      for (int tt = 0; tt < 2; ++tt) {
        const int t = 2 * static_cast<int>(u % 2) + tt;
        const TileScales sc = tile_scales(sb + g * 128, t);
        const LaneScale ls = lane_scale(sc.s, sc.z8);
        for (int c = 0; c < kGroup / 4; ++c)
          store_quad(unpack16(wb + (g * (kGroup / 4) + c) * 128 + t * 32), ls, out + (g * 2 + tt) * kTileElems + 64 * c);
      }
  }
};

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vnni,avx512bf16,amx-tile,amx-bf16")
namespace gguf {  // GGUF blocks read as kquant.cpp's AVX-512 level reads them
#include "kquant_avx512.h"
#include "kquant_codes.h"
}  // namespace gguf
#pragma GCC pop_options

// Quad C (inputs 4 C .. 4 C + 3) of block b of tile j, of type Q, as codes: one byte an input.
template <int64_t Q, int C>
SPECEE_AMX_BF16 inline __m512i quad(const gguf::Tiles& t, int j, int b) {
  if constexpr (Q == kQ80) return gguf::V::load(t.vec(C, j));  // the int8 code + 128
  else if constexpr (Q == kQ50) return gguf::q5_quad<C>(t, j);
  else if constexpr (Q == kQ6K) return gguf::q6_quad<C>(t, j, b);
  else return gguf::q4_quad<C>(t, j, b);
}

// Block b's 8 quads as B tile rows at out, each with its lane scale (Q6_K: one per half of 16 inputs).
template <int64_t Q, int... C>
SPECEE_AMX_BF16 inline void store_quads(const gguf::Tiles& t, int j, int b, const LaneScale (&ls)[2], uint16_t* out,
                                        std::integer_sequence<int, C...>) {
  (store_quad(quad<Q, C>(t, j, b), ls[Q == kQ6K ? C / 4 : 0], out + 64 * C), ...);
}

// GGUF blocks in kquant.cpp's layout (see there): unit u is tiles 2u and 2u + 1, each from its entry
// (base, type, g, j); a lane's scale and offset per block as gguf's dequantization computes them, so
// the float32 weight before rounding is gguf's own.
struct KQuantUnits {
  const uint8_t* w;
  const int64_t* tiles;
  int64_t K;
  SPECEE_AMX_BF16 void operator()(int64_t u, uint16_t* out) const {
    for (int tt = 0; tt < 2; ++tt) tile(tiles + 4 * (2 * u + tt), out + tt * kTileElems);
  }

  // one tile: B tiles of 32 inputs at out + 2 kTileElems i for block i
  SPECEE_AMX_BF16 void tile(const int64_t* e, uint16_t* out) const {
    const int64_t type = e[1], g = e[2], bytes = g * kquant_block_bytes(type);
    const int j = static_cast<int>(e[3]);
    const auto quads = std::make_integer_sequence<int, 8>{};
    if (type == kQ4K || type == kQ6K) {
      for (int64_t sb = 0; sb < K / 256; ++sb) {
        const uint8_t* blk = w + e[0] + sb * bytes;
        const gguf::Tiles t{blk, 64 * g};
        for (int b = 0; b < 8; ++b) {
          uint16_t* o = out + (sb * 8 + b) * 2 * kTileElems;
          LaneScale ls[2];
          if (type == kQ4K) {  // w = d sc q - dmin m
            __m512 d, dmin;
            __m512i sc, m;
            gguf::q4_d_dmin(t, j, d, dmin);
            gguf::q4_scale_min(t, j, b, sc, m);
            ls[0] = lane_scale(_mm512_mul_ps(d, _mm512_cvtepi32_ps(sc)),
                               _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(m))));
            store_quads<kQ4K>(t, j, b, ls, o, quads);
          } else {  // w = d sc_h (q - 32), sc_h per 16 inputs (int8), q's high 2 bits apart
            const __m512 d = gguf::tail_d(blk, 52, g, j);
            __m512i s[2];
            gguf::q6_scales(t, j, b, s[0], s[1]);
            for (int h = 0; h < 2; ++h) {
              const __m512 a = _mm512_mul_ps(d, _mm512_cvtepi32_ps(s[h]));
              ls[h] = lane_scale(a, _mm512_mul_ps(_mm512_set1_ps(-32.f), a));
            }
            store_quads<kQ6K>(t, j, b, ls, o, quads);
          }
        }
      }
      return;
    }
    for (int64_t b = 0; b < K / 32; ++b) {  // Q8_0: w = d (q - 128), q a byte; Q5_0: w = d (q - 16), 5 bits
      const uint8_t* blk = w + e[0] + b * bytes;
      const gguf::Tiles t{blk, 64 * g};
      const __m512 d = gguf::tail_d(blk, type == kQ80 ? 8 : 5, g, j);
      const LaneScale ls[2] = {lane_scale(d, _mm512_mul_ps(_mm512_set1_ps(type == kQ80 ? -128.f : -16.f), d)), {}};
      if (type == kQ80)
        store_quads<kQ80>(t, j, 0, ls, out + b * 2 * kTileElems, quads);
      else
        store_quads<kQ50>(t, j, 0, ls, out + b * 2 * kTileElems, quads);
    }
  }
};

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

// A thread's units [u0, u1), a chunk of them at a time (their tiles within kScratchBytes, in L2): the
// chunk dequantized once into the thread's scratch, then every row, a panel of rows at a time.
template <class Units>
SPECEE_AMX_BF16 void run_units(const Units& units, const uint16_t* x, int64_t M, int64_t K, float* y, int64_t N,
                               int64_t u0, int64_t u1) {
  const int64_t G = K / kGroup, unit_elems = G * 2 * kTileElems;
  const int64_t chunk = std::max<int64_t>(1, kScratchBytes / (unit_elems * 2));
  thread_local Scratch scratch;  // the thread's dequantized tiles
  uint16_t* b = scratch.at_least<uint16_t>(std::min(chunk, u1 - u0) * unit_elems);
  int configured = -1;
  for (int64_t c0 = u0; c0 < u1; c0 += chunk) {
    const int64_t c1 = std::min(u1, c0 + chunk);
    for (int64_t u = c0; u < c1; ++u) units(u, b + (u - c0) * unit_elems);
    for (int64_t p0 = 0; p0 < M; p0 += kPanelRows) {
      const int64_t p1 = std::min(M, p0 + kPanelRows);
      for (int64_t u = c0; u < c1; ++u)
        for (int64_t m = p0; m < p1; m += 32) {
          const int rows = static_cast<int>(std::min<int64_t>(32, p1 - m));
          if (rows != configured) configure(std::min(16, rows), std::max(0, rows - 16)), configured = rows;
          const uint16_t* bu = b + (u - c0) * unit_elems;
          if (rows > 16)
            unit_rows<true>(x + m * K, bu, K, G, y + m * N + u * kUnit, N);
          else
            unit_rows<false>(x + m * K, bu, K, G, y + m * N + u * kUnit, N);
        }
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

// x [M, K] float32 rounded to bf16, then units [0, N / 32) split between threads.
template <class Units>
at::Tensor tiles_mm(const at::Tensor& x, const Units& units, int64_t N, const at::Tensor& out_rows) {
  const at::Tensor xf = x.contiguous();
  const int64_t M = xf.size(0), K = xf.size(1);
  at::Tensor xb = at::empty({M, K}, at::kShort);
  uint16_t* xbp = reinterpret_cast<uint16_t*>(xb.data_ptr());
  const float* xp = xf.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, kConvertGrain / K),
                   [&](int64_t r0, int64_t r1) { round_to_bf16(xp + r0 * K, xbp + r0 * K, (r1 - r0) * K); });
  at::Tensor y = product_output(out_rows, M, N, false);
  float* out = y.data_ptr<float>();
  at::parallel_for(0, N / kUnit, 1, [&](int64_t u0, int64_t u1) { run_units(units, xbp, M, K, out, N, u0, u1); });
  return y;
}
#endif

// amx_available: amx_prompt.h
void check_input(const at::Tensor& x, const char* what) {
  TORCH_CHECK(amx_available(), what, ": this CPU (or its kernel) gives no AMX-BF16 tiles");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % specee_int4::kGroup == 0, what,
              ": float32 activations [M, K], K a multiple of 32");
}

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

bool prompt_tiles_on() { return g_enabled.load(); }

bool amx_enabled() { return prompt_tiles_on() && amx_available() && int4_level() == specee_int4::kAvx512; }

void amx_set_enabled(bool on) { g_enabled.store(on); }

at::Tensor int4_mm_amx(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& out) {
  check_input(x, "int4_mm_amx");
  TORCH_CHECK(packed.size(1) * 4 == x.size(1), "int4_mm_amx: a weight packed for K = ", x.size(1));
#ifdef SPECEE_AMX_BUILT
  return tiles_mm(x, Int4Units{packed.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr()), x.size(1)},
                  packed.size(0) * 64, out);
#else
  return {};
#endif
}

at::Tensor kquant_mm_amx(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& tiles, const at::Tensor& out) {
  check_input(x, "kquant_mm_amx");
  TORCH_CHECK(tiles.size(0) % 2 == 0, "kquant_mm_amx: an even number of 16-output tiles (kquant_check'ed)");
#ifdef SPECEE_AMX_BUILT
  return tiles_mm(x, KQuantUnits{packed.data_ptr<uint8_t>(), tiles.data_ptr<int64_t>(), x.size(1)}, tiles.size(0) * 16, out);
#else
  return {};
#endif
}
