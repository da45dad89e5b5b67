// How decode_layer.cpp runs a layer's products: a linear in whichever form the runtime holds it
// (model/quant.py), and a step's rows split into runs, a long prompt's on AMX tiles. Included by
// decode_layer.cpp alone (ATen's whole API: at::linear and the int8 / int4 ops of float and PyTorch linears).
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <vector>

#include "amx_prompt.h"
#include "int4_matmul.h"
#include "kquant.h"

namespace specee_layer {

// A prompt (a causal segment) of at least this many rows runs its products (amx_prompt.cpp) and its
// attention (prompt_attention.cpp) on AMX tiles where the CPU has them: below it the weights'
// dequantization costs more than the tiles save (SmolLM2's products: 0.5-1.0x of the int8 kernel at
// 8-24 rows, 1.2-1.5x at 32, 1.7-1.8x at 64). Without AMX its attention runs in
// prompt_attention_avx2.cpp by the same rule (no other threshold measured). A request's own prompt length
// decides, so its tokens never depend on what shares its steps.
constexpr int64_t kTilePromptRows = 32;
inline bool long_prompt(bool causal, int64_t rows) { return causal && rows >= kTilePromptRows; }
inline bool prompt_on_tiles(bool causal, int64_t rows) { return long_prompt(causal, rows) && amx_enabled(); }

// Consecutive rows whose products run one way: a prompt's on AMX tiles (`tiles`), or the others'.
struct Run {
  int64_t first, count;
  bool tiles;
};

// A linear as the runtime holds it (model/quant.py): float weight, int8 per channel, or int4 packed.
struct Linear {
  // 0 float: w = weight; 1 int8: w = qweight, aux = bf16 scales; 2 int4 (PyTorch's kernel): w = packed,
  // aux = scales_and_zeros; 3 int4 (int4_matmul.cpp): w = packed, aux = scales; 4 GGUF K-quant blocks
  // (kquant.cpp): w = packed, aux = tiles
  int64_t kind;
  at::Tensor w, aux, bias;
  int64_t group;

  // N (int4 packed: N / 64 blocks; GGUF blocks: tiles of 16 outputs)
  int64_t outputs() const { return kind == 3 ? w.size(0) * 64 : kind == 4 ? aux.size(0) * 16 : w.size(0); }

  // whether a prompt's rows can run on AMX tiles: int4, or GGUF blocks in pairs of 16-output tiles
  bool tiled() const { return kind == 3 || (kind == 4 && aux.size(0) % 2 == 0); }

  // x [S, K] float32 -> [S, N] float32, into `out` if given (rows of a larger output)
  at::Tensor operator()(const at::Tensor& x, bool tiles = false, const at::Tensor& out = {}) const {
    at::Tensor y;
    if (kind == 3) {
      y = tiles ? int4_mm_amx(x, w, aux, out) : int4_mm(x, w, aux, out);
    } else if (kind == 4) {
      y = tiles ? kquant_mm_amx(x, w, aux, out) : kquant_mm(x, w, aux, out);
    } else {
      if (kind == 0)
        y = at::linear(x, w);
      else if (kind == 1)
        y = at::_weight_int8pack_mm(x.to(at::kBFloat16), w, aux).to(at::kFloat);
      else
        y = at::_weight_int4pack_mm_for_cpu(x.to(at::kBFloat16), w, group, aux).to(at::kFloat);
      if (out.defined()) y = out.copy_(y);
    }
    if (bias.numel()) y.add_(bias);
    return y;
  }

  // x: rows from .. from + S - 1 of the step, each run's rows the way the run says, into `out` [S, N]
  at::Tensor operator()(const at::Tensor& x, const std::vector<Run>& runs, int64_t from, const at::Tensor& out) const {
    if (runs.size() == 1) return (*this)(x, runs[0].tiles && tiled(), out);  // a decode step: no plan to make
    const int64_t S = x.size(0);
    std::vector<Run> parts;
    for (const Run& r : runs) {
      const int64_t a = std::max(r.first, from), b = std::min(r.first + r.count, from + S);
      const bool tiles = r.tiles && tiled();
      if (a >= b) continue;
      if (!parts.empty() && parts.back().tiles == tiles)  // a linear without tiles: one call for all
        parts.back().count += b - a;
      else
        parts.push_back({a - from, b - a, tiles});
    }
    if (parts.size() == 1) return (*this)(x, parts[0].tiles, out);
    for (const Run& p : parts) (*this)(x.narrow(0, p.first, p.count), p.tiles, out.narrow(0, p.first, p.count));
    return out;
  }
};

// The step's rows as runs: a segment's rows go to AMX tiles if it is a prompt of kTilePromptRows or more.
// Reused across a thread's calls (the engine thread's): a layer call allocates nothing for the plan.
inline const std::vector<Run>& row_runs(const std::vector<int64_t>& rows, const std::vector<bool>& causal) {
  thread_local std::vector<Run> runs;
  runs.clear();
  int64_t first = 0;
  for (size_t g = 0; g < rows.size(); first += rows[g], ++g) {
    const bool t = prompt_on_tiles(causal[g], rows[g]);
    if (!runs.empty() && runs.back().tiles == t)
      runs.back().count += rows[g];
    else
      runs.push_back({first, rows[g], t});
  }
  return runs;
}

}  // namespace specee_layer
