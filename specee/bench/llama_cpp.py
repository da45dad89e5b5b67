"""llama.cpp as a peer in `specee bench speed` (optional: `pip install llama-cpp-python`).

It runs the same GGUF file natively (its own quantized kernels) on the same prompt token ids,
greedy, exactly `max_new_tokens` tokens, with as many threads as torch, in a process of its own:
in specee's process llama.cpp's OpenMP threads and torch's share one runtime, which stops spinning
between parallel regions once their threads outnumber the cores (SmolLM2 Q4_1, 2 threads, AMD EPYC:
72 decode tokens/s in specee's process, 143-172 alone). Plain decoding feeds one token per call (an
older llama-cpp-python build crashed on several tokens per call on the development CPU), so its
prompt processing is slower than it could be; decode tokens/s is the figure to compare. With
`lookup` > 0 it decodes with llama.cpp's own speculation, `LlamaPromptLookupDecoding` (n-gram
drafts from the prompt and output, that many per step), verified several tokens per call by
`Llama.generate` with greedy sampling. A worker that speculates evaluates a two-token batch before
it reports ready: llama.cpp 0.3.36 built with GCC 12 for an Intel Xeon with AMX crashes (SIGSEGV)
on batches of more than one token in its extra buffer types (AMX): GCC 12's `_tile_loadconfig` lets
the compiler drop the tile configuration's stores, and `ldtilecfg` faults (BENCHMARKS.md, session
25; benchmarks/llama_cpp_tilefix.h rebuilds it right). Such a worker is started again without
them (`use_extra_bufts=False`; plain decoding keeps them: one token a call runs) and `notes` says so.
"""
from __future__ import annotations

import multiprocessing
import sys
import time
from pathlib import Path

from .common import BenchError
from .timing import Run


class LlamaCppPeer:
    def __init__(self, gguf: Path, threads: int, context: int, lookup: int = 0):
        if Path(gguf).suffix.lower() != ".gguf":
            raise BenchError(f"--llama-cpp needs a .gguf target, got {gguf}")
        try:
            import llama_cpp  # noqa: F401 -- only whether it is there; it runs in the worker
        except ImportError:
            raise BenchError("--llama-cpp needs llama-cpp-python: pip install 'specee[llama-cpp]' "
                             "(it builds llama.cpp from source: about 15 minutes on a small CPU)") from None
        self.notes = ""
        try:
            status, message = self._start(gguf, threads, context, lookup, extra_buffers=True)
        except EOFError:  # the worker died in its batch probe
            self._conn.close()
            self.notes = "without its extra buffers (batches crash with them here)"
            print(f"specee: llama.cpp's worker crashed on a 2-token batch (exit {self._process.exitcode}); "
                  "running it without its extra buffer types (AMX, repack). A GCC 12 build on an AMX CPU "
                  "does this: benchmarks/llama_cpp_tilefix.h says how to rebuild it", file=sys.stderr, flush=True)
            try:
                status, message = self._start(gguf, threads, context, lookup, extra_buffers=False)
            except EOFError:
                status, message = "error", f"its worker died (exit {self._process.exitcode}) without them too"
        if status != "ready":
            self.close()
            raise BenchError(f"llama.cpp could not load {gguf}: {message}")

    def _start(self, gguf: Path, threads: int, context: int, lookup: int, extra_buffers: bool):
        """A worker process; its first message ("ready" or "error", why), or EOFError if it died first."""
        context_ = multiprocessing.get_context("spawn")
        self._conn, theirs = context_.Pipe()
        args = (theirs, str(gguf), threads, context, lookup, extra_buffers)
        self._process = context_.Process(target=_serve, args=args, name="specee-llama-cpp", daemon=True)
        self._process.start()
        theirs.close()  # so that a dead worker reads as EOFError here, not as a hang
        try:
            return self._conn.recv()
        except EOFError:
            self._process.join(10)
            raise

    def run(self, ids: list[int], max_new_tokens: int) -> Run:
        self._conn.send((list(ids), max_new_tokens))
        try:
            out, prefill, decode = self._conn.recv()
        except EOFError:
            self._process.join(10)
            raise BenchError(f"llama.cpp's worker died (exit {self._process.exitcode}) decoding "
                             f"{len(ids)} prompt tokens") from None
        return Run(len(out), prefill, decode, len(out) - 1, out)

    def close(self) -> None:
        if self._process.is_alive():
            self._conn.send(None)
            self._process.join(10)
        self._conn.close()


def _serve(conn, gguf: str, threads: int, context: int, lookup: int, extra_buffers: bool) -> None:
    """The worker process: load the model, then answer (ids, max_new_tokens) jobs until None."""
    try:
        decoder = _Decoder(gguf, threads, context, lookup, extra_buffers)
    except Exception as e:  # noqa: BLE001 -- reported to the parent as one line
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while (job := conn.recv()) is not None:
        conn.send(decoder.run(*job))


class _Decoder:
    def __init__(self, gguf: str, threads: int, context: int, lookup: int, extra_buffers: bool = True):
        import llama_cpp.llama_cpp as bindings  # where Llama() reads its default model parameters
        from llama_cpp import Llama

        draft = None
        if lookup:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup)
        self.lookup = lookup
        defaults = bindings.llama_model_default_params

        def model_params():
            params = defaults()
            params.use_extra_bufts = extra_buffers
            return params

        bindings.llama_model_default_params = model_params  # Llama() takes no such argument
        try:
            self.model = Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads, n_ctx=context,
                               n_batch=512 if lookup else 1, draft_model=draft, verbose=False)
        finally:
            bindings.llama_model_default_params = defaults
        if lookup:  # verification evaluates batches: crash here, before ready, if this build cannot
            self.model.eval([0, 0])
            self.model.reset()

    def _argmax(self) -> int:
        """The last evaluated token's logits, read in place (`Llama.scores` holds them only with
        logits_all, which would copy every row)."""
        import numpy as np

        logits = np.ctypeslib.as_array(self.model._ctx.get_logits(), shape=(self.model.n_vocab(),))
        return int(logits.argmax())

    def run(self, ids: list[int], max_new_tokens: int) -> tuple[list[int], float, float]:
        """The tokens, prefill seconds (to the first token) and decode seconds (the rest)."""
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
        return out, t1 - t0, time.perf_counter() - t1

    def _run_lookup(self, ids: list[int], max_new_tokens: int) -> tuple[list[int], float, float]:
        """`Llama.generate` (which drafts and verifies) greedy, until max_new_tokens (it stops at no EOS)."""
        out, t0, t1 = [], time.perf_counter(), None
        for token in self.model.generate(ids, top_k=1, temp=0.0, reset=True):
            t1 = t1 or time.perf_counter()
            out.append(token)
            if len(out) >= max_new_tokens:
                break
        return out, t1 - t0, time.perf_counter() - t1
