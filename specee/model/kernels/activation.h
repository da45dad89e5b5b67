// The MLP's activation, SiLU(gate) * up, vectorized where the CPU allows (activation.cpp).
#pragma once
#include <cstdint>

// out[i] = gate[i] / (1 + e^-gate[i]) * up[i] for i < n (out may alias neither input).
void silu_mul(const float* gate, const float* up, float* out, int64_t n);
