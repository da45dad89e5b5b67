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
`Llama.generate` with greedy sampling. `run_batch` decodes several prompts together, as llama.cpp's own
batched decoding does (`llama-batched-bench`, its server's slots): one sequence each in a KV cache split
per sequence (its default), their prompts in batches of up to 512 tokens, then one token per sequence
per `llama_decode` (`benchmarks/bench_engine.py --llama-cpp`). A worker that speculates evaluates a two-token batch before
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


def check_target(gguf: Path, flag: str) -> None:
    """Refuse a target llama.cpp cannot run, naming the flag that asked for it (`specee bench speed` checks
    before the target loads)."""
    if Path(gguf).suffix.lower() != ".gguf":
        raise BenchError(f"{flag} needs a .gguf target, got {gguf}")


class LlamaCppPeer:
    def __init__(self, gguf: Path, threads: int, context: int, lookup: int = 0):
        check_target(gguf, "--llama-cpp-lookup" if lookup else "--llama-cpp")
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
        out, prefill, decode = self._ask(("one", list(ids), max_new_tokens), f"{len(ids)} prompt tokens")
        return Run(len(out), prefill, decode, len(out) - 1, out)

    def run_batch(self, prompts: list[list[int]], max_new_tokens: int) -> tuple[list[list[int]], float, float]:
        """Greedy tokens of each prompt decoded together, the prefill's seconds (to every first token)
        and the decode's (the rest)."""
        job = ("batch", [list(ids) for ids in prompts], max_new_tokens)
        return self._ask(job, f"{len(prompts)} prompts together")

    def _ask(self, job: tuple, what: str):
        self._conn.send(job)
        try:
            return self._conn.recv()
        except EOFError:
            self._process.join(10)
            raise BenchError(f"llama.cpp's worker died (exit {self._process.exitcode}) decoding {what}") from None

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
    batches = None
    while (job := conn.recv()) is not None:
        kind, *args = job
        if kind == "batch":
            batches = batches or _BatchDecoder(decoder.model.model, threads)
            conn.send(batches.run(*args))
        else:
            conn.send(decoder.run(*args))


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


class _BatchDecoder:
    """llama.cpp's batched decoding through its C API: a context of its own over the loaded model,
    made again when a job needs more sequences or positions."""

    def __init__(self, model, threads: int):
        self.model, self.threads, self.ctx, self.shape = model, threads, None, (0, 0)

    def _context(self, seqs: int, positions: int):
        import llama_cpp as api

        if self.ctx is not None and seqs <= self.shape[0] and positions <= self.shape[1]:
            api.llama_memory_clear(api.llama_get_memory(self.ctx), True)
            return api
        if self.ctx is not None:
            api.llama_free(self.ctx)
            api.llama_batch_free(self.batch)
        positions = -(-positions // 256) * 256  # llama.cpp pads a context to 256 positions
        params = api.llama_context_default_params()
        params.n_seq_max, params.n_ctx = seqs, seqs * positions  # split per sequence: positions each
        params.n_batch = params.n_ubatch = 512
        params.n_threads = params.n_threads_batch = self.threads
        self.ctx = api.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp made no context for {seqs} sequences of {positions} positions")
        self.batch, self.shape = api.llama_batch_init(512, 0, 1), (seqs, positions)
        self.vocab = api.llama_vocab_n_tokens(api.llama_model_get_vocab(self.model))
        return api

    def _decode(self, api, rows: list[tuple[int, int, int, bool]]):
        """One llama_decode of (token, position, sequence, wants logits) rows: the argmax of each
        row that wants logits, in order."""
        import numpy as np

        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.seq_id[i][0], b.logits[i] = token, pos, 1, seq, logits
        b.n_tokens = len(rows)
        if api.llama_decode(self.ctx, b) != 0:
            raise RuntimeError(f"llama_decode failed on {len(rows)} rows")
        wanted = sum(r[3] for r in rows)
        logits = np.ctypeslib.as_array(api.llama_get_logits(self.ctx), shape=(wanted, self.vocab))
        return logits.argmax(axis=1).tolist()

    def run(self, prompts: list[list[int]], max_new_tokens: int) -> tuple[list[list[int]], float, float]:
        api = self._context(len(prompts), max(map(len, prompts)) + max_new_tokens)
        t0 = time.perf_counter()
        rows = [(token, pos, seq, pos == len(ids) - 1) for seq, ids in enumerate(prompts) for pos, token in enumerate(ids)]
        firsts = []
        for i in range(0, len(rows), 512):
            firsts += self._decode(api, rows[i:i + 512])
        outs = [[token] for token in firsts]  # prompts end in order, so their first tokens come in order
        t1 = time.perf_counter()
        for _ in range(max_new_tokens - 1):
            step = [(out[-1], len(ids) + len(out) - 1, seq, True) for seq, (ids, out) in enumerate(zip(prompts, outs))]
            for out, token in zip(outs, self._decode(api, step)):
                out.append(token)
        return outs, t1 - t0, time.perf_counter() - t1
