"""Hand-written CPU code where PyTorch from Python loses, built once for this machine.

- `decode_layer.cpp`: a decoder layer for the rows of one sequence, its elementwise work in plain
  C++ loops and its products and attention through ATen (or the int4 product below): at batch 1
  the ~40 ATen calls a layer makes from Python cost more than its products on a small model.
- `int4_matmul.cpp`: int4 weights times bf16 activations with AVX-512 BF16 dot products, the
  arithmetic of PyTorch's int4 kernel, which spends more time widening weights than reading them.

Compiled on first use (torch.utils.cpp_extension: a C++ compiler and ninja; about 40 s), once per
content of these sources (build.py: checkouts with identical sources share one build). Without a
compiler, or with SPECEE_CPU_KERNELS=0, `cpu_kernels()` is None: every layer runs in Python and
int4 goes through PyTorch's kernel.
"""
from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from types import ModuleType

from . import build

HERE = Path(__file__).parent
PREFIX = "specee_cpu_kernels"  # the build's name is this plus a hash of the sources and flags
CFLAGS = ["-O3"]


def sources(folder: Path = HERE) -> list[Path]:
    """The C++ files (sources and headers) the kernels are built from."""
    return sorted(folder.glob("*.cpp")) + sorted(folder.glob("*.h"))


def cpu_kernels() -> ModuleType | None:
    """The compiled module (`DecodeLayer`, `int4_mm`), or None where it cannot be used here."""
    if os.environ.get("SPECEE_CPU_KERNELS", "1") == "0":
        return None
    return _build()


def int4_kernel() -> ModuleType | None:
    """The module when its AVX-512 BF16 int4 product runs on this CPU, else None."""
    kernels = cpu_kernels()
    return kernels if kernels is not None and kernels.int4_supported() else None


@functools.cache
def _build() -> ModuleType | None:
    try:
        return build.load(PREFIX, sources(), CFLAGS, what="CPU kernels (about 40 s)")
    except Exception as e:  # no compiler or ninja, a failed build: the Python layer serves
        first = (str(e).strip().splitlines() or [""])[0][:160]
        print(f"specee: CPU kernels unavailable ({type(e).__name__}: {first}); using the Python layer",
              file=sys.stderr)
        return None
