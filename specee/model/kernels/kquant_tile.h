// The kernel body of kquant.cpp, written once for every level: kquant.cpp includes this file once
// per instruction set (no include guard), with `V` that level's vector of 16 int32 / float lanes.
// A tile is 16 outputs (lane o = output o) x 256 inputs per super-block; layout: kquant.cpp.
//
// Q6_K: per 32-input block b and half h (16 inputs, scale sc_h, int8):
//     T_b = sum_h sc_h (sum_k q_k x_k - 32 sum_k x_k)        (int32, exact)
//     y  += d (sum_b dx_b T_b)                                  (float32 FMAs, in this order)
// Q4_K: per block b (6-bit scale sc_b and min m_b):
//     y  += d (sum_b dx_b (sc_b sum_k q_k x_k)) - dmin (sum_b m_b ds_b)   with ds_b = dx_b sum_k x_k

// Bytes of inputs 4c .. 4c + 3 (quad c = 2a + j) of a Q6_K block: nibble j of the low-bit vector a,
// and 2-bit field c % 4 of the high-bit vector a / 2, moved to bits 4-5.
template <int J, int CC>
inline V::I q6_quad(const V::I& lo, const V::I& hi) {
  const V::I l = J ? V::template shr<4>(lo) : lo;
  const V::I h = CC == 0 ? V::template shl<4>(hi) : CC == 1 ? V::template shl<2>(hi) : CC == 2 ? hi : V::template shr<2>(hi);
  return V::or_(V::and_(l, 0x0F0F0F0F), V::and_(h, 0x30303030));
}

template <int R>
inline void q6k_tile(const uint8_t* t, const Act& x, int64_t K, float* y, int64_t N) {
  V::F out[R];
  for (int r = 0; r < R; ++r) out[r] = V::fzero();
  for (int64_t sb = 0; sb < K / 256; ++sb, t += kQ6Bytes) {
    V::F fs[R];
    for (int r = 0; r < R; ++r) fs[r] = V::fzero();
    for (int b = 0; b < 8; ++b) {
      const int64_t blk = sb * 8 + b;
      V::I acc[R][2];
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < 2; ++h) acc[r][h] = V::set1(-32 * x.s16(r, 2 * blk + h));
      for (int h = 0; h < 2; ++h) {
        const V::I hi = V::load(t + 2048 + (2 * b + h) * 64);
        const V::I lo0 = V::load(t + (4 * b + 2 * h) * 64), lo1 = V::load(t + (4 * b + 2 * h + 1) * 64);
        const V::I w[4] = {q6_quad<0, 0>(lo0, hi), q6_quad<1, 1>(lo0, hi), q6_quad<0, 2>(lo1, hi), q6_quad<1, 3>(lo1, hi)};
        for (int c = 0; c < 4; ++c)
          for (int r = 0; r < R; ++r) acc[r][h] = V::dot(acc[r][h], w[c], x.q4(r, 8 * blk + 4 * h + c));
      }
      const V::I s = V::load(t + 3072 + (b / 2) * 64);  // byte 2 (b % 2) + h of lane o: sc_h of output o
      const V::I s0 = b % 2 ? V::template sar<24>(V::template shl<8>(s)) : V::template sar<24>(V::template shl<24>(s));
      const V::I s1 = b % 2 ? V::template sar<24>(s) : V::template sar<24>(V::template shl<16>(s));
      for (int r = 0; r < R; ++r) {
        const V::I T = V::add(V::mul(s0, acc[r][0]), V::mul(s1, acc[r][1]));
        fs[r] = V::fma(V::cvt(T), V::fset1(x.dx(r, blk)), fs[r]);
      }
    }
    const V::F d = V::half(reinterpret_cast<const uint16_t*>(t + 3328));
    for (int r = 0; r < R; ++r) out[r] = V::fma(d, fs[r], out[r]);
  }
  for (int r = 0; r < R; ++r) V::store(y + r * N, out[r]);
}

