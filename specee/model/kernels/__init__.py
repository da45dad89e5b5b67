"""Hand-written CPU code where PyTorch from Python loses, built once for this machine.

- `decode_layer.cpp`: a decoder layer over a step's ragged rows (every request's segment), its
  elementwise work in plain C++ loops, its products through the kernels below: at batch 1 the ~40
  ATen calls a layer makes from Python cost more than its products on a small model. `DecodeStack`
  runs a range of layers in one call (a call from Python cost ~8 us a layer); `rms_norm`, the final norm.
  `layer_linear.h`: how it runs a linear in each form the runtime holds, and which rows go to AMX
  tiles; `layer_workspace.h`: the layer's intermediate rows, kept between calls.
- `row_attention.cpp`: one row's attention over its own prefix (decode rows, chain rows, a
  prefill's rows) in AVX-512 or AVX2, so a row's numbers never depend on what shares its step; trees
  and masked segments go to ATen (and every row at the portable level). `activation.cpp`: the MLP's SiLU (the polynomial exp of
  `exp_nonpositive.h`). `greedy.cpp`: each row's first maximum, the greedy choice in one call; a quantized
  head's candidates (`top_k_rows`) and their exact logits written back (`rescore_rows`); an early-exit
  check's features (`exit_features`, with `rms_norm.h`, the layers' norm).
- `int4_matmul.cpp`: int4 weights times bf16 activations, the arithmetic of PyTorch's int4 kernel
  (which spends more time widening weights than reading them), with AVX-512 BF16 dot products
  (where the CPU has BF16; otherwise the AVX2 path), AVX2 FMA or plain loops: the best the CPU
  runs, or lower with SPECEE_CPU_LEVEL=avx2|portable (how the AVX2 path is tested on an AVX-512
  machine). The portable path says so on stderr.
- `int4_q8.cpp`: the same products with the activations quantized per block of 32 to int8
  (`quantize_q8.cpp`, for the GGUF blocks' products too) and integer dot products (llama.cpp's
  arithmetic; AVX-512 VNNI, AVX2 or plain loops): the default
  (DEFAULT_ACTIVATIONS: as close to float32 as llama.cpp or closer, and faster; BENCHMARKS.md);
  SPECEE_ACTIVATIONS=bf16 or `use_activations("bf16")` sends every int4 product to the bf16 path.
- `amx_prompt.cpp`: a prompt's products (a prefill of 32 rows or more; int4 and GGUF blocks) on
  AMX-BF16 tiles where the CPU has them (Intel Xeon 4th generation on): weights dequantized to bf16,
  activations rounded to bf16, float32 sums; 2-3x the int8 kernels on a prompt's rows.
  `prompt_attention.cpp`: that prompt's attention on the tiles too (bf16 queries, keys, values and
  probabilities, float32 sums; a chunked prefill's later part reads the earlier parts' keys from the
  cache with the same bits). `amx_tiles.h`: what the two share.
  `prompt_attention_avx2.cpp`: without AMX (the AVX2 level, or AVX-512 as on AMD Zen 4-5), such a
  prompt's attention in float32 (keys widened once per call, tiles of 6 query rows' heads x 16 keys;
  1.8x row_attention.cpp's speed on the 769-token bench prompt, AMD EPYC Zen 3). SPECEE_AMX=0 or
  `use_prompt_tiles(False)` keeps prompts on the int8 kernels and row_attention.cpp (so does the
  portable level).
- `kquant.cpp` (+ `kquant_tile.h`, and `kquant_avx2.h` for 3-4 rows of Q4_K / Q6_K / Q5_0 at AVX2, 8
  outputs a register; the blocks' codes and scales in `kquant_codes.h`, which
  amx_prompt.cpp reads them through too): GGUF Q4_K / Q6_K / Q5_0 / Q8_0 blocks run as stored (model/quant_gguf.py), with
  the same int8 activations and levels; under bf16 activations those tensors take the int4/int8 repacks.
  `kquant_repack.cpp`: the file's blocks rewritten into that layout at load.
  `q8_0_rows`: Q8_0 rows dequantized as gguf does (an embedding lookup, a head's rescored rows).
- `scratch.h`: a thread's buffers kept between calls, so steady decode steps allocate nothing for
  the products' quantized activations or the layers' intermediate rows.

Compiled on first use (torch.utils.cpp_extension: a C++ compiler and ninja), once per content of
these sources (build.py: checkouts with identical sources share one build): about 2 minutes on 2
cores of an Intel Xeon, 3-3.5 on an AMD EPYC Zen 3. Only decode_layer.cpp includes
<torch/extension.h> (36 s of a file's compile there); the others include ATen's tensor header (3 s),
which halved the build. Without a compiler,
or with SPECEE_CPU_KERNELS=0, `cpu_kernels()` is None: every layer runs in Python and
int4 goes through PyTorch's kernel.
"""
from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from types import ModuleType

