// int4 weights x activations rounded to bf16 (int4_matmul.cpp) or quantized per block of 32 to int8
// (int4_q8.cpp, llama.cpp's Q4_1 x Q8_1 arithmetic); AVX-512 / AVX2 / portable paths.
#pragma once
#include <torch/extension.h>

int64_t int4_best_level();  // 0 portable, 1 avx2 (+FMA), 2 avx512 (F, BW, VNNI): what this CPU runs
int64_t int4_level();       // the level int4_mm runs (the best unless set lower)
int64_t int4_bf16_level();  // the level of the bf16-activation kernel: int4_level, or avx2 where avx512 lacks BF16
// whether the kernels run their AVX-512 level (SPECEE_CPU_LEVEL may force a lower one): the other
// AVX-512 code (row attention, SiLU, greedy, half rounding) follows it, so one setting tests every fallback
inline bool avx512_level() { return int4_level() == 2; }
void int4_set_level(int64_t level);
int64_t int4_activations();  // 0: bf16, 1: int8 (Python sets its default, kernels/__init__.py)
void int4_set_activations(int64_t mode);
bool int4_prefetch();  // whether int4 products of 1-3 rows prefetch their weights (int4_common.h)
void int4_set_prefetch(bool on);
at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales);
