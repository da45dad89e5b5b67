// The kernel body of kquant.cpp, written once for every level: kquant.cpp includes this file once
// per instruction set (no include guard), with `V` that level's vector of 16 int32 / float lanes.
// A tile is 16 outputs (lane o = output o); J tiles of one group run together (layout: kquant.cpp),
// sharing the activations' broadcasts, giving independent chains of dot products and reading their
// group's bytes in order; a lane's operations are the same whatever J and R are.
//
// Q5_0 / Q8_0: per 32-input block b (its own fp16 d; q 0..31 with offset 16, or 0..255 stored as
// the int8 code plus 128, offset 128):
//     T_b = sum_k q_k x_k - offset sum_k x_k                   (int32, exact)
//     y  += d_b (T_b dx_b)                                      (float32: a product, then an FMA)
//
// Q6_K: per 32-input block b and half h (16 inputs, scale sc_h, int8):
//     T_b = sum_h sc_h (sum_k q_k x_k - 32 sum_k x_k)        (int32, exact)
//     y  += d (sum_b dx_b T_b)                                  (float32 FMAs, in this order)
// Q4_K: per block b (6-bit scale sc_b and min m_b):
//     y  += d (sum_b dx_b (sc_b sum_k q_k x_k)) - dmin (sum_b m_b ds_b)   with ds_b = dx_b sum_k x_k
// The codes and scales themselves come out of the blocks in kquant_codes.h.

#include "kquant_codes.h"

// acc[r][j][h] += quad C of block b of tile j (of type Q) times row r's inputs; h = C / 4 for
// Q6_K's halves, else 0 or, where few tiles and rows give few chains of dot products (H = 2), C / 4
// as well. Q8_0's codes span a whole byte: V::dot_wide. Q4_K's sums stay int16 pairs over the block
// (V::dot_pairs: at AVX2 one vpmaddubsw and one add a quad, not three operations), summed by q4k_block.
template <int R, int J, int H, int64_t Q, int C>
SPECEE_KQ_INLINE void dot_quad(const Tiles& w, const Act& x, int64_t blk, int b, V::I (&acc)[R][J][H]) {
  constexpr int h = H == 2 ? C / 4 : 0;
  V::I xb[R];
  for (int r = 0; r < R; ++r) xb[r] = V::set1(x.q4(r, 8 * blk + C));
  for (int j = 0; j < J; ++j) {
    if constexpr (Q == kQ80) {
      const V::I q = V::load(w.vec(C, j));
      for (int r = 0; r < R; ++r) acc[r][j][h] = V::dot_wide(acc[r][j][h], q, xb[r]);
    } else {
      const V::I q = Q == kQ6K ? q6_quad<C>(w, j, b) : Q == kQ50 ? q5_quad<C>(w, j) : q4_quad<C>(w, j, b);
      for (int r = 0; r < R; ++r)
        acc[r][j][h] = Q == kQ4K ? V::dot_pairs(acc[r][j][h], q, xb[r]) : V::dot(acc[r][j][h], q, xb[r]);
    }
  }
}

template <int R, int J, int H, int64_t Q, int... C>
SPECEE_KQ_INLINE void dots(const Tiles& w, const Act& x, int64_t blk, int b, V::I (&acc)[R][J][H],
                           std::integer_sequence<int, C...>) {
  (dot_quad<R, J, H, Q, C>(w, x, blk, b, acc), ...);
}

// Q6_K block b of super-block sb: T_b per tile and row, then fs += dx T_b.
template <int R, int J>
SPECEE_KQ_INLINE void q6k_block(const Tiles& w, const Act& x, int64_t sb, int b, V::F (&fs)[R][J]) {
  const int64_t blk = sb * 8 + b;
  V::I acc[R][J][2];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j)
      for (int h = 0; h < 2; ++h) acc[r][j][h] = V::set1(-32 * x.s16(r, 2 * blk + h));
  dots<R, J, 2, kQ6K>(w, x, blk, b, acc, std::make_integer_sequence<int, 8>{});
  for (int j = 0; j < J; ++j) {
    V::I s0, s1;
    q6_scales(w, j, b, s0, s1);
    for (int r = 0; r < R; ++r) {
      const V::I T = V::add(V::mul(s0, acc[r][j][0]), V::mul(s1, acc[r][j][1]));
      fs[r][j] = V::fma(V::cvt(T), V::fset1(x.dx(r, blk)), fs[r][j]);
    }
  }
}

