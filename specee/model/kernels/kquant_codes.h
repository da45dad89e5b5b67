// Codes and scales out of GGUF blocks in kquant.cpp's layout, written once for every user of a
// vector type `V` of 16 int32 / float lanes (lane o = output o of a tile): kquant_tile.h (the int8
// products, each level) and amx_prompt.cpp (the blocks dequantized to bf16 tiles). Included inside
// the namespace that defines V (no include guard).

// Where J tiles' bytes are: vector v of tile j (of the J) at t + v vs + 64 j, this super-block.
struct Tiles {
  const uint8_t* t;
  int64_t vs;
  const uint8_t* vec(int64_t v, int j) const { return t + v * vs + 64 * j; }
};

// Weight bytes of inputs 4 C .. 4 C + 3 of block b of tile j.
template <int C>
SPECEE_KQ_INLINE V::I q4_quad(const Tiles& w, int j, int b) {
  const V::I v = V::load(w.vec(4 * b + C / 2, j));
  return V::and_(C % 2 ? V::template shr<4>(v) : v, 0x0F0F0F0F);
}

// Q6_K: nibble C % 2 of the low-bit vector, and 2-bit field C % 4 of the high-bit vector of half
// C / 4, moved to bits 4-5.
template <int C>
SPECEE_KQ_INLINE V::I q6_quad(const Tiles& w, int j, int b) {
  constexpr int CC = C % 4;
  const V::I hi = V::load(w.vec(32 + 2 * b + C / 4, j));
  const V::I h = CC == 0 ? V::template shl<4>(hi) : CC == 1 ? V::template shl<2>(hi) : CC == 2 ? hi : V::template shr<2>(hi);
  return V::or_(q4_quad<C>(w, j, b), V::and_(h, 0x30303030));
}

// Q5_0: the nibble of vectors 0-3 and, from the high-bit word (vector 4: bit C of byte e is input
// 4 C + e's), bit C of each byte moved to bit 4.
template <int C>
SPECEE_KQ_INLINE V::I q5_quad(const Tiles& w, int j) {
  const V::I hi = V::load(w.vec(4, j));
  V::I h = hi;  // (if constexpr: a ternary instantiated the shifts of the other sign, warned at build)
  if constexpr (C < 4)
    h = V::template shl<4 - C>(hi);
  else if constexpr (C > 4)
    h = V::template shr<C - 4>(hi);
  return V::or_(q4_quad<C>(w, j, 0), V::and_(h, 0x10101010));
}

// Q4_K's 6-bit scale and min of block b of tile j from its words A, B, C (vectors 32-34: ggml's 12
// bytes as they are): b < 4: byte b of A and of B; else the low 4 bits from C's byte b - 4 (min:
// its high nibble) and the high 2 from the top of A's (scale) and B's (min) byte b - 4.
SPECEE_KQ_INLINE void q4_scale_min(const Tiles& w, int j, int b, V::I& sc, V::I& m) {
  const V::I a = V::load(w.vec(32, j)), bm = V::load(w.vec(33, j));
  if (b < 4) {
    sc = V::and_(V::shrv(a, 8 * b), 63), m = V::and_(V::shrv(bm, 8 * b), 63);
  } else {
    const int S = 8 * (b - 4);
    const V::I c = V::shrv(V::load(w.vec(34, j)), S);
    sc = V::or_(V::and_(c, 15), V::and_(V::shrv(a, S + 2), 0x30));
    m = V::or_(V::and_(V::template shr<4>(c), 15), V::and_(V::shrv(bm, S + 2), 0x30));
  }
}

// Q6_K's int8 scales of the two halves of block b of tile j: byte 2 (b % 2) + h of vector 48 + b / 2.
SPECEE_KQ_INLINE void q6_scales(const Tiles& w, int j, int b, V::I& s0, V::I& s1) {
  const V::I s = V::load(w.vec(48 + b / 2, j));
  s0 = V::template sar<24>(V::shlv(s, 24 - 16 * (b % 2)));
  s1 = V::template sar<24>(V::shlv(s, 16 - 16 * (b % 2)));
}

// The fp16 d of tile j of a group of g, stored after the group's `vectors` vectors, 32 bytes a tile
// (Q6_K: 52, Q5_0: 5, Q8_0: 8).
SPECEE_KQ_INLINE V::F tail_d(const uint8_t* base, int vectors, int64_t g, int64_t j) {
  return V::half(reinterpret_cast<const uint16_t*>(base + vectors * 64 * g + 32 * j));
}

// Q4_K's fp16 d and dmin of tile j's 16 outputs: vector 35, d first.
SPECEE_KQ_INLINE void q4_d_dmin(const Tiles& w, int j, V::F& d, V::F& dmin) {
  const uint16_t* dd = reinterpret_cast<const uint16_t*>(w.vec(35, j));
  d = V::half(dd), dmin = V::half(dd + 16);
}
