// kquant.cpp's vector V at its AVX-512 level (VNNI): 16 int32 / float lanes. Also what amx_prompt.cpp
// reads GGUF blocks with (kquant_codes.h). Included inside a namespace, under a target pragma
// enabling at least avx512f, avx512bw and avx512vnni (no include guard).
struct V {
  using I = __m512i;
  using F = __m512;
  static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I set1(int32_t v) { return _mm512_set1_epi32(v); }
  static I and_(I x, uint32_t m) { return _mm512_and_si512(x, _mm512_set1_epi32(m)); }
  static I or_(I x, I y) { return _mm512_or_si512(x, y); }
  static I add(I x, I y) { return _mm512_add_epi32(x, y); }
  static I mul(I x, I y) { return _mm512_mullo_epi32(x, y); }
  template <int S> static I shl(I x) { return _mm512_slli_epi32(x, S); }
  template <int S> static I shr(I x) { return _mm512_srli_epi32(x, S); }
  template <int S> static I sar(I x) { return _mm512_srai_epi32(x, S); }
  static I shlv(I x, int n) { return _mm512_sll_epi32(x, _mm_cvtsi32_si128(n)); }
  static I shrv(I x, int n) { return _mm512_srl_epi32(x, _mm_cvtsi32_si128(n)); }
  static I dot(I acc, I w, I x) { return _mm512_dpbusd_epi32(acc, w, x); }
  static I dot_wide(I acc, I w, I x) { return _mm512_dpbusd_epi32(acc, w, x); }  // no int16 step: exact
  static I dot_pairs(I acc, I w, I x) { return _mm512_dpbusd_epi32(acc, w, x); }  // (AVX2's int16 pair sums)
  static I pairs_sum(I a) { return a; }
  static F fzero() { return _mm512_setzero_ps(); }
  static F fset1(float v) { return _mm512_set1_ps(v); }
  static F cvt(I x) { return _mm512_cvtepi32_ps(x); }
  static F fmul(F x, F y) { return _mm512_mul_ps(x, y); }
  static F fma(F x, F y, F z) { return _mm512_fmadd_ps(x, y, z); }
  static F fnma(F x, F y, F z) { return _mm512_fnmadd_ps(x, y, z); }
  static F half(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static F loadf(const float* p) { return _mm512_loadu_ps(p); }
};
