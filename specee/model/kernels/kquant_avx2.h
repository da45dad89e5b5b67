// Q4_K, Q6_K and Q5_0 at the AVX2 level for 3 or 4 rows, 8 outputs a register: included by kquant.cpp inside
// its avx2 namespace, after kquant_tile.h (Act, tiles_rows); the codes and scales are kquant_codes.h's
// over 8-lane vectors. Why: kquant_tile.h's 16-lane vectors are
// two AVX2 registers each, so its sums of a group's 4 tiles and 3-4 rows (Q4_K: up to 16 int16 sums and
// 32 float ones) lived on the stack. Here a pass takes half a tile (8 outputs: the low or high 32 bytes
// of each 64-byte vector) for R rows, its R integer sums in registers. Qwen2.5-Coder-1.5B's products
// over every layer on 2 cores of an AMD EPYC Zen 3, the old kernel and this one alternating in one
// process: 4 rows 1.11-1.31x, 8 rows 1.15-1.27x, 64 rows (a prefill's) 1.27-1.28x; Qwen2.5-Coder-0.5B's
// (mostly Q5_0): 3 rows 1.30x, 4 rows 1.38-1.47x, 8 rows 1.39-1.42x, 64 rows 1.39-1.43x. One or two rows
// gained nothing here (their reads bound them), so they stay in kquant_tile.h. Each lane's integer sums
// are exact and its float32 operations are kquant_tile.h's in its order: the same bits
// (tests/test_kquant.py, tests/test_q5q8.py).

namespace eight {  // kquant_codes.h over kquant.cpp's 8-lane eight::V: the codes and scales of half a tile
#include "kquant_codes.h"
}  // namespace eight

// Half h of a group's tiles: its codes and scales at the low or high 32 bytes of each vector, its fp16 d
// (and dmin) 16 bytes on.
inline eight::Tiles half_codes(const uint8_t* base, int64_t g, int64_t h) { return {base + 32 * (h % 2), 64 * g}; }
inline const uint8_t* half_d(const uint8_t* base, int64_t h) { return base + 16 * (h % 2); }

