// One decoder layer for a step's rows on the CPU (`ragged`: every request's segment, a token, a
// verification pass's rows or a prefill): the layer of model/llama.py, with its elementwise work
// (RMS norms, RoPE, the K/V write, SiLU gate and the residual adds) in plain loops, its products in
// the int4 / K-quant kernels (or ATen for a float or int8 linear), and attention in row_attention.cpp
// (ATen's for trees and masks). Why: at batch 1 on a small model the ~40 ATen calls a layer makes
// from Python cost more than its products (SmolLM2-135M: 4 of 11 ms per token); here a few.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "activation.h"
#include "greedy.h"
#include "amx_prompt.h"
#include "int4_matmul.h"
#include "kquant.h"
#include "layer_linear.h"
#include "layer_workspace.h"
#include "rms_norm.h"
#include "prompt_attention.h"
#include "row_attention.h"

namespace {

using specee_layer::Linear;
using specee_layer::Run;
using specee_layer::long_prompt;
using specee_layer::row_runs;
using specee_layer::workspace;
using specee_layer::Workspace;

// elements of elementwise work (norms, RoPE, the gate) worth a parallel region (a few microseconds): a
// prompt's rows split between threads, a decode step's row in one
constexpr int64_t kGrain = 16384;
constexpr int64_t kMlpBytes = 16 << 20;  // gate/up outputs of the rows whose MLP runs in one pass

// HF half rotation with the sign folded into sin (model/rope.py): out[d] = x[d] cos[d] + x[(d + D/2) % D] sin[d],
// in two halves so that the loops vectorize
void rope(const float* x, const float* cos, const float* sin, float* out, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < half; ++d) out[d] = x[d] * cos[d] + x[d + half] * sin[d];
  for (int64_t d = half; d < D; ++d) out[d] = x[d] * cos[d] + x[d - half] * sin[d];
}

// One row's attention to one kv head's keys (its group of query heads): `len` slots, run by `thread`.
struct Unit {
  int64_t len;
  size_t row;  // index in the rows that attend alone
  int64_t kv_head;
  int64_t thread;
};

// y += x over n elements: a residual add, the single rounding of ATen's add without its dispatch
void add_into(float* y, const float* x, int64_t n) {
  at::parallel_for(0, n, kGrain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) y[i] += x[i];
  });
}

// rms_norm of every row of x [S, n] into out
void rms_norm_rows(const float* x, const float* w, float* out, int64_t S, int64_t n, double eps) {
  at::parallel_for(0, S, std::max<int64_t>(1, kGrain / n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rms_norm(x + r * n, w, out + r * n, n, eps);
  });
}

}  // namespace

class DecodeLayer {
 public:
  DecodeLayer(at::Tensor attn_norm, at::Tensor mlp_norm, double eps, int64_t heads, int64_t kv_heads, int64_t head_dim,
              std::vector<int64_t> kinds, std::vector<at::Tensor> weights, std::vector<at::Tensor> aux,
              std::vector<at::Tensor> biases, std::vector<int64_t> groups)
      : attn_norm_(attn_norm.contiguous()), mlp_norm_(mlp_norm.contiguous()), eps_(eps), heads_(heads),
        kv_heads_(kv_heads), head_dim_(head_dim) {
    TORCH_CHECK(kinds.size() == 4 && weights.size() == 4 && aux.size() == 4 && biases.size() == 4 && groups.size() == 4,
                "DecodeLayer: qkv, o, gate_up, down");
    for (int i = 0; i < 4; ++i) lin_[i] = Linear{kinds[i], weights[i], aux[i], biases[i], groups[i]};
  }

  // Rows h [1, S, H] of one sequence at cache `slots` [S] (int64); cos, sin [1, S, 1, D] (their
  // positions); the layer's cache k, v [1, kv_heads, len, D]; kv_len: slots attention reads;
  // mask: [1, 1, S, kv_len] bool or empty (none); causal: a prompt's rows, consecutive slots from 0 (no
  // mask) or from where a chunked prefill's part starts (the mask says so for ATen's attention), each
  // reading the slots up to its own; chain: the same reads for a verification chain, whose rows must
  // compute what decode rows compute (model/llama.py StepInputs).
  at::Tensor forward(const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                     at::Tensor v_cache, const at::Tensor& slots, int64_t kv_len, const at::Tensor& mask,
                     bool causal, bool chain) const {
    return forward_ragged(h, cos, sin, slots, {k_cache}, {v_cache}, {h.size(1)}, {kv_len}, {mask}, {causal}, {chain},
                          at::empty(h.sizes(), h.options()));
  }