// Q4_K's 6-bit scale and min of block B from the words A, B, C of each lane (ggml's 12 bytes as they are).
template <int Blk>
inline void q4_scale_min(const V::I& a, const V::I& b, const V::I& c, V::I& sc, V::I& m) {
  if constexpr (Blk < 4) {
    sc = V::and_(V::template shr<8 * Blk>(a), 63);
    m = V::and_(V::template shr<8 * Blk>(b), 63);
  } else {
    constexpr int S = 8 * (Blk - 4);
    sc = V::or_(V::and_(V::template shr<S>(c), 15), V::and_(V::template shr<S + 2>(a), 0x30));
    m = V::or_(V::and_(V::template shr<S + 4>(c), 15), V::and_(V::template shr<S + 2>(b), 0x30));
  }
}

template <int R, int Blk>
inline void q4k_block(const uint8_t* t, const Act& x, int64_t blk, const V::I (&abc)[3], V::F (&fa)[R], V::F (&fb)[R]) {
  V::I acc[R];
  for (int r = 0; r < R; ++r) acc[r] = V::set1(0);
  for (int a = 0; a < 4; ++a) {
    const V::I v = V::load(t + (4 * Blk + a) * 64);
    const V::I w0 = V::and_(v, 0x0F0F0F0F), w1 = V::and_(V::template shr<4>(v), 0x0F0F0F0F);
    for (int r = 0; r < R; ++r) acc[r] = V::dot(acc[r], w0, x.q4(r, 8 * blk + 2 * a));
    for (int r = 0; r < R; ++r) acc[r] = V::dot(acc[r], w1, x.q4(r, 8 * blk + 2 * a + 1));
  }
  V::I sc, m;
  q4_scale_min<Blk>(abc[0], abc[1], abc[2], sc, m);
  const V::F mf = V::cvt(m);
  for (int r = 0; r < R; ++r) {
    fa[r] = V::fma(V::cvt(V::mul(sc, acc[r])), V::fset1(x.dx(r, blk)), fa[r]);
    fb[r] = V::fma(mf, V::fset1(x.ds(r, blk)), fb[r]);
  }
}

template <int R, int... Blk>
inline void q4k_blocks(const uint8_t* t, const Act& x, int64_t sb, const V::I (&abc)[3], V::F (&fa)[R], V::F (&fb)[R],
                       std::integer_sequence<int, Blk...>) {
  (q4k_block<R, Blk>(t, x, sb * 8 + Blk, abc, fa, fb), ...);
}

template <int R>
inline void q4k_tile(const uint8_t* t, const Act& x, int64_t K, float* y, int64_t N) {
  V::F out[R];
  for (int r = 0; r < R; ++r) out[r] = V::fzero();
  for (int64_t sb = 0; sb < K / 256; ++sb, t += kQ4Bytes) {
    V::F fa[R], fb[R];
    for (int r = 0; r < R; ++r) fa[r] = fb[r] = V::fzero();
    const V::I abc[3] = {V::load(t + 2048), V::load(t + 2112), V::load(t + 2176)};
    q4k_blocks<R>(t, x, sb, abc, fa, fb, std::make_integer_sequence<int, 8>{});
    const uint16_t* dd = reinterpret_cast<const uint16_t*>(t + 2240);
    const V::F d = V::half(dd), dmin = V::half(dd + 16);
    for (int r = 0; r < R; ++r) out[r] = V::fnma(dmin, fb[r], V::fma(d, fa[r], out[r]));
  }
  for (int r = 0; r < R; ++r) V::store(y + r * N, out[r]);
}

// R rows (1 to kMaxRows) of one tile of either type.
template <int R>
void tile_rows(int64_t type, const uint8_t* t, const Act& x, int64_t K, float* y, int64_t N) {
  if (type == kQ6K) return q6k_tile<R>(t, x, K, y, N);
  q4k_tile<R>(t, x, K, y, N);
}

constexpr decltype(&tile_rows<1>) kRows[kMaxRows + 1] = {nullptr, tile_rows<1>, tile_rows<2>, tile_rows<3>, tile_rows<4>};
