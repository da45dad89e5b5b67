// The VNNI int4 product (int4_matmul.cpp), shared by the decode layer and the Python binding.
#pragma once
#include <torch/extension.h>

#include <vector>

// Whether this CPU runs int4_mm (AVX-512 F, BW and VNNI).
bool int4_supported();
// x float/bf16 [M, K] -> (int8 [M, K], scale [M, K/32], sum of the rounded activations [M, K/32]).
std::vector<at::Tensor> int4_quantize_activations(const at::Tensor& x);
// x [M, K] times the packed int4 weight (see int4_matmul.cpp) -> float32 [M, N].
at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales);
