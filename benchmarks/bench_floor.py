"""Batch-1 decode against the memory-bandwidth floor, each prompt paired with reads beside it.

A decode token streams every layer's weights and the LM head's ranker from memory; the floor is that
many bytes divided by what the machine reads. The development VMs' bandwidth drifts by a quarter
within minutes, so every prompt's decode sits between two read measurements in this one process
(`torch.sum` over 1 GiB on the same threads, best of three), and the fraction is taken per prompt
against the mean of the two reads beside it.

    python benchmarks/bench_floor.py --model ../shared/models/smollm2-135m-instruct --threads 2
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from specee import LLM, SamplingParams
from specee.bench.report import cpu_name
from specee.model.quant import kernel_spec

SHARED = Path(__file__).resolve().parents[2] / "shared"


def streamed_bytes(llm: LLM) -> int:
    """Bytes a decode token reads, counted from the tensors the kernels are called with
    (`quant.kernel_spec`): every layer's linears and norms, the final norm and the head's ranker (or
    the head when it has none). A RefinedHead's few refined rows and the embedding's one row are left out."""
    model = llm.model
    tensors = [model.final_norm] + [norm for layer in model.layers for norm in (layer.attn_norm, layer.mlp_norm)]
    for lin in model.decode_linears():
        tensors += kernel_spec(lin)[1:4]
    return sum(t.nbytes for t in tensors)


def read_gbps(buffer: torch.Tensor, repeats: int = 3) -> float:
    """Best of `repeats` full reads of `buffer` (GB/s)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - t0)
    return buffer.numel() * buffer.element_size() / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(SHARED / "models" / "smollm2-135m-instruct"))
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, quantization=args.quantization, threads=args.threads)
    per_token = streamed_bytes(llm)
    # 1 GiB of random values: pages of one value (torch.ones) may be merged by the host (KSM), and
    # then read from cache at 125 GB/s where random pages read 34 (AMD EPYC, 2 threads).
    buffer = torch.rand(2**28, dtype=torch.float32)
    from bench_engine import holdout_prompts  # same folder; the prompts no one tuned for
    prompts = holdout_prompts(args.prompts)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=8, ignore_eos=True), chat=True)  # warm-up
    print(f"# {cpu_name()}, {torch.get_num_threads()} threads, {per_token / 1e6:.1f} MB a token, "
          f"{len(prompts)} prompts x {args.max_tokens} tokens")
    print("prompt  tokens/s  streamed GB/s  read before/after GB/s  fraction")
    fractions, speeds, reads = [], [], [read_gbps(buffer)]
    for i, prompt in enumerate(prompts):
        out = llm.generate([prompt], params, chat=True)[0]
        reads.append(read_gbps(buffer))
        speed = out.stats.decode_tokens_per_second
        streamed = per_token * speed / 1e9
        fraction = streamed / ((reads[-2] + reads[-1]) / 2)
        speeds.append(speed)
        fractions.append(fraction)
        print(f"{i:6d}  {speed:8.1f}  {streamed:13.1f}  {reads[-2]:10.1f} / {reads[-1]:<10.1f}  {fraction:.3f}")
    print(f"median: {statistics.median(speeds):.1f} tokens/s, reads {statistics.median(reads):.1f} GB/s "
          f"(best {max(reads):.1f}), fraction {statistics.median(fractions):.3f} "
          f"(range {min(fractions):.3f}-{max(fractions):.3f})")


if __name__ == "__main__":
    main()
