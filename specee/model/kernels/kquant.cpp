// GGUF Q4_K (4.5 bits a weight), Q6_K (6.56), Q5_0 (5.5) and Q8_0 (8.5) run from their own blocks,
// repacked per 16 outputs (model/quant_gguf.py) without adding a byte, times activations quantized
// per block of 32 to int8 as int4_q8.cpp's (quantize_q8.cpp). Why: the int4 repack (a bf16 scale and zero
// per 32) and the int8 widening of Q5_0 and Q6_K read 15-45% more bytes per token than the file, and
// decoding reads weights.
//
// Layout: per part, tiles of 16 outputs (lane o = output o) in groups of g = 4 (fewer at a part's
// end); per group, its (super-)blocks of 256 inputs (K-quants) or 32 (Q5_0, Q8_0) one after the
// other, each the group's tiles' 64-byte vectors interleaved, vector v of tile j at (v g + j) 64, in
// the order the kernel reads them, then their tails. A tile's vectors (4 bytes a lane), per block:
//   0-31    nibbles: vector 4 b + a, byte e of lane o holds inputs 32 b + 8 a + e (low nibble) and
//           32 b + 8 a + 4 + e (high nibble): Q4_K's codes, Q6_K's low 4 bits
//   Q4_K    32-34: ggml's 12 scale bytes of output o as three words A, B, C (6-bit sc_b, m_b);
//           35: d of the 16 outputs (fp16), then dmin                               = 2304 B a tile
//   Q6_K    32-47: high 2 bits, vector 32 + 2 b + h: byte e holds inputs 32 b + 16 h + 4 cc + e at
//           bits 2 cc (cc = 0..3); 48-51: the int8 scales per 16 inputs, vector 48 + b / 2, byte
//           2 (b % 2) + h; then, after the group's vectors, d (fp16), 32 bytes a tile = 3360 B a tile
//   Q5_0    0-3: nibbles as above (b = 0); 4: the 5th bits, bit C of byte e of lane o = input 4 C + e's;
//           then d (fp16), 32 bytes a tile                                           = 352 B a tile
//   Q8_0    0-7: vector C, byte e of lane o = input 4 C + e's int8 code + 128; then d = 544 B a tile
// Integer dot products: `vpdpbusd` (AVX-512 VNNI), `vpmaddubsw` + `vpmaddwd` (AVX2: pairs at most
// 2 x 63 x 127, exact in int16; Q8_0's bytes in two parts, 0-127 and 0 or 128), plain loops (portable). Every float32 operation is an FMA in the
// same order at every level (std::fmaf in the portable path), so all levels give the same bits and
// a row's output does not depend on the rows sharing the call. The body: kquant_tile.h (and, for 3-4
// rows of Q4_K / Q6_K / Q5_0 at AVX2, kquant_avx2.h).
#include "kquant.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "int4_common.h"
#include "int4_matmul.h"
#include "scratch.h"

