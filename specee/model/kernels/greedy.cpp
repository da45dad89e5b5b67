// The greedy choice of every row of a step's logits in one call: the first index of each row's
// maximum, or -1 where the row's maximum is NaN or infinite (sampling.py's NONFINITE_TOKEN). Why:
// torch's max over a 49,152-wide row takes ~27 us and greedy() made three calls per request, 0.6 ms of
// an 8-request SmolLM2 step (AMD EPYC, 2 threads); this takes a few microseconds a row.
// top_k_rows: each row's k largest, the candidates a quantized LM head recomputes exactly
// (quant.py RefinedHead): torch.topk took 121 us of a SmolLM2 token's 5.4 ms (Intel Xeon, 2 threads).
// rescore_rows: those candidates' exact logits written back. After a token's layers have streamed the
// weights through the caches, each small torch call runs cold: the five of the rescoring took 47 us of
// a SmolLM2 token (Intel Xeon, 2 threads), where its arithmetic takes about one. exit_features: an
// early-exit check's features, the candidates' logits under the final norm, in one call as well.
#include "greedy.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "int4_matmul.h"
#include "rms_norm.h"

namespace {

// The scan from index `from` on, `first` the best before it: the first maximum, or -1 where it is not finite
// (a NaN anywhere makes torch's max NaN)
int64_t finish(const float* x, int64_t from, int64_t n, int64_t first) {
  for (int64_t i = from; i < n; ++i) {
    if (std::isnan(x[i])) return -1;
    if (x[i] > x[first]) first = i;
  }
  return std::isfinite(x[first]) ? first : -1;
}

int64_t row_portable(const float* x, int64_t n) { return finish(x, 0, n, 0); }

// 16 lanes, each keeping its first maximum (strictly greater replaces); the lowest index among the lanes
// holding the overall maximum is the row's first; the tail past the last full block goes to finish()
int64_t row_avx512(const float* x, int64_t n) __attribute__((target("avx512f")));
int64_t row_avx512(const float* x, int64_t n) {
  if (n < 16) return row_portable(x, n);
  __m512 best = _mm512_loadu_ps(x);
  __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i lane = at;
  __mmask16 nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
  int64_t i = 16;
  for (; i + 16 <= n; i += 16) {
    lane = _mm512_add_epi32(lane, _mm512_set1_epi32(16));
    const __m512 v = _mm512_loadu_ps(x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __mmask16 more = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, more, v);
    at = _mm512_mask_mov_epi32(at, more, lane);
  }
  if (nan) return -1;
  const __mmask16 ties = _mm512_cmp_ps_mask(best, _mm512_set1_ps(_mm512_reduce_max_ps(best)), _CMP_EQ_OQ);
  return finish(x, i, n, _mm512_mask_reduce_min_epi32(ties, at));
}

// row_avx512's scan in 8 lanes (AMD EPYC Zen 3 and other AVX2-only CPUs: the portable loop took 1.5% of an
// 8-request SmolLM2 step's samples there)
int64_t row_avx2(const float* x, int64_t n) __attribute__((target("avx2")));
int64_t row_avx2(const float* x, int64_t n) {
  if (n < 8) return row_portable(x, n);
  __m256 best = _mm256_loadu_ps(x);
  __m256i at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256i lane = at;
  __m256 nan = _mm256_cmp_ps(best, best, _CMP_UNORD_Q);
  int64_t i = 8;
  for (; i + 8 <= n; i += 8) {
    lane = _mm256_add_epi32(lane, _mm256_set1_epi32(8));
    const __m256 v = _mm256_loadu_ps(x + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256 more = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
    best = _mm256_blendv_ps(best, v, more);
    at = _mm256_blendv_epi8(at, lane, _mm256_castps_si256(more));
  }
  if (_mm256_movemask_ps(nan)) return -1;
  alignas(32) float b[8];
  alignas(32) int32_t a[8];
  _mm256_store_ps(b, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(a), at);
  int first = 0;  // the lowest index among the lanes holding the maximum
  for (int j = 1; j < 8; ++j)
    if (b[j] > b[first] || (b[j] == b[first] && a[j] < a[first])) first = j;
  return finish(x, i, n, a[first]);
}

// The k largest of a row, best first (a tie keeps the lower index first; NaN never enters), kept in
// `val`/`idx` sorted descending: a value above the k-th best is inserted in place. Empty places
// (-inf, index -1) left by a row with fewer than k values above -inf take the lowest unused indices.
struct TopK {
  std::vector<float> val;
  std::vector<int64_t> idx;

  explicit TopK(int64_t k) : val(k), idx(k) {}
  void clear() {  // a new row (the buffers are the call's, not the row's)
    std::fill(val.begin(), val.end(), -std::numeric_limits<float>::infinity());
    std::fill(idx.begin(), idx.end(), -1);
  }
  void fill_empty() {
    int64_t next = 0;
    for (int64_t& i : idx) {
      if (i >= 0) continue;
      while (std::find(idx.begin(), idx.end(), next) != idx.end()) ++next;
      i = next;
    }
  }
  float floor() const { return val.back(); }
  void offer(float v, int64_t i) {
    if (!(v > val.back())) return;
    int64_t j = static_cast<int64_t>(val.size()) - 1;
    for (; j > 0 && v > val[j - 1]; --j) {
      val[j] = val[j - 1];
      idx[j] = idx[j - 1];
    }
    val[j] = v;
    idx[j] = i;
  }
  void offer_lanes(const float* x, int64_t i, uint32_t above) {  // x[i + lane] for each lane set in `above`
    for (; above; above &= above - 1) offer(x[i + __builtin_ctz(above)], i + __builtin_ctz(above));
  }
};

void top_k_portable(const float* x, int64_t n, TopK& top) {
  for (int64_t i = 0; i < n; ++i) top.offer(x[i], i);
}

// 16 values a compare against the k-th best; only the lanes above it are offered (after the first
// few blocks, rarely any)
void top_k_avx512(const float* x, int64_t n, TopK& top) __attribute__((target("avx512f")));
void top_k_avx512(const float* x, int64_t n, TopK& top) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    top.offer_lanes(x, i, _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), _mm512_set1_ps(top.floor()), _CMP_GT_OQ));
  }
  for (; i < n; ++i) top.offer(x[i], i);
}

