// One query row's attention over its own prefix of the cache, AVX-512 or AVX2 (row_attention.cpp).
#pragma once
#include <c10/util/Half.h>

#include <cstdint>

// The int4 kernels at their AVX2 level (not forced down to portable), on a CPU with F16C (every AVX2 one
// but a few early VIA)
bool avx2_f16c_level();

// Whether row_attention runs here: the int4 kernels at their AVX-512 level, or at their AVX2 level on a
// CPU with F16C (SPECEE_CPU_LEVEL=portable forces ATen for every row), and a head size it takes.
bool row_attention_available(int64_t head_dim);

// q: heads x head_dim floats, head h at q + h * q_stride; keys and values of kv head g at K + g * k_stride
// (rows of head_dim, contiguous), `len` of them; out: heads x head_dim, contiguous. Grouped-query heads
// h share kv head h / (heads / kv_heads). The cache holds float32, or float16: half the bytes, and at 8
// requests attention was bound by reading them (SmolLM2, 2 AMD EPYC cores: ~32 of ~40 GB/s).
void row_attention(const float* q, int64_t q_stride, const float* K, int64_t k_stride, const float* V,
                   int64_t v_stride, int64_t len, int64_t head_dim, int64_t heads, int64_t kv_heads, float* out);
void row_attention(const float* q, int64_t q_stride, const c10::Half* K, int64_t k_stride, const c10::Half* V,
                   int64_t v_stride, int64_t len, int64_t head_dim, int64_t heads, int64_t kv_heads, float* out);

// x rounded to float16 (to nearest even, as torch's .half()): a K/V row written to a float16 cache.
void to_half(const float* x, c10::Half* out, int64_t n);