// Q4_K block b of super-block sb: fa += dx sc_b (dot), fb += m_b ds.
template <int R, int J>
SPECEE_KQ_INLINE void q4k_block(const Tiles& w, const Act& x, int64_t sb, int b, V::F (&fa)[R][J], V::F (&fb)[R][J]) {
  const int64_t blk = sb * 8 + b;
  constexpr int H = R * J < 4 ? 2 : 1;  // independent chains enough without splitting
  V::I acc[R][J][H];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j)
      for (int h = 0; h < H; ++h) acc[r][j][h] = V::set1(0);
  dots<R, J, H, kQ4K>(w, x, blk, b, acc, std::make_integer_sequence<int, 8>{});
  for (int j = 0; j < J; ++j) {
    V::I sc, m;
    q4_scale_min(w, j, b, sc, m);
    const V::F mf = V::cvt(m);
    for (int r = 0; r < R; ++r) {
      const V::I dot = H == 2 ? V::add(V::pairs_sum(acc[r][j][0]), V::pairs_sum(acc[r][j][H - 1])) : V::pairs_sum(acc[r][j][0]);
      fa[r][j] = V::fma(V::cvt(V::mul(sc, dot)), V::fset1(x.dx(r, blk)), fa[r][j]);
      fb[r][j] = V::fma(mf, V::fset1(x.ds(r, blk)), fb[r][j]);
    }
  }
}

// An eighth of the group's super-block kSuperBlocksAhead on (`bytes` long: at block b of this one) into
// L2 (int4_common.h's prefetch_l2): the hardware prefetchers alone left Qwen's Q4_K products streaming
// at 18 GB/s on one core (AMD EPYC), 41 with the next super-block's; an Intel Xeon needed them two
// ahead (kquant.cpp).
SPECEE_KQ_INLINE void prefetch_ahead(const uint8_t* base, int64_t bytes, int b) {
  for (int64_t i = b * bytes / 8; i < (b + 1) * bytes / 8; i += 64)
    specee_int4::prefetch_l2(base + kSuperBlocksAhead * bytes + i);
}

// J tiles from tile j0 of a group of g (base: its first super-block), rows R, added into y (zeroed).
template <int R, int J>
SPECEE_KQ_INLINE void q6k_tiles(const uint8_t* base, int64_t g, int64_t j0, const Act& x, int64_t K, float* y, int64_t N) {
  for (int64_t sb = 0; sb < K / 256; ++sb, base += g * kQ6Bytes) {
    const Tiles w{base + 64 * j0, 64 * g};
    V::F fs[R][J];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < J; ++j) fs[r][j] = V::fzero();
    for (int b = 0; b < 8; ++b) {
      prefetch_ahead(base, g * kQ6Bytes, b);
      q6k_block<R, J>(w, x, sb, b, fs);
    }
    for (int j = 0; j < J; ++j) {
      const V::F d = tail_d(base, 52, g, j0 + j);
      for (int r = 0; r < R; ++r) V::store(y + r * N + 16 * j, V::fma(d, fs[r][j], V::loadf(y + r * N + 16 * j)));
    }
  }
}