import torch

from . import build

HERE = Path(__file__).parent
PREFIX = "specee_cpu_kernels"  # the build's name is this plus a hash of the sources and flags
# at::parallel_for is an OpenMP pragma in torch's OpenMP builds: without -fopenmp the int4 products ran
# on one thread whatever the thread count (2 threads, AMD EPYC: 0.15 ms a Qwen MLP product; with it 0.08)
CFLAGS = ["-O3", "-fopenmp"] if torch.backends.openmp.is_available() else ["-O3"]
LEVELS = ("portable", "avx2", "avx512")  # int4_matmul.cpp's paths, by their index there
LEVEL_ENV = "SPECEE_CPU_LEVEL"
ACTIVATIONS = ("bf16", "int8")  # what the int4 kernel rounds activations to, by its index there
ACTIVATIONS_ENV = "SPECEE_ACTIVATIONS"
DEFAULT_ACTIVATIONS = "int8"  # llama.cpp's agreement with float32 or better, not slower (BENCHMARKS.md)
AMX_ENV = "SPECEE_AMX"  # "0": prompts' products stay on the int8 kernels, their attention on row_attention.cpp


def sources(folder: Path = HERE) -> list[Path]:
    """The C++ files (sources and headers) the kernels are built from."""
    return sorted(folder.glob("*.cpp")) + sorted(folder.glob("*.h"))


def describe() -> str:
    """What the int4 products run as, for a speed measurement's key: the level, the activations and
    the build (a hash of the sources and flags, so a measurement of older kernels does not apply)."""
    kernels = int4_kernel()
    if kernels is None:
        return "no C++ kernels"
    activations = ACTIVATIONS[kernels.int4_activations()]
    level = kernels.int4_bf16_level() if activations == "bf16" else kernels.int4_level()
    tiles = ", prompts on AMX tiles" if kernels.amx_enabled() else ""
    return (f"{LEVELS[level]} kernels, {activations} activations{tiles}, "
            f"build {build.build_name(PREFIX, sources(), CFLAGS).rsplit('_', 1)[1]}")


def cpu_kernels() -> ModuleType | None:
    """The compiled module (`DecodeLayer`, `int4_mm`), or None where it cannot be used here."""
    if os.environ.get("SPECEE_CPU_KERNELS", "1") == "0":
        return None
    return _build()


def loaded_cpu_kernels() -> ModuleType | None:
    """`cpu_kernels()` where this process has loaded them already, else None: for helpers of the
    quantized path that must not start a build on a float model's behalf."""
    return cpu_kernels() if _build.cache_info().currsize else None


def int4_kernel() -> ModuleType | None:
    """The module whose `int4_mm` serves int4 linears (at the level `use_level` and the activations
    `use_activations` set), or None."""
    kernels = cpu_kernels()
    if kernels is not None:
        _level_from_env()
        _activations_from_env()
        _amx_from_env()
    return kernels


