// What the AMX kernels share (amx_prompt.cpp: a prompt's products; prompt_attention.cpp: its
// attention): whether they are built, the instruction sets they are compiled for, the tile
// configuration.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <cstdlib>

#include "int4_common.h"
#include "scratch.h"

#if defined(SPECEE_X86) && (defined(__clang__) ? __clang_major__ >= 12 : __GNUC__ >= 11)
#define SPECEE_AMX_BUILT 1
// (VNNI too: int4_common.h's helpers are compiled for it, and every CPU with AMX has it)
#define SPECEE_AMX_BF16 __attribute__((target("avx512f,avx512bw,avx512vnni,avx512bf16,amx-tile,amx-bf16")))

namespace specee_amx {

// rows[i] rows of 64 bytes in tile i (0: unused)
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

SPECEE_AMX_BF16 inline void load_config(const TileConfig& c) {
  // GCC 12's _tile_loadconfig tells the compiler it reads 8 bytes, which lets it drop stores to the rest
  __asm__ volatile("ldtilecfg %0" ::"m"(c));
}


}  // namespace specee_amx
#endif
