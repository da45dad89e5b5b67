// A prompt's attention on AMX-BF16 tiles. Per kv head the prompt's keys and values are rounded to
// bf16 once, into the tiles' pair layout; per query head and block of 16 rows: the scores Q K^T on the
// tiles (16 rows x 16 keys, float32 sums over the head's dimensions), a softmax over each row's own
// prefix in AVX-512 (row_attention.cpp's exp), and P V on the tiles (float32 sums over the keys).
// Why: row_attention.cpp takes a prompt one row at a time, each row reading and widening every key
// of its prefix: 21% of SmolLM2's prefill of the 8 bench prompts (perf, the Intel Xeon with AMX). On
// the tiles SmolLM2 Q4_1 prefills 512 tokens 1.45x and 2,048 tokens 1.9x faster, Qwen2.5-1.5B 2,048
// tokens 1.28x (BENCHMARKS.md, session 32).
//
// The arithmetic (bf16 queries, keys, values and probabilities) is not row_attention's, so
// decode_layer.cpp sends a prompt here by the rule its products follow (amx_prompt.cpp): the request's
// own prompt length, never what shares its step. A row's numbers do not depend on the other rows of
// its block, nor on where its part of the prompt starts (a chunked prefill's later parts read the
// earlier parts' keys from the cache): each score and output sums the same products in the same
// order, over key blocks counted from slot 0.
#include "prompt_attention.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>

#include "amx_prompt.h"
#include "amx_tiles.h"
#include "exp_nonpositive.h"
#include "row_attention.h"

namespace {

#ifdef SPECEE_AMX_BUILT
using specee_scratch::Scratch;

constexpr int64_t kRows = 16;      // query rows a unit computes: a tile's rows

SPECEE_AMX_BF16 inline __m512 half16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 32 values (float16 at p, or zeros) as 32 bf16: element i = value i
SPECEE_AMX_BF16 inline __m512i bf16x32(const c10::Half* p, bool live) {
  return live ? (__m512i)_mm512_cvtne2ps_pbh(half16(p + 16), half16(p)) : _mm512_setzero_si512();
}

// Keys as the B tiles of Q K^T: tile (block b of 16 keys, chunk c of 32 dims) holds at row p, column n
// the bf16 pair (dims 32 c + 2 p, 32 c + 2 p + 1) of key 16 b + n. Slots S .. L - 1: zeros.
SPECEE_AMX_BF16 void pack_keys(const c10::Half* K, int64_t S, int64_t L, int64_t D, uint32_t* kt) {
  const int64_t C = D / 32;
  const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(16));
  for (int64_t s = 0; s < L; ++s)
    for (int64_t c = 0; c < C; ++c)
      _mm512_i32scatter_epi32(kt + ((s / 16) * C + c) * 256 + s % 16, rows, bf16x32(K + s * D + 32 * c, s < S), 4);
}

// Values as the B tiles of P V: tile (block b of 32 keys, block j of 16 dims) holds at row p the dims'
// pairs (key 32 b + 2 p, key 32 b + 2 p + 1), interleaved. Slots S .. L - 1: zeros.
SPECEE_AMX_BF16 void pack_values(const c10::Half* V, int64_t S, int64_t L, int64_t D, uint16_t* vp) {
  const int64_t J = D / 16;
  alignas(64) static constexpr uint16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                           8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i order = _mm512_load_si512(kInterleave);
  for (int64_t s = 0; s < L; s += 2)
    for (int64_t j = 0; j < J; ++j) {
      const __m512 a = s < S ? half16(V + s * D + 16 * j) : _mm512_setzero_ps();
      const __m512 b = s + 1 < S ? half16(V + (s + 1) * D + 16 * j) : _mm512_setzero_ps();
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(b, a);  // key s: elements 0-15, s + 1: 16-31
      _mm512_store_si512(vp + ((s / 32) * J + j) * 512 + (s % 32) / 2 * 32, _mm512_permutexvar_epi16(order, both));
    }
}

