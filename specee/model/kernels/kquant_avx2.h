// Q4_K, Q6_K and Q5_0 at the AVX2 level for 3 or 4 rows, 8 outputs a register: included by kquant.cpp inside
// its avx2 namespace, after kquant_tile.h (Act, tiles_rows). Why: kquant_tile.h's 16-lane vectors are
// two AVX2 registers each, so its sums of a group's 4 tiles and 3-4 rows (Q4_K: up to 16 int16 sums and
// 32 float ones) lived on the stack. Here a pass takes half a tile (8 outputs: the low or high 32 bytes
// of each 64-byte vector) for R rows, its R integer sums in registers. Qwen2.5-Coder-1.5B's products
// over every layer on 2 cores of an AMD EPYC Zen 3, the old kernel and this one alternating in one
// process: 4 rows 1.11-1.31x, 8 rows 1.15-1.27x, 64 rows (a prefill's) 1.27-1.28x; Qwen2.5-Coder-0.5B's
// (mostly Q5_0): 3 rows 1.30x, 4 rows 1.38-1.47x, 8 rows 1.39-1.42x, 64 rows 1.39-1.43x. One or two rows
// gained nothing here (their reads bound them), so they stay in kquant_tile.h. Each lane's integer sums
// are exact and its float32 operations are kquant_tile.h's in its order: the same bits
// (tests/test_kquant.py, tests/test_q5q8.py).