template <int R, int J>
SPECEE_KQ_INLINE void q4k_tiles(const uint8_t* base, int64_t g, int64_t j0, const Act& x, int64_t K, float* y, int64_t N) {
  for (int64_t sb = 0; sb < K / 256; ++sb, base += g * kQ4Bytes) {
    const Tiles w{base + 64 * j0, 64 * g};
    V::F fa[R][J], fb[R][J];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < J; ++j) fa[r][j] = fb[r][j] = V::fzero();
    for (int b = 0; b < 8; ++b) {
      prefetch_ahead(base, g * kQ4Bytes, b);
      q4k_block<R, J>(w, x, sb, b, fa, fb);
    }
    for (int j = 0; j < J; ++j) {
      V::F d, dmin;
      q4_d_dmin(w, j, d, dmin);
      for (int r = 0; r < R; ++r) {
        float* o = y + r * N + 16 * j;
        V::store(o, V::fnma(dmin, fb[r][j], V::fma(d, fa[r][j], V::loadf(o))));
      }
    }
  }
}

// Q5_0 / Q8_0 (Q): J tiles of a group of g, block after block of 32 inputs, the sums in registers
// until the end; the bytes kPrefetchBlocks blocks ahead prefetched.
template <int R, int J, int64_t Q>
SPECEE_KQ_INLINE void q32_tiles(const uint8_t* base, int64_t g, int64_t j0, const Act& x, int64_t K, float* y, int64_t N) {
  constexpr int vectors = Q == kQ80 ? 8 : 5, offset = Q == kQ80 ? 128 : 16;
  constexpr int H = R * J < 4 ? 2 : 1;
  const int64_t bytes = g * (Q == kQ80 ? kQ8Bytes : kQ5Bytes);
  V::F acc[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) acc[r][j] = V::loadf(y + r * N + 16 * j);
  for (int64_t blk = 0; blk < K / 32; ++blk, base += bytes) {
    for (int64_t i = 0; i < bytes; i += 64) specee_int4::prefetch_l2(base + kPrefetchBlocks * bytes + i);
    const Tiles w{base + 64 * j0, 64 * g};
    V::I sums[R][J][H];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < J; ++j)
        for (int h = 0; h < H; ++h) sums[r][j][h] = V::set1(h ? 0 : -offset * (x.s16(r, 2 * blk) + x.s16(r, 2 * blk + 1)));
    dots<R, J, H, Q>(w, x, blk, 0, sums, std::make_integer_sequence<int, 8>{});
    for (int j = 0; j < J; ++j) {
      const V::F d = tail_d(base, vectors, g, j0 + j);
      for (int r = 0; r < R; ++r) {
        const V::I T = H == 2 ? V::add(sums[r][j][0], sums[r][j][H - 1]) : sums[r][j][0];
        acc[r][j] = V::fma(d, V::fmul(V::cvt(T), V::fset1(x.dx(r, blk))), acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) V::store(y + r * N + 16 * j, acc[r][j]);
}

// R rows (1 to kMaxRows) of J tiles, from tile j0, of a group of g tiles of one type.
template <int R, int J>
void tiles_rows(int64_t type, const uint8_t* base, int64_t g, int64_t j0, const Act& x, int64_t K, float* y, int64_t N) {
  if (type == kQ6K) return q6k_tiles<R, J>(base, g, j0, x, K, y, N);
  if (type == kQ50) return q32_tiles<R, J, kQ50>(base, g, j0, x, K, y, N);
  if (type == kQ80) return q32_tiles<R, J, kQ80>(base, g, j0, x, K, y, N);
  q4k_tiles<R, J>(base, g, j0, x, K, y, N);
}

// By rows R: one tile; and a whole group of kGroupTiles tiles side by side (with 3-4 rows past the
// registers, yet faster than fewer tiles: Q4_K 4 rows x 4 tiles 87-93 GMAC/s against 69 for one).
constexpr decltype(&tiles_rows<1, 1>) kOne[kMaxRows + 1] = {nullptr, tiles_rows<1, 1>, tiles_rows<2, 1>, tiles_rows<3, 1>,
                                                            tiles_rows<4, 1>};
constexpr decltype(&tiles_rows<1, 1>) kSide[kMaxRows + 1] = {nullptr, tiles_rows<1, kGroupTiles>, tiles_rows<2, kGroupTiles>,
                                                             tiles_rows<3, kGroupTiles>, tiles_rows<4, kGroupTiles>};
