// A thread's buffer: 64-byte aligned (tile rows and vector loads meet cache lines), grown as needed and
// kept between calls. Why: a decode step's products and layers ran ~10 allocations a layer (an
// at::empty costs ~0.37 us here, a std::vector ~15-150 ns, and fresh pages cost a prompt ~5%), so
// steady decode steps now allocate nothing for their intermediates.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <cstdlib>

namespace specee_scratch {

struct Scratch {
  void* p = nullptr;
  int64_t bytes = 0;
  Scratch() = default;
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() { std::free(p); }
  template <class T>
  T* at_least(int64_t elems) {
    const int64_t want = (elems * static_cast<int64_t>(sizeof(T)) + 63) / 64 * 64;
    if (want > bytes) {
      std::free(p);
      p = std::aligned_alloc(64, want);
      TORCH_CHECK(p, "specee kernels: no memory for ", want, " bytes of scratch");
      bytes = want;
    }
    return static_cast<T*>(p);
  }
};

}  // namespace specee_scratch