// Half h (0 to 2 J - 1: tile j0 + h / 2's low or high 8 outputs) of super-block sb at base, R rows.
template <int R, bool Q6>
SPECEE_KQ_INLINE void kq_half(const uint8_t* base, int64_t g, int64_t j0, int64_t h, int64_t sb, const Act& x, float* y,
                              int64_t N) {
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const uint8_t* t = base + 64 * j0 + 32 * h;  // vector v of the half at t + v 64 g
  const auto vec = [&](int v) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + v * 64 * g)); };
  const auto xq = [&](int r, int64_t i) { return _mm256_set1_epi32(x.q4(r, i)); };
  const auto code4 = [&](int b, int C) {  // q4_quad: inputs 4 C .. 4 C + 3 of block b, a nibble each
    const __m256i raw = vec(4 * b + C / 2);
    return _mm256_and_si256(C % 2 ? _mm256_srli_epi16(raw, 4) : raw, nibble);
  };
  __m256 fa[R], mins[8];  // Q4_K: each block's m, for the min term after the blocks
  for (int r = 0; r < R; ++r) fa[r] = _mm256_setzero_ps();
  for (int b = 0; b < 8; ++b) {
    const int64_t blk = sb * 8 + b;
    __m256i T[R];  // per row, the block's integer sum times its scale(s)
    if constexpr (!Q6) {
      __m256i acc[R];  // each output's int16 pair sums over the block (at most 16 x 15 x 127)
#pragma GCC unroll 8
      for (int C = 0; C < 8; ++C) {
        const __m256i code = code4(b, C);
        for (int r = 0; r < R; ++r) {
          const __m256i p = _mm256_maddubs_epi16(code, xq(r, 8 * blk + C));
          acc[r] = C ? _mm256_add_epi16(acc[r], p) : p;
        }
      }
      // q4_scale_min's 6-bit scale and min of block b
      const __m128i at = _mm_cvtsi32_si128(8 * (b & 3)), at2 = _mm_cvtsi32_si128(8 * (b & 3) + 2);
      const __m256i low6 = _mm256_set1_epi32(63), top2 = _mm256_set1_epi32(0x30), low4 = _mm256_set1_epi32(15);
      const __m256i A = vec(32), B = vec(33);
      __m256i sc, m;
      if (b < 4) {
        sc = _mm256_and_si256(_mm256_srl_epi32(A, at), low6), m = _mm256_and_si256(_mm256_srl_epi32(B, at), low6);
      } else {
        const __m256i c = _mm256_srl_epi32(vec(34), at);
        sc = _mm256_or_si256(_mm256_and_si256(c, low4), _mm256_and_si256(_mm256_srl_epi32(A, at2), top2));
        m = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(c, 4), low4), _mm256_and_si256(_mm256_srl_epi32(B, at2), top2));
      }
      mins[b] = _mm256_cvtepi32_ps(m);
      for (int r = 0; r < R; ++r) T[r] = _mm256_mullo_epi32(sc, _mm256_madd_epi16(acc[r], ones));
    } else {
#pragma GCC unroll 2
      for (int half = 0; half < 2; ++half) {  // 16 inputs: T += scale (sum q x - 32 sum x)
        __m256i acc[R];
        for (int r = 0; r < R; ++r) acc[r] = _mm256_set1_epi32(-32 * x.s16(r, 2 * blk + half));
        const __m256i high = vec(32 + 2 * b + half);
#pragma GCC unroll 4
        for (int C = 4 * half; C < 4 * half + 4; ++C) {  // q6_quad: bits 2 (C % 4) of the high vector at 4-5
          const __m256i hb = C % 4 == 0 ? _mm256_slli_epi32(high, 4) : C % 4 == 1 ? _mm256_slli_epi32(high, 2)
                             : C % 4 == 2 ? high : _mm256_srli_epi32(high, 2);
          const __m256i code = _mm256_or_si256(code4(b, C), _mm256_and_si256(hb, _mm256_set1_epi8(0x30)));
          for (int r = 0; r < R; ++r)
            acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(_mm256_maddubs_epi16(code, xq(r, 8 * blk + C)), ones));
        }
        // q6_scales' int8 scale of this half of block b
        const __m256i s = vec(48 + b / 2);
        const __m256i scale = _mm256_srai_epi32(_mm256_sll_epi32(s, _mm_cvtsi32_si128(24 - 16 * (b % 2) - 8 * half)), 24);
        for (int r = 0; r < R; ++r) {
          const __m256i part = _mm256_mullo_epi32(scale, acc[r]);
          T[r] = half ? _mm256_add_epi32(T[r], part) : part;
        }
      }
    }
    for (int r = 0; r < R; ++r) fa[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(T[r]), _mm256_set1_ps(x.dx(r, blk)), fa[r]);
  }
  const int64_t j = j0 + h / 2;  // the half's tile in the group
  float* o = y + 8 * h;
  if constexpr (!Q6) {
    const uint16_t* dd = reinterpret_cast<const uint16_t*>(base + 35 * 64 * g + 64 * j) + 8 * (h % 2);  // q4_d_dmin
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dd)));
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dd + 16)));
    for (int r = 0; r < R; ++r) {
      __m256 fb = _mm256_setzero_ps();
      for (int b = 0; b < 8; ++b) fb = _mm256_fmadd_ps(mins[b], _mm256_set1_ps(x.ds(r, sb * 8 + b)), fb);
      _mm256_storeu_ps(o + r * N, _mm256_fnmadd_ps(dmin, fb, _mm256_fmadd_ps(d, fa[r], _mm256_loadu_ps(o + r * N))));
    }
  } else {
    const uint16_t* dd = reinterpret_cast<const uint16_t*>(base + 52 * 64 * g + 32 * j) + 8 * (h % 2);  // tail_d
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dd)));
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
  const __m256i nibble = _mm256_set1_epi8(0x0F), fifth = _mm256_set1_epi8(0x10), ones = _mm256_set1_epi16(1);
  const int64_t bytes = g * kQ5Bytes;
  __m256 acc[2 * kGroupTiles][R];
  for (int64_t h = 0; h < 2 * J; ++h)
    for (int r = 0; r < R; ++r) acc[h][r] = _mm256_loadu_ps(y + r * N + 8 * h);
  for (int64_t blk = 0; blk < K / 32; ++blk, base += bytes) {
    for (int64_t i = 0; i < bytes; i += 64) specee_int4::prefetch_l2(base + kPrefetchBlocks * bytes + i);
    for (int64_t h = 0; h < 2 * J; ++h) {
      const uint8_t* t = base + 64 * j0 + 32 * h;  // vector v of the half at t + v 64 g
      const auto vec = [&](int v) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + v * 64 * g)); };
      const __m256i high = vec(4);
      __m256i sums[R];
      for (int r = 0; r < R; ++r) sums[r] = _mm256_set1_epi32(-16 * (x.s16(r, 2 * blk) + x.s16(r, 2 * blk + 1)));
#pragma GCC unroll 8
      for (int C = 0; C < 8; ++C) {  // q5_quad: the nibble, and bit C of the high vector's bytes at bit 4
        const __m256i raw = vec(C / 2);
        const __m256i hb = C < 4 ? _mm256_slli_epi32(high, (4 - C) % 8) : _mm256_srli_epi32(high, (C - 4) % 8);
        const __m256i code = _mm256_or_si256(_mm256_and_si256(C % 2 ? _mm256_srli_epi16(raw, 4) : raw, nibble),
                                             _mm256_and_si256(hb, fifth));
        for (int r = 0; r < R; ++r)
          sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(_mm256_maddubs_epi16(code, _mm256_set1_epi32(x.q4(r, 8 * blk + C))), ones));
      }
      const int64_t j = j0 + h / 2;
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(base + 5 * 64 * g + 32 * j + 16 * (h % 2))));  // tail_d
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