// top_k_avx512's compares 8 values at a time
void top_k_avx2(const float* x, int64_t n, TopK& top) __attribute__((target("avx2")));
void top_k_avx2(const float* x, int64_t n, TopK& top) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    top.offer_lanes(x, i, _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(top.floor()), _CMP_GT_OQ)));
  }
  for (; i < n; ++i) top.offer(x[i], i);
}

}  // namespace

at::Tensor top_k_rows(const at::Tensor& logits, int64_t k) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "top_k_rows: contiguous float32 logits [rows, vocab]");
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(0 < k && k <= n, "top_k_rows: k must be in [1, vocab]");
  at::Tensor out = at::empty({rows, k}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  const bool wide = avx512_level(), avx2 = avx2_level();
  TopK top(k);
  for (int64_t r = 0; r < rows; ++r) {
    top.clear();
    if (wide)
      top_k_avx512(x + r * n, n, top);
    else if (avx2)
      top_k_avx2(x + r * n, n, top);
    else
      top_k_portable(x + r * n, n, top);
    top.fill_empty();
    std::copy(top.idx.begin(), top.idx.end(), o + r * k);
  }
  return out;
}

at::Tensor greedy_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous() && logits.size(1) > 0,
              "greedy_rows: contiguous float32 logits [rows, vocab]");
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(n < (int64_t{1} << 31), "greedy_rows: vocab too large");
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  const bool wide = avx512_level(), avx2 = avx2_level();
  for (int64_t r = 0; r < rows; ++r)
    o[r] = wide ? row_avx512(x + r * n, n) : avx2 ? row_avx2(x + r * n, n) : row_portable(x + r * n, n);
  return out;
}