// Every tile 16 rows of 64 bytes. tmm0..3: the query block's dimension chunks (scores), then P (values);
// tmm4, 5: keys; tmm6, 7: two key blocks' scores; in the value pass tmm1..3 values and tmm4..7 outputs.
SPECEE_AMX_BF16 void configure() {
  specee_amx::TileConfig c;
  for (int i = 0; i < 8; ++i) c.rows[i] = 16, c.colsb[i] = 64;
  specee_amx::load_config(c);
}

// GCC's tile intrinsics take tile numbers as literals, so the per-chunk steps below are macros over
// a literal chunk c, each present when the head has that chunk (C > c) or the pass that tile (T > c).

// Scores of the query tiles (tmm0 .. C - 1) against `pairs` pairs of 16-key blocks: sc [16][stride / 4].
template <int C>
SPECEE_AMX_BF16 void scores(const uint32_t* kt, int64_t pairs, float* sc, int64_t stride) {
#define SPECEE_SCORE_CHUNK(c)                    \
  if constexpr (C > c) {                         \
    _tile_loadd(4, kt + c * 256, 64);            \
    _tile_loadd(5, kt + (C + c) * 256, 64);      \
    _tile_dpbf16ps(6, c, 4);                     \
    _tile_dpbf16ps(7, c, 5);                     \
  }
  for (int64_t b = 0; b < pairs; ++b, kt += 2 * C * 256) {
    _tile_zero(6);
    _tile_zero(7);
    SPECEE_SCORE_CHUNK(0)
    SPECEE_SCORE_CHUNK(1)
    SPECEE_SCORE_CHUNK(2)
    SPECEE_SCORE_CHUNK(3)
    _tile_stored(6, sc + 32 * b, stride);
    _tile_stored(7, sc + 32 * b + 16, stride);
  }
#undef SPECEE_SCORE_CHUNK
}

template <int C>
SPECEE_AMX_BF16 void load_queries(const uint16_t* qa) {
#define SPECEE_QUERY_CHUNK(c) \
  if constexpr (C > c) _tile_loadd(c, qa + 32 * c, C * 64);
  SPECEE_QUERY_CHUNK(0)
  SPECEE_QUERY_CHUNK(1)
  SPECEE_QUERY_CHUNK(2)
  SPECEE_QUERY_CHUNK(3)
#undef SPECEE_QUERY_CHUNK
}

// T (1..4) output tiles (dims 16 j .. 16 j + 16 T) of P (pa [16][Lq] bf16) times the values: ob [16][ob_stride / 4].
// Output tile c (tmm 4 + c) takes its values through tmm 1 + c % 3.
template <int T>
SPECEE_AMX_BF16 void values(const uint16_t* pa, int64_t Lq, const uint16_t* vp, int64_t J, int64_t j, float* ob,
                            int64_t ob_stride) {
#define SPECEE_VALUE_TILE(c, out_tile, b_tile)     \
  if constexpr (T > c) {                           \
    _tile_loadd(b_tile, v + c * 512, 64);          \
    _tile_dpbf16ps(out_tile, 0, b_tile);           \
  }
  _tile_zero(4);
  if constexpr (T > 1) _tile_zero(5);
  if constexpr (T > 2) _tile_zero(6);
  if constexpr (T > 3) _tile_zero(7);
  for (int64_t b = 0; b < Lq / 32; ++b) {
    const uint16_t* v = vp + (b * J + j) * 512;
    _tile_loadd(0, pa + 32 * b, Lq * 2);
    SPECEE_VALUE_TILE(0, 4, 1)
    SPECEE_VALUE_TILE(1, 5, 2)
    SPECEE_VALUE_TILE(2, 6, 3)
    SPECEE_VALUE_TILE(3, 7, 1)
  }
  _tile_stored(4, ob + 16 * j, ob_stride);
  if constexpr (T > 1) _tile_stored(5, ob + 16 * (j + 1), ob_stride);
  if constexpr (T > 2) _tile_stored(6, ob + 16 * (j + 2), ob_stride);
  if constexpr (T > 3) _tile_stored(7, ob + 16 * (j + 3), ob_stride);
#undef SPECEE_VALUE_TILE
}