namespace {

using specee_scratch::Scratch;

using specee_int4::kGroup;
// Q5_0 / Q8_0: blocks ahead prefetched (4 tiles' blocks: 1.4 / 2.2 KB each). Qwen2.5-0.5B's gate/up
// (Q5_0, 6 MB) on one core, AMD EPYC: none 0.21 ms, 2 blocks 0.16, 4 0.15, 8 0.12, 16 0.13; the same
// from memory on 2 cores of an Intel Xeon with AMX (reads 21 GB/s): 8 blocks 385 us, 12 398, 16 294, 32 310.
constexpr int64_t kPrefetchBlocks = 16;
// Q4_K / Q6_K: super-blocks ahead prefetched (4 tiles': 9.2 / 13.4 KB). Qwen2.5-1.5B's gate/up (Q4_K,
// 15.5 MB) from memory, 2 cores of that Xeon: 1 ahead 950-1085 us, 2 763, 3 772, 4 804; its decode
// 15.6-16.0 -> 20.5-21.3 tokens/s at 2 (alternating processes). The EPYCs' own streams were measured at 1.
constexpr int64_t kSuperBlocksAhead = 2;
constexpr int kMaxRows = 4;  // rows sharing a tile's unpacking (more would spill the accumulators)

// Quantized activations of some rows: q [R][K] int8 (read 4 at a time), per block of 32 the step
// dx and dx times the block's sum of q, and the int32 sums of q per 16 inputs.
struct Act {
  const int8_t* xq;
  const float* xd;
  const float* xds;
  const int32_t* xs16;
  int64_t K;
  int32_t q4(int r, int64_t i) const {
    int32_t v;
    std::memcpy(&v, xq + r * K + 4 * i, 4);
    return v;
  }
  float dx(int r, int64_t b) const { return xd[r * (K / 32) + b]; }
  float ds(int r, int64_t b) const { return xds[r * (K / 32) + b]; }
  int32_t s16(int r, int64_t h) const { return xs16[r * (K / 16) + h]; }
  Act rows_from(int64_t r) const { return {xq + r * K, xd + r * (K / 32), xds + r * (K / 32), xs16 + r * (K / 16), K}; }
};

float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

// ---- portable: 16 lanes in plain loops ------------------------------------------------------------
namespace portable {
struct V {
  struct I { int32_t v[16]; };
  struct F { float v[16]; };
  static I load(const uint8_t* p) { I r; std::memcpy(r.v, p, 64); return r; }
  static I set1(int32_t a) { I r; for (auto& e : r.v) e = a; return r; }
  template <class Op> static I map(const I& a, Op op) { I r; for (int i = 0; i < 16; ++i) r.v[i] = op(a.v[i], i); return r; }
  static I and_(const I& a, uint32_t m) { return map(a, [&](int32_t e, int) { return static_cast<int32_t>(e & m); }); }
  static I or_(const I& a, const I& b) { return map(a, [&](int32_t e, int i) { return e | b.v[i]; }); }
  static I add(const I& a, const I& b) { return map(a, [&](int32_t e, int i) { return e + b.v[i]; }); }
  static I mul(const I& a, const I& b) { return map(a, [&](int32_t e, int i) { return e * b.v[i]; }); }
  template <int S> static I shl(const I& a) { return map(a, [](int32_t e, int) { return static_cast<int32_t>(static_cast<uint32_t>(e) << S); }); }
  template <int S> static I shr(const I& a) { return map(a, [](int32_t e, int) { return static_cast<int32_t>(static_cast<uint32_t>(e) >> S); }); }
  template <int S> static I sar(const I& a) { return map(a, [](int32_t e, int) { return e >> S; }); }
  static I shlv(const I& a, int n) { return map(a, [&](int32_t e, int) { return static_cast<int32_t>(static_cast<uint32_t>(e) << n); }); }
  static I shrv(const I& a, int n) { return map(a, [&](int32_t e, int) { return static_cast<int32_t>(static_cast<uint32_t>(e) >> n); }); }
  static I dot(const I& acc, const I& w, const I& x) {  // + sum_e u8(w byte e) s8(x byte e), per lane
    return map(acc, [&](int32_t e, int i) {
      for (int b = 0; b < 4; ++b)
        e += static_cast<int32_t>((static_cast<uint32_t>(w.v[i]) >> 8 * b) & 255) * static_cast<int8_t>(x.v[i] >> 8 * b);
      return e;
    });
  }
  static I dot_wide(const I& acc, const I& w, const I& x) { return dot(acc, w, x); }  // any byte w: exact
  static I dot_pairs(const I& acc, const I& w, const I& x) { return dot(acc, w, x); }  // AVX2's pair sums, summed
  static I pairs_sum(const I& a) { return a; }
  static F fzero() { F r; for (auto& e : r.v) e = 0.f; return r; }
  static F fset1(float a) { F r; for (auto& e : r.v) e = a; return r; }
  static F cvt(const I& a) { F r; for (int i = 0; i < 16; ++i) r.v[i] = static_cast<float>(a.v[i]); return r; }
  static F fmul(const F& a, const F& b) { F r; for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] * b.v[i]; return r; }
  static F fma(const F& a, const F& b, const F& c) { F r; for (int i = 0; i < 16; ++i) r.v[i] = std::fmaf(a.v[i], b.v[i], c.v[i]); return r; }
  static F fnma(const F& a, const F& b, const F& c) { F r; for (int i = 0; i < 16; ++i) r.v[i] = std::fmaf(-a.v[i], b.v[i], c.v[i]); return r; }
  static F half(const uint16_t* p) { F r; for (int i = 0; i < 16; ++i) r.v[i] = half_to_float(p[i]); return r; }
  static void store(float* p, const F& a) { std::memcpy(p, a.v, 64); }
  static F loadf(const float* p) { F r; std::memcpy(r.v, p, 64); return r; }
};
#include "kquant_tile.h"
}  // namespace portable

