"""llama.cpp as a peer in `specee bench speed` (optional: `pip install llama-cpp-python`).

It runs the same GGUF file natively (its own quantized kernels) on the same prompt token ids,
greedy, exactly `max_new_tokens` tokens, with as many threads as torch. Tokens go in one per
call: in the llama-cpp-python build used here, evaluating several tokens in one call crashed on
the development CPU, so its prompt processing is slower than it could be; decode tokens/s (one
token per call either way) is the figure to compare.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from .common import BenchError
from .timing import Run


class LlamaCppPeer:
    def __init__(self, gguf: Path, threads: int, context: int):
        if Path(gguf).suffix.lower() != ".gguf":
            raise BenchError(f"--llama-cpp needs a .gguf target, got {gguf}")
        try:
            from llama_cpp import Llama
        except ImportError:
            raise BenchError("--llama-cpp needs llama-cpp-python: pip install 'specee[llama-cpp]' "
                             "(it builds llama.cpp from source: about 15 minutes on a small CPU)") from None
        self.model = Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=context,
                           n_batch=1, verbose=False)

    def _argmax(self) -> int:
        """The last evaluated token's logits, read in place (`Llama.scores` holds them only with
        logits_all, which would copy every row)."""
        logits = np.ctypeslib.as_array(self.model._ctx.get_logits(), shape=(self.model.n_vocab(),))
        return int(logits.argmax())

    def run(self, ids: list[int], max_new_tokens: int):
        m = self.model
        m.reset()
        t0 = time.perf_counter()
        for token in ids:
            m.eval([token])
        out = [self._argmax()]
        t1 = time.perf_counter()
        while len(out) < max_new_tokens:
            m.eval([out[-1]])
            out.append(self._argmax())
        t2 = time.perf_counter()
        return Run(len(out), t1 - t0, t2 - t1, len(out) - 1, out)