// Rows q0 .. q0 + m - 1 (m <= 16) of one query head (q: its [S][D] float32, row i at slot start + i) over
// their prefixes, with the head's packed keys and values; row i's output at out + i out_stride.
template <int C>
SPECEE_AMX_BF16 void attend_block(const float* q, int64_t start, int64_t q0, int64_t m, const uint32_t* kt,
                                  const uint16_t* vp, float* out, int64_t out_stride, Scratch& scratch) {
  constexpr int64_t D = 32 * C, J = D / 16;
  const int64_t Lq = (start + q0 + m + 31) / 32 * 32;  // the keys the block reads, padded to a P tile's 32
  char* base = scratch.at_least<char>(kRows * (D * 2 + Lq * 6 + D * 4));
  uint16_t* qa = reinterpret_cast<uint16_t*>(base);
  float* sc = reinterpret_cast<float*>(base + kRows * D * 2);
  uint16_t* pa = reinterpret_cast<uint16_t*>(base + kRows * (D * 2 + Lq * 4));
  float* ob = reinterpret_cast<float*>(base + kRows * (D * 2 + Lq * 6));
  const __m512 scale = _mm512_set1_ps(1.0f / std::sqrt(static_cast<float>(D)));
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t c = 0; c < C; ++c) {
      const float* x = q + (q0 + r) * D + 32 * c;
      const __m512i v = r < m ? (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(x + 16), scale),
                                                              _mm512_mul_ps(_mm512_loadu_ps(x), scale))
                              : _mm512_setzero_si512();
      _mm512_store_si512(qa + r * D + 32 * c, v);
    }
  load_queries<C>(qa);
  scores<C>(kt, Lq / 32, sc, Lq * 4);
  float inv[kRows];
  for (int64_t r = 0; r < kRows; ++r) {
    const float* s = sc + r * Lq;
    uint16_t* p = pa + r * Lq;
    const int64_t len = r < m ? start + q0 + r + 1 : 0;  // the row's prefix: slots 0 .. start + q0 + r
    const auto live = [&](int64_t t) {
      const int64_t n = std::clamp<int64_t>(len - t, 0, 16);
      return static_cast<__mmask16>((1u << n) - 1);
    };
    __m512 best = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < len; t += 16) best = _mm512_mask_max_ps(best, live(t), best, _mm512_loadu_ps(s + t));
    const __m512 top = _mm512_set1_ps(len ? _mm512_reduce_max_ps(best) : 0.f);
    __m512 total = _mm512_setzero_ps();
    for (int64_t t = 0; t < Lq; t += 16) {
      const __m512 e = _mm512_maskz_mov_ps(live(t), exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + t), top)));
      _mm256_store_si256(reinterpret_cast<__m256i*>(p + t), (__m256i)_mm512_cvtneps_pbh(e));
      total = _mm512_add_ps(total, e);
    }
    inv[r] = len ? 1.0f / _mm512_reduce_add_ps(total) : 0.f;
  }
  for (int64_t j = 0; j < J; j += 4) {
    switch (std::min<int64_t>(4, J - j)) {
      case 1: values<1>(pa, Lq, vp, J, j, ob, D * 4); break;
      case 2: values<2>(pa, Lq, vp, J, j, ob, D * 4); break;
      case 3: values<3>(pa, Lq, vp, J, j, ob, D * 4); break;
      default: values<4>(pa, Lq, vp, J, j, ob, D * 4);
    }
  }
  for (int64_t r = 0; r < m; ++r)
    for (int64_t d = 0; d < D; d += 16)
      _mm512_storeu_ps(out + r * out_stride + d, _mm512_mul_ps(_mm512_load_ps(ob + r * D + d), _mm512_set1_ps(inv[r])));
}

