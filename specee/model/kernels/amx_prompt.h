// A prompt's products on AMX-BF16 tiles (amx_prompt.cpp): weights dequantized to bf16 once a call,
// activations rounded to bf16, float32 sums over all inputs.
#pragma once
#include <ATen/core/Tensor.h>

#include "int4_matmul.h"

bool amx_available();           // the CPU has AMX-BF16 and this process may use the tiles
bool prompt_tiles_on();         // prompts' rows computed together, not switched off (SPECEE_AMX=0 in Python)
bool amx_enabled();             // available, switched on, and the kernels at their AVX-512 level
void amx_set_enabled(bool on);  // switches prompt tiles (kernels/__init__.py: SPECEE_AMX, use_prompt_tiles)
// x [M, K] float32 times an int4 weight in int4_common.h's layout: float32 [M, N]
at::Tensor int4_mm_amx(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& out = {});
// x [M, K] float32 times GGUF blocks in kquant.cpp's layout (an even number of tiles): float32 [M, 16 T]
at::Tensor kquant_mm_amx(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& tiles,
                         const at::Tensor& out = {});
