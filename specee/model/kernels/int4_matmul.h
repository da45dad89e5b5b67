// int4 weights x bfloat16 activations, AVX-512 BF16 / AVX2 / portable paths (int4_matmul.cpp).
#pragma once
#include <torch/extension.h>

int64_t int4_best_level();  // 0 portable, 1 avx2 (+FMA), 2 avx512 (F, BW, BF16): what this CPU runs
int64_t int4_level();       // the level int4_mm runs (the best unless set lower)
void int4_set_level(int64_t level);
at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales);
