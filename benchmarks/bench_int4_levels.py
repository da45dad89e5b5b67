"""The int4 kernel's levels (AVX-512, AVX2, portable) and activations (bf16, int8) against PyTorch's
int4 kernel, as ratios inside one run: a product on SmolLM2-135M's linear shapes for 1/2/4/8 rows,
and whole decoding of a real model at each level.

    python benchmarks/bench_int4_levels.py [--rows 1 2 4 8] [--rounds 5] [--model SmolLM2.gguf] [--threads 1]
        [--activations bf16 int8]
    ATEN_CPU_CAPABILITY=avx2 python benchmarks/bench_int4_levels.py --levels   # PyTorch's AVX2 kernel alone

Products: each level x activations and PyTorch's `_weight_int4pack_mm_for_cpu` (bf16 activations,
as Int4Linear calls it) take turns within each round, each cycling through weight copies (--cold-mb
in all) so weights come from memory as in a model; the median of the rounds is printed with each
row count's cost relative to one row. Decoding: `LLM.generate` of --tokens greedy tokens on a few
prompts, the levels taking turns per round; decode tokens/s, median and range over rounds.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specee.model import kernels  # noqa: E402
from specee.model.quant import Int4Linear  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576),
          # Qwen2.5-1.5B's MLP (not run by default): weights far larger than the caches
          "qwen_gate_up": (17920, 1536), "qwen_down": (1536, 8960)}
DEFAULT_SHAPES = ["qkv", "o", "gate_up", "down", "head"]
PROMPTS = ["Explain in a few sentences why the sky is blue.", "Write a short poem about the sea.",
           "List three uses of a paperclip."]


def per_call_ms(fn, seconds: float = 0.05) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return 1e3 * (time.perf_counter() - t0) / n


def variants(args) -> list[tuple[str, str]]:
    """(level, activations) pairs this CPU runs, named "level/activations"."""
    best = kernels.int4_kernel().int4_best_level()
    return [(lv, a) for lv in args.levels if kernels.LEVELS.index(lv) <= best for a in args.activations]


def use(variant: tuple[str, str]) -> None:
    kernels.use_level(variant[0])
    kernels.use_activations(variant[1])


def products(args) -> None:
    print(f"\nint4 products, {torch.get_num_threads()} thread(s): ms per product, median of {args.rounds} rounds "
          f"(x rows: cost relative to 1 row)")
    for name in args.shapes:
        N, K = SHAPES[name]
        copies = max(2, int(args.cold_mb * 1e6 / (N * K / 2)))
        weights = [torch.randn(N, K) * K ** -0.5 for _ in range(copies)]
        ours = [Int4Linear.from_float(w) for w in weights]
        theirs = []
        if args.pytorch:
            os.environ["SPECEE_CPU_KERNELS"] = "0"  # Int4Linear packs for PyTorch's kernel
            theirs = [Int4Linear.from_float(w) for w in weights]
            del os.environ["SPECEE_CPU_KERNELS"]
        del weights
        kinds = [*variants(args), *(["pytorch"] if theirs else [])]
        samples = {(k, r): [] for k in kinds for r in args.rows}
        for _ in range(args.rounds):
            for k in kinds:
                if k != "pytorch":
                    use(k)
                lins = theirs if k == "pytorch" else ours
                for r in args.rows:
                    x = torch.randn(r, K)
                    i = iter(range(10 ** 9))
                    samples[(k, r)].append(per_call_ms(lambda: lins[next(i) % len(lins)](x)))
        print(f"{name} {K}->{N} ({copies} copies)")
        for k in kinds:
            ms = [statistics.median(samples[(k, r)]) for r in args.rows]
            ratios = " ".join(f"{m / ms[0]:.2f}x" for m in ms)
            print(f"  {k if k == 'pytorch' else '/'.join(k):14s}" + "".join(f"{m:9.3f}" for m in ms) + f"   rows {args.rows}: {ratios}")


def decoding(args) -> None:
    from specee import LLM, SamplingParams

    llm = LLM(args.model, quantization="auto", progress=False, threads=args.threads)
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    kinds = variants(args)
    rates = {k: [] for k in kinds}
    for _ in range(args.rounds):
        for k in kinds:
            use(k)
            outs = [llm.generate(p, params, chat=True)[0] for p in PROMPTS]
            rates[k].append(sum(o.stats.decode_tokens for o in outs) / sum(o.stats.decode_seconds for o in outs))
    best = statistics.median(rates[kinds[0]])
    print(f"\ndecoding {args.model}, {llm.threads.choice.threads} thread(s), {len(PROMPTS)} prompts x {args.tokens} "
          f"tokens, {args.rounds} rounds: decode tokens/s")
    for k in kinds:
        med = statistics.median(rates[k])
        print(f"  {'/'.join(k):14s} {med:7.1f} (range {min(rates[k]):.1f}-{max(rates[k]):.1f})  "
              f"{med / best:.2f}x of {'/'.join(kinds[0])}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", nargs="*", default=list(reversed(kernels.LEVELS)), choices=kernels.LEVELS)
    ap.add_argument("--activations", nargs="+", default=list(kernels.ACTIVATIONS), choices=kernels.ACTIVATIONS)
    ap.add_argument("--no-pytorch", dest="pytorch", action="store_false", help="skip PyTorch's int4 kernel")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--shapes", nargs="*", default=DEFAULT_SHAPES, choices=list(SHAPES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cold-mb", type=float, default=64, help="MB of int4 weight copies cycled through (default 64)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default=None, help="also time decoding of this model (a .gguf) at each level")
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    with torch.inference_mode():
        if args.shapes:
            products(args)
    if args.model:
        decoding(args)


if __name__ == "__main__":
    main()
