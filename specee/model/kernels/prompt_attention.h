// A prompt's rows attending together: on AMX-BF16 tiles (prompt_attention.cpp), or in AVX2 float32 where
// row_attention.cpp runs and AMX does not (prompt_attention_avx2.cpp).
#pragma once
#include <c10/util/Half.h>

#include <cstdint>

// Whether prompt_attention runs here: prompt tiles switched on (amx_prompt.h) and either AMX tiles enabled
// and a head size they take (a multiple of 32, at most 128), or the head sizes and levels of
// row_attention_available (AVX2 with F16C, or AVX-512: a multiple of 16, at most 256).
bool prompt_attention_available(int64_t head_dim);

// S rows of a causal prompt at slots start .. start + S - 1 (start > 0: a later part of a chunked
// prefill), each reading the slots up to its own, every head: q [heads][S][D] float32 (RoPE applied);
// keys and values of kv head g at K + g k_stride, V + g v_stride (rows of D float16, slot s at s D,
// slots 0 .. start + S - 1);
// out: row i, head h at out + i out_stride + h D. Grouped-query heads h share kv head h / (heads / kv_heads).
void prompt_attention(const float* q, int64_t start, int64_t S, int64_t D, int64_t heads, int64_t kv_heads,
                      const c10::Half* K, int64_t k_stride, const c10::Half* V, int64_t v_stride, float* out,
                      int64_t out_stride);

// The AVX2 path (prompt_attention's arguments)
void prompt_attention_avx2(const float* q, int64_t start, int64_t S, int64_t D, int64_t heads, int64_t kv_heads,
                           const c10::Half* K, int64_t k_stride, const c10::Half* V, int64_t v_stride, float* out,
                           int64_t out_stride);
