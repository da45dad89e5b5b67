// int4 weights x bfloat16 activations with AVX-512 BF16 dot products (int4_matmul.cpp).
#pragma once
#include <torch/extension.h>

bool int4_supported();
at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales);
