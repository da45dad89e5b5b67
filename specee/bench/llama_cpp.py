"""llama.cpp as a peer in `specee bench speed` (optional: `pip install llama-cpp-python`).

It runs the same GGUF file natively (its own quantized kernels) on the same prompt token ids,
greedy, exactly `max_new_tokens` tokens, with as many threads as torch. Plain decoding feeds one
token per call (an older llama-cpp-python build crashed on several tokens per call on the
development CPU), so its prompt processing is slower than it could be; decode tokens/s is the
figure to compare. With `lookup` > 0 it decodes with llama.cpp's own speculation,
`LlamaPromptLookupDecoding` (n-gram drafts from the prompt and output, that many per step),
verified several tokens per call by `Llama.generate` with greedy sampling.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from .common import BenchError
from .timing import Run


class LlamaCppPeer:
    def __init__(self, gguf: Path, threads: int, context: int, lookup: int = 0):
        if Path(gguf).suffix.lower() != ".gguf":
            raise BenchError(f"--llama-cpp needs a .gguf target, got {gguf}")
        try:
            from llama_cpp import Llama
        except ImportError:
            raise BenchError("--llama-cpp needs llama-cpp-python: pip install 'specee[llama-cpp]' "
                             "(it builds llama.cpp from source: about 15 minutes on a small CPU)") from None
        draft = None
        if lookup:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup)
        self.lookup = lookup
        self.model = Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=context,
                           n_batch=512 if lookup else 1, draft_model=draft, verbose=False)

    def _argmax(self) -> int:
        """The last evaluated token's logits, read in place (`Llama.scores` holds them only with
        logits_all, which would copy every row)."""
        logits = np.ctypeslib.as_array(self.model._ctx.get_logits(), shape=(self.model.n_vocab(),))
        return int(logits.argmax())

    def run(self, ids: list[int], max_new_tokens: int):
        m = self.model
        m.reset()  # also keeps `generate` from reusing the last run's cached prompt
        if self.lookup:
            return self._run_lookup(ids, max_new_tokens)
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

    def _run_lookup(self, ids: list[int], max_new_tokens: int):
        """`Llama.generate` (which drafts and verifies) greedy, until max_new_tokens (it stops at no EOS)."""
        out, t0, t1 = [], time.perf_counter(), None
        for token in self.model.generate(ids, top_k=1, temp=0.0, reset=True):
            t1 = t1 or time.perf_counter()
            out.append(token)
            if len(out) >= max_new_tokens:
                break
        t2 = time.perf_counter()
        return Run(len(out), t1 - t0, t2 - t1, len(out) - 1, out)