#ifdef SPECEE_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
namespace eight {  // 8 lanes a register: a half of V below, and kquant_avx2.h's halves of tiles
struct V {
  using I = __m256i;
  using F = __m256;
  static I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I set1(int32_t v) { return _mm256_set1_epi32(v); }
  static I and_(I x, uint32_t m) { return _mm256_and_si256(x, _mm256_set1_epi32(static_cast<int32_t>(m))); }
  static I or_(I x, I y) { return _mm256_or_si256(x, y); }
  static I add(I x, I y) { return _mm256_add_epi32(x, y); }
  static I mul(I x, I y) { return _mm256_mullo_epi32(x, y); }
  template <int S> static I shl(I x) { return _mm256_slli_epi32(x, S); }
  template <int S> static I shr(I x) { return _mm256_srli_epi32(x, S); }
  template <int S> static I sar(I x) { return _mm256_srai_epi32(x, S); }
  static I shlv(I x, int n) { return _mm256_sll_epi32(x, _mm_cvtsi32_si128(n)); }
  static I shrv(I x, int n) { return _mm256_srl_epi32(x, _mm_cvtsi32_si128(n)); }
  static F half(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
};
}  // namespace eight

// 16 lanes as two AVX2 halves (eight::V's).
struct V {
  using H = eight::V;
  struct I { __m256i a, b; };
  struct F { __m256 a, b; };
  static I load(const uint8_t* p) { return {H::load(p), H::load(p + 32)}; }
  static I set1(int32_t v) { return {H::set1(v), H::set1(v)}; }
  static I and_(const I& x, uint32_t m) { return {H::and_(x.a, m), H::and_(x.b, m)}; }
  static I or_(const I& x, const I& y) { return {H::or_(x.a, y.a), H::or_(x.b, y.b)}; }
  static I add(const I& x, const I& y) { return {H::add(x.a, y.a), H::add(x.b, y.b)}; }
  static I mul(const I& x, const I& y) { return {H::mul(x.a, y.a), H::mul(x.b, y.b)}; }
  template <int S> static I shl(const I& x) { return {H::shl<S>(x.a), H::shl<S>(x.b)}; }
  template <int S> static I shr(const I& x) { return {H::shr<S>(x.a), H::shr<S>(x.b)}; }
  template <int S> static I sar(const I& x) { return {H::sar<S>(x.a), H::sar<S>(x.b)}; }
  static I shlv(const I& x, int n) { return {H::shlv(x.a, n), H::shlv(x.b, n)}; }
  static I shrv(const I& x, int n) { return {H::shrv(x.a, n), H::shrv(x.b, n)}; }
  static __m256i dot1(__m256i acc, __m256i w, __m256i x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
  }
  static I dot(const I& acc, const I& w, const I& x) { return {dot1(acc.a, w.a, x.a), dot1(acc.b, w.b, x.b)}; }
  static __m256i dot_wide1(__m256i acc, __m256i w, __m256i x) {  // bytes 0-255: pairs of 2 x 255 x 127 would saturate
    const __m256i top = _mm256_set1_epi8(static_cast<char>(0x80));
    return dot1(dot1(acc, _mm256_andnot_si256(top, w), x), _mm256_and_si256(top, w), x);
  }
  static I dot_wide(const I& acc, const I& w, const I& x) { return {dot_wide1(acc.a, w.a, x.a), dot_wide1(acc.b, w.b, x.b)}; }
  // A lane's two int16 sums (inputs 0, 1 and 2, 3 of each quad) added to in int16, without dot's vpmaddwd
  // and int32 add each quad: Q4_K's codes (0-15) against 8 quads of a block stay exact (16 x 15 x 127)
  static I dot_pairs(const I& acc, const I& w, const I& x) {
    return {_mm256_add_epi16(acc.a, _mm256_maddubs_epi16(w.a, x.a)), _mm256_add_epi16(acc.b, _mm256_maddubs_epi16(w.b, x.b))};
  }
  static I pairs_sum(const I& a) { const __m256i one = _mm256_set1_epi16(1); return {_mm256_madd_epi16(a.a, one), _mm256_madd_epi16(a.b, one)}; }
  static F fzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static F fset1(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
  static F cvt(const I& x) { return {_mm256_cvtepi32_ps(x.a), _mm256_cvtepi32_ps(x.b)}; }
  static F fmul(const F& x, const F& y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
  static F fma(const F& x, const F& y, const F& z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
  static F fnma(const F& x, const F& y, const F& z) { return {_mm256_fnmadd_ps(x.a, y.a, z.a), _mm256_fnmadd_ps(x.b, y.b, z.b)}; }
  static F half(const uint16_t* p) { return {H::half(p), H::half(p + 8)}; }
  static void store(float* p, const F& x) { _mm256_storeu_ps(p, x.a), _mm256_storeu_ps(p + 8, x.b); }
  static F loadf(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
};
#include "kquant_tile.h"
#include "kquant_avx2.h"
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vnni")
namespace avx512 {
#include "kquant_avx512.h"
#include "kquant_tile.h"
}  // namespace avx512
#pragma GCC pop_options
#endif  // SPECEE_X86

using RowsFn = decltype(&portable::tiles_rows<1, 1>);
struct Kernels {
  const RowsFn* one;   // [R]: one tile
  const RowsFn* side;  // [R]: the 4 tiles of a group
};

// The level's kernels: int4_level() (SPECEE_CPU_LEVEL lowers it); the AVX2 path also needs F16C
// (every AVX2 CPU so far has it), else it runs the portable one.
Kernels level_kernels() {
#ifdef SPECEE_X86
  const int64_t level = int4_level();
  if (level == specee_int4::kAvx512) return {avx512::kOne, avx512::kSide};
  if (level == specee_int4::kAvx2 && __builtin_cpu_supports("f16c")) return {avx2::kOneHalves, avx2::kSideHalves};
#endif
  return {portable::kOne, portable::kSide};
}

}  // namespace

void kquant_check(const at::Tensor& packed, const at::Tensor& tiles, int64_t K) {
  TORCH_CHECK(K > 0 && tiles.dim() == 2 && tiles.size(1) == 4 && tiles.is_contiguous() &&
                  tiles.scalar_type() == at::kLong && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "kquant: tiles int64 [T, 4], packed uint8");
  const int64_t* tile = tiles.data_ptr<int64_t>();
  for (int64_t i = 0; i < tiles.size(0); ++i) {
    const int64_t* e = tile + 4 * i;  // base, type, g, j
    const bool known = e[1] == kQ4K || e[1] == kQ6K || e[1] == kQ50 || e[1] == kQ80;
    TORCH_CHECK(known && K % kquant_block_inputs(e[1]) == 0 && e[0] >= 0 && e[2] >= 1 && e[2] <= kGroupTiles && e[3] >= 0 &&
                    e[3] < e[2] && e[0] + e[2] * kquant_block_bytes(e[1]) * (K / kquant_block_inputs(e[1])) <= packed.numel(),
                "kquant: tile ", i, " is not a Q4_K, Q6_K, Q5_0 or Q8_0 tile of K = ", K, " inside the packed bytes");
  }
}

at::Tensor kquant_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& tiles, const at::Tensor& out_rows) {
  const at::Tensor xf = x.scalar_type() == at::kFloat ? x.contiguous() : x.to(at::kFloat).contiguous();  // bf16 widens exactly
  const int64_t M = xf.size(0), K = xf.size(1), T = tiles.size(0), N = 16 * T;
  TORCH_CHECK(xf.dim() == 2 && K % 32 == 0 && tiles.dim() == 2 && tiles.size(1) == 4,
              "kquant_mm: activations [M, K] with K a multiple of 32, tiles [T, 4] (each checked once: kquant_check)");
  const int64_t* tile = tiles.data_ptr<int64_t>();
  thread_local Scratch q_buf, d_buf, ds_buf, s16_buf;  // the calling thread's, kept between calls
  int8_t* q = q_buf.at_least<int8_t>(M * K);
  float* d = d_buf.at_least<float>(M * K / kGroup);
  float* ds = ds_buf.at_least<float>(M * K / kGroup);
  int32_t* s16 = s16_buf.at_least<int32_t>(M * K / 16);
  specee_int4::quantize_activations(xf.data_ptr<float>(), M, K, int4_level(), q, d, ds, s16);
  const Act act{q, d, ds, s16, K};
  at::Tensor y = product_output(out_rows, M, N, true);  // each (super-)block adds into it
  const uint8_t* w = packed.data_ptr<uint8_t>();
  float* out = y.data_ptr<float>();
  const Kernels kernels = level_kernels();
  at::parallel_for(0, (T + kGroupTiles - 1) / kGroupTiles, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t t0 = g0 * kGroupTiles; t0 < std::min(T, g1 * kGroupTiles); t0 += kGroupTiles) {
      const int64_t n = std::min<int64_t>(kGroupTiles, T - t0);
      bool side = n == kGroupTiles;  // the 4 tiles of one group
      for (int64_t j = 0; j < n; ++j)
        side = side && tile[4 * (t0 + j)] == tile[4 * t0] && tile[4 * (t0 + j) + 2] == kGroupTiles && tile[4 * (t0 + j) + 3] == j;
      for (int64_t r = 0; r < M; r += kMaxRows) {
        const int R = static_cast<int>(std::min<int64_t>(kMaxRows, M - r));
        const int64_t J = side ? kGroupTiles : 1;
        for (int64_t j = 0; j < n; j += J)
          (side ? kernels.side : kernels.one)[R](tile[4 * (t0 + j) + 1], w + tile[4 * (t0 + j)], tile[4 * (t0 + j) + 2],
                                                  tile[4 * (t0 + j) + 3], act.rows_from(r), K, out + r * N + 16 * (t0 + j), N);
      }
    }
  });
  return y;
}

at::Tensor q8_0_rows(const at::Tensor& table, const at::Tensor& ids) {
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kByte && table.stride(1) == 1 &&
                  table.size(1) % 34 == 0 && ids.dim() == 1 && ids.scalar_type() == at::kLong,
              "q8_0_rows: table uint8 [N, blocks x 34] with contiguous rows, ids int64 [n]");
  const at::Tensor idc = ids.contiguous();
  const int64_t n = idc.size(0), N = table.size(0), blocks = table.size(1) / 34, K = 32 * blocks;
  at::Tensor out = at::empty({n, K}, at::kFloat);
  const int64_t* id = idc.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(0 <= id[r] && id[r] < N, "q8_0_rows: row ", id[r], " outside the table's ", N);
    const uint8_t* row = table.data_ptr<uint8_t>() + id[r] * table.stride(0);
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = row + 34 * b;
      c10::Half d;
      std::memcpy(&d, block, 2);
      const float scale = static_cast<float>(d);
      const int8_t* q = reinterpret_cast<const int8_t*>(block + 2);
      for (int64_t e = 0; e < 32; ++e) o[r * K + 32 * b + e] = static_cast<float>(q[e]) * scale;
    }
  }
  return out;
}