  // The rows of several sequences in one call (a ragged batch): segment g is the next rows[g] rows
  // of h, writing and reading its own cache k[g], v[g] (views into one pool: any strides along heads
  // and slots) under its own attention description. The products run once over each run of rows
  // (row_runs: a long prompt's on AMX tiles, the rest on the int8 kernels; in both a row's result does
  // not depend on the others); attention runs per segment, exactly the call that segment would make
  // alone, so batching leaves every row's numbers unchanged. h: [1, S, H] or [S, H]; the output goes to
  // `into` (the same shape; not h), which is returned.
  const at::Tensor& forward_ragged(const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin,
                                   const at::Tensor& slots, const std::vector<at::Tensor>& k,
                                   const std::vector<at::Tensor>& v, const std::vector<int64_t>& rows,
                                   const std::vector<int64_t>& kv_lens, const std::vector<at::Tensor>& masks,
                                   const std::vector<bool>& causal, const std::vector<bool>& chain,
                                   const at::Tensor& into) const {
    const int64_t S = h.size(-2), H = h.size(-1), D = head_dim_, NH = heads_, NKV = kv_heads_;
    const at::Tensor hc = h.contiguous(), c = cos.contiguous(), sn = sin.contiguous(), sl = slots.contiguous();
    TORCH_CHECK(c.numel() == S * D && sl.numel() == S && k.size() == rows.size() && v.size() == rows.size() &&
                    hc.scalar_type() == at::kFloat && into.is_contiguous() && into.numel() == S * H &&
                    into.scalar_type() == at::kFloat && !into.is_same(h),
                "DecodeLayer: inputs");
    Workspace& ws = workspace();
    const int64_t* slot = sl.data_ptr<int64_t>();
    const float* cs = c.data_ptr<float>();
    const float* sg = sn.data_ptr<float>();
    const at::Tensor x = ws.normed.rows(S, H);
    rms_norm_rows(hc.data_ptr<float>(), attn_norm_.data_ptr<float>(), x.data_ptr<float>(), S, H, eps_);
    const std::vector<Run>& runs = row_runs(rows, causal);
    const int64_t W = (NH + 2 * NKV) * D;
    const at::Tensor qkv = lin_[0](x, runs, 0, ws.qkv.rows(S, W));
    const at::Tensor attn = ws.attn.rows(S, NH * D);
    const bool rows_alone = row_attention_available(D);
    const auto attends_alone = [&](size_t g) {
      return rows_alone && (causal[g] || chain[g] || (rows[g] == 1 && !masks[g].numel()));
    };
    const bool tiles_attend = prompt_attention_available(D);  // (implies rows_alone)
    const auto on_tiles = [&](size_t g) {  // a prompt whose rows attend together (prompt_attention.h)
      return tiles_attend && long_prompt(causal[g], rows[g]) && k[g].scalar_type() == at::kHalf;
    };
    // RoPE and the K/V writes of every segment first (a decode row's in its attention units); then the rows
    // that attend alone over their own prefix (decode rows, chains, a prefill's rows: row_attention.cpp) in
    // parallel, each by one thread,
    // so a row's numbers do not depend on the batch; then a long prompt's rows on the tiles
    // (prompt_attention.cpp); then the other segments (trees, masks, holes), one ATen call each. A
    // prefill's rows went to ATen's flash attention: MKL's float32 GEMM ran ~160 GFLOP/s here (AMD
    // EPYC Zen 5, 2 threads), 25% of SmolLM2's prefill; alone they take 31% less time.
    // every segment's rotated queries in one buffer, segment g's [NH, rows[g], D] from row firsts[g] on
    std::vector<int64_t>& firsts = ws.firsts;
    firsts.resize(rows.size());
    const at::Tensor q_all = ws.queries.rows(S, NH * D);
    float* const q_base = q_all.data_ptr<float>();
    const auto q_of = [&](size_t g) { return q_base + firsts[g] * NH * D; };
    std::vector<std::pair<int64_t, int64_t>>& alone = ws.alone;  // (segment, row within it)
    alone.clear();
    const float* const rows_qkv = qkv.data_ptr<float>();
    // Row i of segment g, kv head j: its group of query heads rotated into the segment's queries, its key
    // rotated and its value written to the cache at its slot (a float16 cache's key rotated, then rounded)
    std::vector<specee_layer::SegmentCache>& caches = ws.caches;
    caches.resize(rows.size());
    const auto place = [&](size_t g, int64_t i, int64_t j) {
      const specee_layer::SegmentCache& c = caches[g];
      const int64_t n = rows[g], r = firsts[g] + i, group = NH / NKV;
      const float *row = rows_qkv + r * W, *cr = cs + r * D, *sr = sg + r * D;
      for (int64_t h = j * group; h < (j + 1) * group; ++h) rope(row + h * D, cr, sr, q_of(g) + (h * n + i) * D, D);
      const float* value = row + (NH + NKV + j) * D;
      const int64_t at_k = j * c.k_stride + slot[r] * D, at_v = j * c.v_stride + slot[r] * D;
      if (c.half) {
        float k_row[256];  // (head_dim <= 256)
        rope(row + (NH + j) * D, cr, sr, k_row, D);
        to_half(k_row, static_cast<at::Half*>(c.k) + at_k, D);
        to_half(value, static_cast<at::Half*>(c.v) + at_v, D);
      } else {
        rope(row + (NH + j) * D, cr, sr, static_cast<float*>(c.k) + at_k, D);
        std::copy(value, value + D, static_cast<float*>(c.v) + at_v);
      }
    };
    // A decode row (a segment of one row attending alone) is placed by its attention units, in parallel: done
    // here, one thread placed 8 SmolLM2 rows in 7 us a layer while the other waited (AMD EPYC Zen 4). The rows
    // of longer segments come first, as a row of a prompt or a chain attends to the rows before it.
    const auto placed_by_units = [&](size_t g) { return rows[g] == 1 && attends_alone(g) && !on_tiles(g); };
    int64_t first = 0;
    for (size_t g = 0; g < rows.size(); ++g) {
      const int64_t n = rows[g];
      const at::Tensor &kc = k[g], &vc = v[g];
      TORCH_CHECK(kc.stride(3) == 1 && kc.stride(2) == D && vc.stride(3) == 1 && vc.stride(2) == D,
                  "DecodeLayer: cache rows must be contiguous per head");
      const bool half = kc.scalar_type() == at::kHalf;
      TORCH_CHECK(vc.scalar_type() == kc.scalar_type() && (half || kc.scalar_type() == at::kFloat),
                  "DecodeLayer: the cache holds float32 or float16");
      firsts[g] = first;
      caches[g] = {kc.data_ptr(), vc.data_ptr(), kc.stride(1), vc.stride(1), half};
      for (int64_t i = 0; i < n; ++i) TORCH_CHECK(slot[first + i] < kc.size(2), "DecodeLayer: slot past the cache");
      if (!placed_by_units(g))
        at::parallel_for(0, n, std::max<int64_t>(1, kGrain / W), [&](int64_t i0, int64_t i1) {
          for (int64_t i = i0; i < i1; ++i)
            for (int64_t j = 0; j < NKV; ++j) place(g, i, j);
        });
      if (attends_alone(g) && !on_tiles(g))
        for (int64_t i = 0; i < n; ++i) alone.emplace_back(g, i);
      first += n;
    }
    TORCH_CHECK(first == S, "DecodeLayer: segment rows do not add up to the rows given");
    // each (row, kv head) is one unit of work costing its prefix length; units go to threads longest
    // first, each to the least loaded thread, so one long request does not leave the other threads waiting
    // (contiguous halves of the rows did: 8 requests of 99-831 tokens, libgomp spun 20% of a step)
    const int64_t group = NH / NKV;
    // reused across calls (the engine thread's): a layer call allocates nothing for the plan
    thread_local std::vector<Unit> units;
    thread_local std::vector<int64_t> load;
    units.clear();
    for (size_t a = 0; a < alone.size(); ++a) {
      const auto [g, i] = alone[a];
      const int64_t len = rows[g] == 1 ? kv_lens[g] : slot[firsts[g] + i] + 1;
      for (int64_t j = 0; j < NKV; ++j) units.push_back({len, a, j, 0});
    }
    std::sort(units.begin(), units.end(), [](const Unit& x, const Unit& y) { return x.len > y.len; });
    const int64_t threads = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(units.size()));
    load.assign(threads, 0);
    for (Unit& u : units) {
      u.thread = std::min_element(load.begin(), load.end()) - load.begin();
      load[u.thread] += u.len + 16;  // + a unit's fixed cost
    }
    const std::vector<Unit>& plan = units;  // this thread's, named for the workers (thread_local is per thread)
    float* const attn_base = attn.data_ptr<float>();
    at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
      for (const Unit& u : plan) {
        if (u.thread < t0 || u.thread >= t1) continue;
        const auto [g, i] = alone[u.row];
        const int64_t j = u.kv_head, len = u.len;
        if (placed_by_units(g)) place(g, i, j);
        const specee_layer::SegmentCache& c = caches[g];
        const float* q = q_of(g) + i * D + j * group * rows[g] * D;
        float* o = attn_base + (firsts[g] + i) * NH * D + j * group * D;
        if (c.half)
          row_attention(q, rows[g] * D, static_cast<const at::Half*>(c.k) + j * c.k_stride, c.k_stride,
                        static_cast<const at::Half*>(c.v) + j * c.v_stride, c.v_stride, len, D, group, 1, o);
        else
          row_attention(q, rows[g] * D, static_cast<const float*>(c.k) + j * c.k_stride, c.k_stride,
                        static_cast<const float*>(c.v) + j * c.v_stride, c.v_stride, len, D, group, 1, o);
      }
    });
    for (size_t g = 0; g < rows.size(); ++g) {
      if (!on_tiles(g)) continue;
      const specee_layer::SegmentCache& c = caches[g];  // (float16: on_tiles says so)
      prompt_attention(q_of(g), slot[firsts[g]], rows[g], D, NH, NKV, static_cast<const at::Half*>(c.k), c.k_stride,
                       static_cast<const at::Half*>(c.v), c.v_stride, attn_base + firsts[g] * NH * D, NH * D);
    }
    for (size_t g = 0; g < rows.size(); ++g) {
      if (attends_alone(g)) continue;
      const at::Tensor q = q_all.view(-1).narrow(0, firsts[g] * NH * D, NH * rows[g] * D).view({1, NH, rows[g], D});
      const at::Tensor out = attention(q, k[g], v[g], slot + firsts[g], kv_lens[g], masks[g], causal[g], chain[g]);
      attn.narrow(0, firsts[g], rows[g]).copy_(out.transpose(1, 2).reshape({rows[g], NH * D}));
    }
    const at::Tensor out = into.dim() == 2 ? into : into.view({S, H});
    lin_[1](attn, runs, 0, out);
    add_into(out.data_ptr<float>(), hc.data_ptr<float>(), S * H);
    rms_norm_rows(out.data_ptr<float>(), mlp_norm_.data_ptr<float>(), x.data_ptr<float>(), S, H, eps_);
    // the MLP a chunk of rows at a time: a long prompt's gate/up output past glibc's mmap threshold (32 MB;
    // Qwen2.5-1.5B, 512 rows: 37 MB) came back as fresh pages, faulted in on every layer (+35% on that product)
    const int64_t chunk = std::max<int64_t>(1, kMlpBytes / (lin_[2].outputs() * 4));
    for (int64_t c0 = 0; c0 < S; c0 += chunk) {
      const int64_t n = std::min(chunk, S - c0);
      const at::Tensor gu = lin_[2](x.narrow(0, c0, n), runs, c0, ws.gate_up.rows(n, lin_[2].outputs()));  // [n, 2 I]
      const int64_t I = gu.size(1) / 2;
      const at::Tensor act = ws.act.rows(n, I);
      at::parallel_for(0, n, std::max<int64_t>(1, kGrain / I), [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          const float* g = gu.data_ptr<float>() + r * 2 * I;
          silu_mul(g, g + I, act.data_ptr<float>() + r * I, I);
        }
      });
      const at::Tensor down = lin_[3](act, runs, c0, ws.down.rows(n, H));
      add_into(out.data_ptr<float>() + c0 * H, down.data_ptr<float>(), n * H);
    }
    return into;
  }

 private:
  // A chain's rows (each reading the slots up to its own) attend one at a time, unmasked, over that
  // prefix: the very call a one-token decode step makes, so a verified token's numbers equal
  // decoding it alone and speculative greedy output equals full-depth greedy bit for bit. One
  // masked call over all rows rounds differently, which parts the texts where the top two tokens
  // nearly tie (SmolLM2 4-bit, n-gram drafts, 8 prompts x 96 tokens: 6 of 8 identical).
  // A float16 cache's prefix is read as float32 (ATen's attention takes one dtype): a tree's or a
  // masked segment's call, or every row where row_attention.cpp does not run.
  at::Tensor attention(const at::Tensor& q, const at::Tensor& k_stored, const at::Tensor& v_stored, const int64_t* slot,
                       int64_t kv_len, const at::Tensor& mask, bool causal, bool chain) const {
    const int64_t S = q.size(2);
    const bool gqa = heads_ != kv_heads_;
    const at::Tensor k_cache = k_stored.narrow(2, 0, kv_len).to(at::kFloat);
    const at::Tensor v_cache = v_stored.narrow(2, 0, kv_len).to(at::kFloat);
    if (chain && S > 1) {
      at::Tensor out = at::empty_like(q);
      for (int64_t r = 0; r < S; ++r)
        out.narrow(2, r, 1).copy_(at::scaled_dot_product_attention(
            q.narrow(2, r, 1).contiguous(), k_cache.narrow(2, 0, slot[r] + 1), v_cache.narrow(2, 0, slot[r] + 1),
            std::nullopt, 0.0, false, std::nullopt, gqa));
      return out;
    }
    std::optional<at::Tensor> attn_mask;
    if (mask.numel()) attn_mask = mask;
    return at::scaled_dot_product_attention(q, k_cache, v_cache, attn_mask, 0.0, causal && !attn_mask, std::nullopt, gqa);
  }

  at::Tensor attn_norm_, mlp_norm_;
  double eps_;
  int64_t heads_, kv_heads_, head_dim_;
  Linear lin_[4];
};

