"""Hand-written CPU code where PyTorch from Python loses: the one-token decoder layer.

`decode_layer.cpp` runs a decoder layer for one token (batch 1, one row, no mask) with its
elementwise work in plain C++ loops and its products and attention through the same ATen kernels
as model/llama.py. It is compiled on first use for this machine (torch.utils.cpp_extension: a
C++ compiler and ninja; about 30 s, cached by torch). Without a compiler, or with
SPECEE_CPU_KERNELS=0, `decode_layer_kernel()` is None and every layer runs in Python.
"""
from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from types import ModuleType

SOURCE = Path(__file__).with_name("decode_layer.cpp")
NAME = "specee_decode_layer_v2"  # a new name for a changed ABI: torch rebuilds on source changes anyway


def decode_layer_kernel() -> ModuleType | None:
    """The compiled module (its `DecodeLayer` class), or None where it cannot be used here."""
    if os.environ.get("SPECEE_CPU_KERNELS", "1") == "0":
        return None
    return _build()


@functools.cache
def _build() -> ModuleType | None:
    try:
        from torch.utils import cpp_extension

        built = Path(cpp_extension._get_build_directory(NAME, False)) / f"{NAME}.so"
        if not built.exists():
            print("specee: building the CPU decode layer for this machine (once, about 30 s)", file=sys.stderr)
        return cpp_extension.load(NAME, [str(SOURCE)], extra_cflags=["-O3"], verbose=False)
    except Exception as e:  # no compiler or ninja, a failed build: the Python layer serves
        first = (str(e).strip().splitlines() or [""])[0][:160]
        print(f"specee: CPU decode layer unavailable ({type(e).__name__}: {first}); using the Python layer",
              file=sys.stderr)
        return None