// acc[r] += quad C of block b of the half (type Q) times row r's inputs: Q4_K's int16 pairs (one
// vpmaddubsw and one add), else int32 sums.
template <int64_t Q, int R, int C>
SPECEE_KQ_INLINE void quad(const eight::Tiles& w, int j, int b, const Act& x, int64_t blk, __m256i (&acc)[R]) {
  const __m256i code = Q == kQ4K ? eight::q4_quad<C>(w, j, b) : Q == kQ6K ? eight::q6_quad<C>(w, j, b) : eight::q5_quad<C>(w, j);
  for (int r = 0; r < R; ++r) {
    const __m256i p = _mm256_maddubs_epi16(code, _mm256_set1_epi32(x.q4(r, 8 * blk + C)));
    acc[r] = Q == kQ4K ? _mm256_add_epi16(acc[r], p) : _mm256_add_epi32(acc[r], _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
  }
}

template <int64_t Q, int R, int... C>
SPECEE_KQ_INLINE void quads(const eight::Tiles& w, int j, int b, const Act& x, int64_t blk, __m256i (&acc)[R],
                            std::integer_sequence<int, C...>) {
  (quad<Q, R, C>(w, j, b, x, blk, acc), ...);
}

// Half h (0 to 2 J - 1: tile j0 + h / 2's low or high 8 outputs) of super-block sb at base, R rows.
template <int R, bool Q6>
SPECEE_KQ_INLINE void kq_half(const uint8_t* base, int64_t g, int64_t j0, int64_t h, int64_t sb, const Act& x, float* y,
                              int64_t N) {
  const __m256i ones = _mm256_set1_epi16(1);
  const eight::Tiles w = half_codes(base, g, h);
  const int j = static_cast<int>(j0 + h / 2);  // the half's tile in the group
  __m256 fa[R], mins[8];  // Q4_K: each block's m, for the min term after the blocks
  for (int r = 0; r < R; ++r) fa[r] = _mm256_setzero_ps();
  for (int b = 0; b < 8; ++b) {
    const int64_t blk = sb * 8 + b;
    __m256i T[R];  // per row, the block's integer sum times its scale(s)
    if constexpr (!Q6) {
      __m256i acc[R];  // each output's int16 pair sums over the block (at most 16 x 15 x 127)
      for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
      quads<kQ4K>(w, j, b, x, blk, acc, std::make_integer_sequence<int, 8>{});
      __m256i sc, m;
      eight::q4_scale_min(w, j, b, sc, m);
      mins[b] = _mm256_cvtepi32_ps(m);
      for (int r = 0; r < R; ++r) T[r] = _mm256_mullo_epi32(sc, _mm256_madd_epi16(acc[r], ones));
    } else {
      __m256i lo[R], hi[R];  // inputs 0-15 and 16-31: sum q x - 32 sum x
      for (int r = 0; r < R; ++r)
        lo[r] = _mm256_set1_epi32(-32 * x.s16(r, 2 * blk)), hi[r] = _mm256_set1_epi32(-32 * x.s16(r, 2 * blk + 1));
      quads<kQ6K>(w, j, b, x, blk, lo, std::integer_sequence<int, 0, 1, 2, 3>{});
      quads<kQ6K>(w, j, b, x, blk, hi, std::integer_sequence<int, 4, 5, 6, 7>{});
      __m256i s0, s1;
      eight::q6_scales(w, j, b, s0, s1);
      for (int r = 0; r < R; ++r) T[r] = _mm256_add_epi32(_mm256_mullo_epi32(s0, lo[r]), _mm256_mullo_epi32(s1, hi[r]));
    }
    for (int r = 0; r < R; ++r) fa[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(T[r]), _mm256_set1_ps(x.dx(r, blk)), fa[r]);
  }
  float* o = y + 8 * h;
  if constexpr (!Q6) {
    __m256 d, dmin;
    eight::q4_d_dmin(eight::Tiles{half_d(base, h), 64 * g}, j, d, dmin);
    for (int r = 0; r < R; ++r) {
      __m256 fb = _mm256_setzero_ps();
      for (int b = 0; b < 8; ++b) fb = _mm256_fmadd_ps(mins[b], _mm256_set1_ps(x.ds(r, sb * 8 + b)), fb);
      _mm256_storeu_ps(o + r * N, _mm256_fnmadd_ps(dmin, fb, _mm256_fmadd_ps(d, fa[r], _mm256_loadu_ps(o + r * N))));
    }
  } else {
    const __m256 d = eight::tail_d(half_d(base, h), 52, g, j);
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(o + r * N, _mm256_fmadd_ps(d, fa[r], _mm256_loadu_ps(o + r * N)));
  }
}

// J tiles from tile j0 of a group of g, R rows, added into y (zeroed): super-block by super-block, half
// by half, each half's pass prefetching its share of the super-block kSuperBlocksAhead on.
template <int R, bool Q6>
void kq_halves(const uint8_t* base, int64_t g, int64_t j0, int64_t J, const Act& x, int64_t K, float* y, int64_t N) {
  const int64_t bytes = g * (Q6 ? kQ6Bytes : kQ4Bytes), halves = 2 * J;
  for (int64_t sb = 0; sb < K / 256; ++sb, base += bytes)
    for (int64_t h = 0; h < halves; ++h) {
      for (int64_t i = h * bytes / halves; i < (h + 1) * bytes / halves; i += 64)
        specee_int4::prefetch_l2(base + kSuperBlocksAhead * bytes + i);
      kq_half<R, Q6>(base, g, j0, h, sb, x, y, N);
    }
}

// Q5_0 (q32_tiles): J tiles from tile j0 of a group of g, R rows, block by block (32 inputs), half by half,
// each half's float sums (starting from y) on the stack between blocks.
template <int R>
void q5_halves(const uint8_t* base, int64_t g, int64_t j0, int64_t J, const Act& x, int64_t K, float* y, int64_t N) {
  const int64_t bytes = g * kQ5Bytes;
  __m256 acc[2 * kGroupTiles][R];
  for (int64_t h = 0; h < 2 * J; ++h)
    for (int r = 0; r < R; ++r) acc[h][r] = _mm256_loadu_ps(y + r * N + 8 * h);
  for (int64_t blk = 0; blk < K / 32; ++blk, base += bytes) {
    for (int64_t i = 0; i < bytes; i += 64) specee_int4::prefetch_l2(base + kPrefetchBlocks * bytes + i);
    for (int64_t h = 0; h < 2 * J; ++h) {
      const int j = static_cast<int>(j0 + h / 2);
      __m256i sums[R];
      for (int r = 0; r < R; ++r) sums[r] = _mm256_set1_epi32(-16 * (x.s16(r, 2 * blk) + x.s16(r, 2 * blk + 1)));
      quads<kQ50>(half_codes(base, g, h), j, 0, x, blk, sums, std::make_integer_sequence<int, 8>{});
      const __m256 d = eight::tail_d(half_d(base, h), 5, g, j);
      for (int r = 0; r < R; ++r)
        acc[h][r] = _mm256_fmadd_ps(d, _mm256_mul_ps(_mm256_cvtepi32_ps(sums[r]), _mm256_set1_ps(x.dx(r, blk))), acc[h][r]);
    }
  }
  for (int64_t h = 0; h < 2 * J; ++h)
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * N + 8 * h, acc[h][r]);
}

// kquant_tile.h's tiles_rows with Q4_K, Q6_K and Q5_0 of 3 or 4 rows taken here.
template <int R, int J>
void halves_rows(int64_t type, const uint8_t* base, int64_t g, int64_t j0, const Act& x, int64_t K, float* y, int64_t N) {
  if constexpr (R >= 3) {
    if (type == kQ4K) return kq_halves<R, false>(base, g, j0, J, x, K, y, N);
    if (type == kQ6K) return kq_halves<R, true>(base, g, j0, J, x, K, y, N);
    if (type == kQ50) return q5_halves<R>(base, g, j0, J, x, K, y, N);
  }
  tiles_rows<R, J>(type, base, g, j0, x, K, y, N);
}

constexpr decltype(&tiles_rows<1, 1>) kOneHalves[kMaxRows + 1] = {nullptr, tiles_rows<1, 1>, tiles_rows<2, 1>,
                                                                   halves_rows<3, 1>, halves_rows<4, 1>};
constexpr decltype(&tiles_rows<1, 1>) kSideHalves[kMaxRows + 1] = {
    nullptr, tiles_rows<1, kGroupTiles>, tiles_rows<2, kGroupTiles>, halves_rows<3, kGroupTiles>, halves_rows<4, kGroupTiles>};