// A thread's share of the units (query block, head): the longest prefixes first, one at a time to
// whichever thread is free.
template <int C>
SPECEE_AMX_BF16 void run_units(std::atomic<int64_t>& next, const float* q, int64_t start, int64_t S, int64_t heads,
                               int64_t group, const uint16_t* kv, int64_t L, float* out, int64_t out_stride) {
  constexpr int64_t D = 32 * C;
  const int64_t blocks = (S + kRows - 1) / kRows, units = blocks * heads;
  thread_local Scratch work;
  bool configured = false;
  for (int64_t u; (u = next.fetch_add(1)) < units;) {
    if (!configured) configure(), configured = true;
    const int64_t b = blocks - 1 - u / heads, h = u % heads, g = h / group;
    const int64_t q0 = b * kRows, m = std::min(kRows, S - q0);
    attend_block<C>(q + h * S * D, start, q0, m, reinterpret_cast<const uint32_t*>(kv + 2 * g * L * D),
                    kv + (2 * g + 1) * L * D, out + q0 * out_stride + h * D, out_stride, work);
  }
  if (configured) _tile_release();
}

template <int C>
void attend(const float* q, int64_t start, int64_t S, int64_t heads, int64_t kv_heads, const c10::Half* K,
            int64_t k_stride, const c10::Half* V, int64_t v_stride, float* out, int64_t out_stride) {
  constexpr int64_t D = 32 * C;
  const int64_t L = (start + S + 31) / 32 * 32;  // slots 0 .. start + S - 1, padded
  thread_local Scratch packed;  // the calling thread's: each kv head's keys, then its values
  uint16_t* kv = packed.at_least<uint16_t>(2 * kv_heads * L * D);
  at::parallel_for(0, 2 * kv_heads, 1, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      uint16_t* dst = kv + i * L * D;
      if (i % 2 == 0)
        pack_keys(K + i / 2 * k_stride, start + S, L, D, reinterpret_cast<uint32_t*>(dst));
      else
        pack_values(V + i / 2 * v_stride, start + S, L, D, dst);
    }
  });
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    run_units<C>(next, q, start, S, heads, heads / kv_heads, kv, L, out, out_stride);
  });
}
#endif

bool amx_attention_available(int64_t head_dim) { return head_dim % 32 == 0 && head_dim <= 128 && amx_enabled(); }

}  // namespace

bool prompt_attention_available(int64_t head_dim) {
  return amx_attention_available(head_dim) || (prompt_tiles_on() && row_attention_available(head_dim));
}

void prompt_attention(const float* q, int64_t start, int64_t S, int64_t D, int64_t heads, int64_t kv_heads,
                      const c10::Half* K, int64_t k_stride, const c10::Half* V, int64_t v_stride, float* out,
                      int64_t out_stride) {
  TORCH_CHECK(prompt_attention_available(D) && heads % kv_heads == 0,
              "prompt_attention: needs AMX tiles (a head size of 32, 64, 96 or 128) or the AVX2 or AVX-512 level (a "
              "multiple of 16 up to 256), prompt tiles switched on (got a head size of ", D, ")");
  if (!amx_attention_available(D))
    return prompt_attention_avx2(q, start, S, D, heads, kv_heads, K, k_stride, V, v_stride, out, out_stride);
#ifdef SPECEE_AMX_BUILT
  switch (D / 32) {
    case 1: return attend<1>(q, start, S, heads, kv_heads, K, k_stride, V, v_stride, out, out_stride);
    case 2: return attend<2>(q, start, S, heads, kv_heads, K, k_stride, V, v_stride, out, out_stride);
    case 3: return attend<3>(q, start, S, heads, kv_heads, K, k_stride, V, v_stride, out, out_stride);
    default: return attend<4>(q, start, S, heads, kv_heads, K, k_stride, V, v_stride, out, out_stride);
  }
#endif
}
