"""Prefill speed: one prompt of N tokens through every layer and the LM head's last row, specee
against llama.cpp on the same GGUF.

    PYTHONPATH=<checkout> python benchmarks/bench_prefill.py --model SmolLM2.gguf --tokens 128 512 [--llama-cpp]

specee runs `full_depth.prefill` in the main thread (the one that owns the model: engine/threads.py),
at --threads; llama.cpp (llama-cpp-python) evaluates the whole prompt in one call (n_batch 512) in a
process of its own, as `specee bench speed` runs it (in specee's process their OpenMP threads share
one runtime). Prompts are fixed token ids; the median of --repeats after a warm-up is printed, and
the rounds of the two alternate so a passing load hits both.
"""
from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specee.bench.report import cpu_name  # noqa: E402
from specee.engine.full_depth import prefill  # noqa: E402
from specee.model.llama import Transformer  # noqa: E402


def prompt(n: int) -> list[int]:
    return [(i * 7919) % 20000 + 100 for i in range(n)]


def llama_cpp_worker(conn, gguf: str, threads: int, context: int) -> None:
    """Load the GGUF, then answer token counts with prefill seconds until None."""
    from llama_cpp import Llama

    model = Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads, n_ctx=context, n_batch=512,
                  n_ubatch=512, verbose=False)
    conn.send("ready")
    while (n := conn.recv()) is not None:
        model.reset()
        t = time.perf_counter()
        model.eval(prompt(n))
        conn.send(time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a GGUF file (llama.cpp needs one) or checkpoint directory")
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--llama-cpp", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = Transformer.load(args.model, torch.device("cpu"), torch.float32, args.quantization)
    peer = None
    if args.llama_cpp:
        spawn = multiprocessing.get_context("spawn")
        peer, theirs = spawn.Pipe()
        context = max(args.tokens) + 16
        spawn.Process(target=llama_cpp_worker, args=(theirs, args.model, args.threads, context), daemon=True).start()
        peer.recv()
    print(f"# {cpu_name()}, {args.threads} threads, {Path(args.model).name}")
    for n in args.tokens:
        ids, ours, theirs = prompt(n), [], []
        with torch.inference_mode():
            for i in range(args.repeats + 1):
                t = time.perf_counter()
                model.logits(prefill(model, model.new_cache(1, n), [ids]))
                ours.append(time.perf_counter() - t)
                if peer is not None:
                    peer.send(n)
                    theirs.append(peer.recv())
        line = f"{n} tokens: specee {n / statistics.median(ours[1:]):.0f} tok/s"
        if theirs:
            line += f", llama.cpp {n / statistics.median(theirs[1:]):.0f} tok/s"
        print(line, flush=True)
    if peer is not None:
        peer.send(None)


if __name__ == "__main__":
    main()