// A model's decoder layers, a range of them over a step's rows in one call. Why: a call from Python
// into one layer cost about 8 us beyond its work (the interpreter and pybind11 running cold after the
// layer before streamed its weights through the caches): SmolLM2 steps took 4.37 ms that way, 4.11 so.
class DecodeStack {
 public:
  explicit DecodeStack(std::vector<DecodeLayer> layers) : layers_(std::move(layers)) {}

  // Layers first .. last - 1 on the rows h, as DecodeLayer::forward_ragged each; k[i], v[i]: layer
  // i's caches of the segments (every layer's lists, as RaggedInputs keeps them).
  at::Tensor forward_ragged(int64_t first, int64_t last, at::Tensor h, const at::Tensor& cos, const at::Tensor& sin,
                            const at::Tensor& slots, const std::vector<std::vector<at::Tensor>>& k,
                            const std::vector<std::vector<at::Tensor>>& v, const std::vector<int64_t>& rows,
                            const std::vector<int64_t>& kv_lens, const std::vector<at::Tensor>& masks,
                            const std::vector<bool>& causal, const std::vector<bool>& chain) const {
    const int64_t L = static_cast<int64_t>(layers_.size());
    TORCH_CHECK(0 <= first && first <= last && last <= L && static_cast<int64_t>(k.size()) == L &&
                    static_cast<int64_t>(v.size()) == L, "DecodeStack: a layer range and every layer's caches");
    // the layers hand their rows to each other through the workspace; the last writes a new tensor
    Workspace& ws = workspace();
    const int64_t S = h.size(1), H = h.size(2);
    for (int64_t i = first; i < last; ++i) {  // (the workspace's rows are [S, H])
      const at::Tensor into = i == last - 1 ? at::empty({1, S, H}, at::kFloat) : ws.hidden[(i - first) % 2].rows(S, H);
      h = layers_[i].forward_ragged(h, cos, sin, slots, k[i], v[i], rows, kv_lens, masks, causal, chain, into);
    }
    return h;
  }

