/* Forced into every file of a llama-cpp-python build with GCC 12 on a CPU with AMX: GCC 12's
   _tile_loadconfig declares that ldtilecfg reads 8 bytes, so the compiler may drop the stores to the
   rest of the 64-byte tile configuration, and ggml's AMX kernels then fault on any batch
   (BENCHMARKS.md, session 25). This declares all 64. Build (about 10 minutes):
     CMAKE_ARGS="-DGGML_NATIVE=ON -DCMAKE_CXX_FLAGS=-include$PWD/benchmarks/llama_cpp_tilefix.h \
       -DCMAKE_C_FLAGS=-include$PWD/benchmarks/llama_cpp_tilefix.h" \
       pip install --no-cache-dir --force-reinstall --no-deps --no-binary llama-cpp-python llama-cpp-python */
#if defined(__x86_64__)
#include <immintrin.h>
#define _tile_loadconfig(p) __asm__ volatile("ldtilecfg\t%X0" ::"m"(*(const char(*)[64])(p)))
#endif
