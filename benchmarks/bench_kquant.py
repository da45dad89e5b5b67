"""Qwen-shaped products from a GGUF's own Q4_K / Q6_K / Q5_0 / Q8_0 tensors: the old repacks (Q4_K ->
int4 with a bf16 scale and zero per 32, int8 activations; the others -> int8 per channel, PyTorch's
kernel) against the blocks run as stored (model/kernels/kquant.cpp), in one process. Weights are
cycled over several layers of the same types so that each call reads them from memory, as decoding does.

    PYTHONPATH=. python benchmarks/bench_kquant.py --model <qwen2.5-coder-1.5b q4_k_m.gguf> --threads 2
    (or the 0.5B's: Q5_0 and Q8_0 at width 896)
"""
from __future__ import annotations

import argparse
import time

import torch

from specee.model.gguf import open_gguf
from specee.model.gguf_blocks import GGUFWeight
from specee.model.quant import linear_from_parts
from specee.model.quant_gguf import KQuantLinear

SHAPES = {"gate_up": ("ffn_gate", "ffn_up"), "down": ("ffn_down",), "qkv": ("attn_q", "attn_k", "attn_v"),
          "o": ("attn_output",)}


def old_linear(parts: list[GGUFWeight]):
    """What main built for these parts under "auto" (no K-quant kernel)."""
    fmt = "int8" if any(p.native_format() == "int8" for p in parts) else "int4"
    return linear_from_parts(parts, None, fmt, torch.device("cpu"), torch.float32)


def per_call_ms(kinds: list[list], rows: int, calls: int, repeats: int) -> list[float]:
    """Best ms per call of each kind of linears, the kinds timed in turn (a busy moment hits both)."""
    x = torch.randn(rows, kinds[0][0].in_features)
    best = [float("inf")] * len(kinds)
    for _ in range(repeats):
        for k, linears in enumerate(kinds):
            t = time.perf_counter()
            for i in range(calls):
                linears[i % len(linears)](x)
            best[k] = min(best[k], (time.perf_counter() - t) / calls * 1e3)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=6, help="layers cycled (weights beyond the caches)")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tensors = {t.name: t for t in open_gguf(args.model).tensors}
    print("| product (layers' types) | N x K | rows | old ms | as stored ms | old / stored |")
    print("|---|---|---|---|---|---|")
    blocks = sum(name.endswith(".attn_norm.weight") for name in tensors)
    for name, gguf_names in SHAPES.items():
        by_types: dict[tuple, list[int]] = {}  # Qwen Q4_K_M keeps ffn_down / attn_v Q6_K in half the layers
        for i in range(blocks):
            by_types.setdefault(tuple(tensors[f"blk.{i}.{g}.weight"].tensor_type.name for g in gguf_names), []).append(i)
        for layers in by_types.values():
            layers = layers[: args.layers]
            parts = [[GGUFWeight(tensors[f"blk.{i}.{g}.weight"].tensor_type, tensors[f"blk.{i}.{g}.weight"].data)
                      for g in gguf_names] for i in layers]
            new = [linear_from_parts(p, None, "auto", torch.device("cpu"), torch.float32) for p in parts]
            assert all(isinstance(x, KQuantLinear) for x in new)
            old = [old_linear(p) for p in parts]
            types = "+".join(sorted({p.qtype.name for p in parts[0]}))
            for rows in (1, 4):
                o, s = per_call_ms([old, new], rows, args.calls, args.repeats)
                print(f"| {name} ({types}) | {new[0].out_features} x {new[0].in_features} | {rows} | {o:.3f} | {s:.3f} | "
                      f"{o / s:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