 private:
  std::vector<DecodeLayer> layers_;
};

// The calls that run the model release the GIL (pure ATen and C++ inside), so the engine thread's
// layers do not stall the threads that stream its output, and theirs do not stall it.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<DecodeLayer>(m, "DecodeLayer")
      .def(pybind11::init<at::Tensor, at::Tensor, double, int64_t, int64_t, int64_t, std::vector<int64_t>,
                          std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<int64_t>>())
      .def("__call__", &DecodeLayer::forward, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("ragged",
           [](const DecodeLayer& layer, const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin,
              const at::Tensor& slots, const std::vector<at::Tensor>& k, const std::vector<at::Tensor>& v,
              const std::vector<int64_t>& rows, const std::vector<int64_t>& kv_lens,
              const std::vector<at::Tensor>& masks, const std::vector<bool>& causal, const std::vector<bool>& chain) {
             return layer.forward_ragged(h, cos, sin, slots, k, v, rows, kv_lens, masks, causal, chain,
                                         at::empty(h.sizes(), h.options()));
           },
           pybind11::call_guard<pybind11::gil_scoped_release>());
  pybind11::class_<DecodeStack>(m, "DecodeStack")
      .def(pybind11::init<std::vector<DecodeLayer>>())
      .def("ragged", &DecodeStack::forward_ragged, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("int4_best_level", &int4_best_level);
  m.def("int4_level", &int4_level);
  m.def("int4_bf16_level", &int4_bf16_level);
  m.def("int4_set_level", &int4_set_level);
  m.def("int4_activations", &int4_activations);
  m.def("int4_set_activations", &int4_set_activations);
  m.def("int4_prefetch", &int4_prefetch);
  m.def("int4_set_prefetch", &int4_set_prefetch);
  // the products as Python calls them: each into a new tensor (`out` is the C++ layer's)
  using Product = at::Tensor (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&);
  const auto bind = [&m](const char* name, Product product) {
    m.def(
        name, [product](const at::Tensor& x, const at::Tensor& w, const at::Tensor& aux) { return product(x, w, aux, {}); },
        pybind11::call_guard<pybind11::gil_scoped_release>());
  };
  bind("int4_mm", &int4_mm);
  bind("int4_mm_amx", &int4_mm_amx);
  bind("kquant_mm_amx", &kquant_mm_amx);
  bind("kquant_mm", &kquant_mm);
  m.def("amx_available", &amx_available);
  m.def("amx_enabled", &amx_enabled);
  m.def("prompt_tiles_on", &prompt_tiles_on);
  m.def("amx_set_enabled", &amx_set_enabled);
  m.def("kquant_check", &kquant_check);
  m.def("kquant_repack", [](const at::Tensor& blocks, int64_t qtype, int64_t K, at::Tensor out, int64_t at) {
    return kquant_repack(blocks, qtype, K, out, at);
  }, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("row_attention_available", &row_attention_available);
  m.def("greedy_rows", &greedy_rows);
  m.def("top_k_rows", &top_k_rows);
  m.def("rescore_rows", &rescore_rows);
  m.def("q8_0_rows", &q8_0_rows);
  m.def("rms_norm", [](const at::Tensor& x, const at::Tensor& w, double eps) {  // the final norm, as the layers'
    TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && w.dim() == 1 && w.is_contiguous() &&
                    x.size(-1) == w.size(0), "rms_norm: float32 x [..., H] and weight [H]");
    const at::Tensor xc = x.contiguous();
    at::Tensor out = at::empty_like(xc);
    rms_norm_rows(xc.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(), xc.numel() / w.size(0), w.size(0), eps);
    return out;
  });
  m.def("exit_features", &exit_features);
  m.def("silu_mul", [](const at::Tensor& gate, const at::Tensor& up) {  // the MLP's activation, for tests
    TORCH_CHECK(gate.scalar_type() == at::kFloat && up.sizes() == gate.sizes(), "silu_mul: float32, one shape");
    const at::Tensor g = gate.contiguous(), u = up.contiguous();
    at::Tensor out = at::empty_like(g);
    silu_mul(g.data_ptr<float>(), u.data_ptr<float>(), out.data_ptr<float>(), g.numel());
    return out;
  });
  m.def("prompt_attention_available", &prompt_attention_available);
  m.def("prompt_attention", [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {  // for tests
    // q: the last S of the L = k.size(1) slots
    TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && k.dim() == 3 && k.scalar_type() == at::kHalf &&
                    v.sizes() == k.sizes() && v.scalar_type() == at::kHalf && k.size(1) >= q.size(1) &&
                    k.size(2) == q.size(2), "prompt_attention: q [heads, S, D] float32, k and v [kv_heads, L >= S, D] float16");
    const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
    const int64_t H = q.size(0), S = q.size(1), D = q.size(2), L = k.size(1);
    at::Tensor out = at::empty({S, H * D}, q.options());
    prompt_attention(qc.data_ptr<float>(), L - S, S, D, H, k.size(0), kc.data_ptr<at::Half>(), L * D,
                     vc.data_ptr<at::Half>(), L * D, out.data_ptr<float>(), H * D);
    return out;
  }, pybind11::call_guard<pybind11::gil_scoped_release>());
}