def use_level(name: str) -> str:
    """Run the int4 product at `name` (one of LEVELS, at most what this CPU runs); returns the
    level it ran at before."""
    kernels = _build()
    before = LEVELS[kernels.int4_level()]
    best = kernels.int4_best_level()
    if LEVELS.index(name) > best:
        raise ValueError(f"{LEVEL_ENV}={name}: this CPU runs at most {LEVELS[best]}")
    kernels.int4_set_level(LEVELS.index(name))
    return before


def use_activations(name: str) -> str:
    """Round the int4 products' activations to `name` (one of ACTIVATIONS) from now on, in every
    int4 linear of the process; returns the setting before."""
    if name not in ACTIVATIONS:
        raise ValueError(f"int4 activations {name!r}: choose one of {', '.join(ACTIVATIONS)}")
    _activations_from_env()  # first, so that it does not undo this choice later
    kernels = _build()
    before = ACTIVATIONS[kernels.int4_activations()]
    kernels.int4_set_activations(ACTIVATIONS.index(name))
    return before


def use_prompt_tiles(on: bool) -> bool:
    """Run a prompt's rows together (on): its products and attention on AMX tiles where the CPU has
    them, its attention in prompt_attention_avx2.cpp elsewhere (AVX2 or AVX-512); or (off) on the
    int8 kernels and row_attention.cpp. Returns the setting before."""
    _amx_from_env()  # first, so that it does not undo this choice later
    kernels = _build()
    before = kernels.prompt_tiles_on()
    kernels.amx_set_enabled(on)
    return before


@functools.cache
def _amx_from_env() -> None:
    """Apply SPECEE_AMX once."""
    wanted = os.environ.get(AMX_ENV, "1")
    if wanted not in ("0", "1"):
        raise ValueError(f"{AMX_ENV}={wanted!r}: 1 (prompts on AMX tiles where the CPU has them) or 0")
    _build().amx_set_enabled(wanted == "1")


@functools.cache
def _activations_from_env() -> None:
    """Apply SPECEE_ACTIVATIONS (or the default) once."""
    wanted = os.environ.get(ACTIVATIONS_ENV, "") or DEFAULT_ACTIVATIONS
    if wanted not in ACTIVATIONS:
        raise ValueError(f"{ACTIVATIONS_ENV}={wanted!r}: choose one of {', '.join(ACTIVATIONS)}")
    _build().int4_set_activations(ACTIVATIONS.index(wanted))


@functools.cache
def _level_from_env() -> None:
    """Apply SPECEE_CPU_LEVEL once (a level the CPU lacks is refused); note the portable path,
    several times slower than the vector ones (BENCHMARKS.md), wherever it runs."""
    wanted = os.environ.get(LEVEL_ENV, "")
    if wanted and wanted not in LEVELS:
        raise ValueError(f"{LEVEL_ENV}={wanted!r}: choose one of {', '.join(LEVELS)}")
    if wanted:
        use_level(wanted)
    if LEVELS[_build().int4_level()] == "portable":
        why = f"{LEVEL_ENV}=portable" if wanted else "this CPU has neither AVX-512 (F, BW, VNNI) nor AVX2 with FMA"
        print(f"specee: note: int4 products run the portable C++ path ({why}): several times slower than "
              "the AVX2 and AVX-512 ones", file=sys.stderr)


@functools.cache
def _build() -> ModuleType | None:
    try:
        return build.load(PREFIX, sources(), CFLAGS, what="CPU kernels", duration="; 2-4 minutes on 2 cores")
    except Exception as e:  # no compiler or ninja, a failed build: the Python layer serves
        first = (str(e).strip().splitlines() or [""])[0][:160]
        print(f"specee: CPU kernels unavailable ({type(e).__name__}: {first}); using the Python layer",
              file=sys.stderr)
        return None