at::Tensor rescore_rows(at::Tensor logits, const at::Tensor& ids, const at::Tensor& rows, const at::Tensor& x) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous() && ids.dim() == 2 &&
                  ids.scalar_type() == at::kLong && ids.is_contiguous() && ids.size(0) == logits.size(0) &&
                  rows.dim() == 3 && rows.scalar_type() == at::kFloat && rows.is_contiguous() &&
                  rows.size(0) == ids.size(0) && rows.size(1) == ids.size(1) && x.dim() == 2 &&
                  x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(0) == ids.size(0) &&
                  x.size(1) == rows.size(2),
              "rescore_rows: float32 logits [M, vocab], int64 ids [M, k], float32 rows [M, k, K] and x [M, K], contiguous");
  const int64_t M = ids.size(0), k = ids.size(1), K = x.size(1), vocab = logits.size(1);
  float* out = logits.data_ptr<float>();
  const int64_t* id = ids.data_ptr<int64_t>();
  const float* w = rows.data_ptr<float>();
  const float* xs = x.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t i = id[m * k + j];
      TORCH_CHECK(0 <= i && i < vocab, "rescore_rows: id ", i, " outside the vocabulary");
      const float* wr = w + (m * k + j) * K;
      const float* xr = xs + m * K;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t c = 0; c < K; ++c) dot += wr[c] * xr[c];
      out[m * vocab + i] = dot;
    }
  return logits;
}

// exit/features.py's features of N rows in one call, its torch form's dozen small calls (about 100 us a
// check on a Zen 3, more than a SmolLM2 layer) in a few: x = the final norm of h_prev and h (float32),
// logits = x . rows (rows [k, H] shared or [N, k, H]) -> [N, 3k] = logits(h), softmax(logits(h)),
// softmax(logits(h)) - softmax(logits(h_prev)). Dot products as rms_norm sums its squares (sum16).
at::Tensor exit_features(const at::Tensor& h_prev, const at::Tensor& h, const at::Tensor& w, double eps,
                         const at::Tensor& rows) {
  TORCH_CHECK(h.dim() == 2 && h_prev.sizes() == h.sizes() && w.scalar_type() == at::kFloat && w.is_contiguous() &&
                  w.dim() == 1 && w.size(0) == h.size(1) && rows.scalar_type() == at::kFloat && rows.is_contiguous() &&
                  rows.size(-1) == h.size(1) && (rows.dim() == 2 || (rows.dim() == 3 && rows.size(0) == h.size(0))),
              "exit_features: h_prev, h [N, H], a float32 norm weight [H] and float32 rows [k, H] or [N, k, H]");
  const at::Tensor states[2] = {h_prev.to(at::kFloat).contiguous(), h.to(at::kFloat).contiguous()};
  const int64_t N = h.size(0), H = h.size(1), k = rows.size(-2);
  at::Tensor out = at::empty({N, 3 * k}, at::kFloat);
  thread_local std::vector<float> x, p;  // the calling thread's, kept between checks
  x.resize(H), p.resize(2 * k);
  for (int64_t n = 0; n < N; ++n) {
    const float* r = rows.data_ptr<float>() + (rows.dim() == 3 ? n * k * H : 0);
    float* o = out.data_ptr<float>() + n * 3 * k;
    for (int s = 0; s < 2; ++s) {  // p[s k + j]: logit j of state s, then its softmax
      rms_norm(states[s].data_ptr<float>() + n * H, w.data_ptr<float>(), x.data(), H, eps);
      for (int64_t j = 0; j < k; ++j) p[s * k + j] = sum16(x.data(), r + j * H, H);
      if (s == 1) std::copy_n(p.data() + k, k, o);
      float* ps = p.data() + s * k;
      const float top = *std::max_element(ps, ps + k);
      float sum = 0.f;
      for (int64_t j = 0; j < k; ++j) sum += ps[j] = std::exp(ps[j] - top);
      for (int64_t j = 0; j < k; ++j) ps[j] /= sum;
    }
    for (int64_t j = 0; j < k; ++j) o[k + j] = p[k + j], o[2 * k + j] = p[k + j] - p[j];
  }
  return out;
}
