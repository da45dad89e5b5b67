// int4 weights x activations rounded to bf16 (int4_matmul.cpp) or quantized per block of 32 to int8
// (int4_q8.cpp, llama.cpp's Q4_1 x Q8_1 arithmetic); AVX-512 / AVX2 / portable paths.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <cstring>

int64_t int4_best_level();  // 0 portable, 1 avx2 (+FMA), 2 avx512 (F, BW, VNNI): what this CPU runs
int64_t int4_level();       // the level int4_mm runs (the best unless set lower)
int64_t int4_bf16_level();  // the level of the bf16-activation kernel: int4_level, or avx2 where avx512 lacks BF16
// whether the kernels run their AVX-512 level (SPECEE_CPU_LEVEL may force a lower one): the other
// AVX-512 code (row attention, SiLU, greedy, half rounding) follows it, so one setting tests every fallback
inline bool avx512_level() { return int4_level() == 2; }
inline bool avx2_level() { return int4_level() == 1; }  // (as lowered by SPECEE_CPU_LEVEL too)
void int4_set_level(int64_t level);
int64_t int4_activations();  // 0: bf16, 1: int8 (Python sets its default, kernels/__init__.py)
void int4_set_activations(int64_t mode);
bool int4_prefetch();  // whether int4 products of 1-3 rows prefetch their weights (int4_common.h)
void int4_set_prefetch(bool on);
at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& out = {});

// Where a product writes its float32 [M, N]: `out` when given (rows of a larger output: a step whose
// rows run two ways writes each part in place, not through a copy), else a new tensor; zeroed when
// the kernel adds into it.
inline at::Tensor product_output(const at::Tensor& out, int64_t M, int64_t N, bool zeroed) {
  if (!out.defined()) return zeroed ? at::zeros({M, N}, at::kFloat) : at::empty({M, N}, at::kFloat);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == M && out.size(1) == N &&
                  out.is_contiguous(), "a product's out: float32 [M, N], contiguous");
  if (zeroed) std::memset(out.data_ptr<float>(), 0, M * N * sizeof(float));  // (no ATen dispatch per product)
  return out;
}
