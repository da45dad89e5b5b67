"""What quantized weights cost in quality: each weight format of one checkpoint against its float32
model (for a GGUF file: gguf's dequantization of the same file).

    python benchmarks/bench_quant_quality.py --model SmolLM2-135M-Instruct.Q4_1.gguf --modes auto int4 int8 bf16

- agreement: the float32 model's greedy continuations of Spec-Bench prompts, teacher-forced
  through each format; the share of positions where its argmax is the float32 model's token.
- perplexity on the start of WikiText-2 (the `specee bench quality` text), in windows.

`bf16` is the whole model in bfloat16 (float weights); the others run `quantization=MODE` with
float32 activations cast to bfloat16 around each product.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specee import LLM  # noqa: E402
from specee.bench.common import find_shared, fit_prompt, shared_file  # noqa: E402
from specee.bench.tasks import load_prompts  # noqa: E402
from specee.bench.quality import (full_depth_continuations, full_logprobs, perplexity_full,  # noqa: E402
                                  perplexity_windows, read_text_tokens)

MODES = ("auto", "int4", "int8", "bf16")


def load(model: str, mode: str) -> LLM:
    if mode == "float32":
        return LLM(model, dtype="float32", progress=False, quantization=None)
    if mode == "bf16":
        return LLM(model, dtype="bfloat16", progress=False, quantization=None)
    return LLM(model, dtype="float32", quantization=mode, progress=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--prompts", type=int, default=8, help="Spec-Bench prompts, round-robin over categories")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--ppl-tokens", type=int, default=4096)
    ap.add_argument("--ppl-window", type=int, default=512)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    ref = load(args.model, "float32")
    prompts = load_prompts(None, total=args.prompts)
    ids = [fit_prompt(ref, p.text, True, args.max_new_tokens)[0] for p in prompts]
    continuations = full_depth_continuations(ref, ids, args.max_new_tokens)
    text = read_text_tokens(ref, shared_file(find_shared(), "data", "text", "wikitext2_test.txt", what="WikiText-2"),
                            args.ppl_tokens)
    windows = perplexity_windows(ref, text, args.ppl_tokens, args.ppl_window)
    rows = {"float32": {"agreement": 1.0, **perplexity_full(ref, windows),
                        "resident_mib": round(ref.model.weight_bytes() / 2**20, 1)}}
    del ref
    for mode in args.modes:
        llm = load(args.model, mode)
        right = total = 0
        with torch.inference_mode():
            for p, cont in zip(ids, continuations):
                _, pred = full_logprobs(llm, p, cont)
                right += int((pred == torch.tensor(cont)).sum())
                total += len(cont)
        rows[mode] = {"agreement": right / total, **perplexity_full(llm, windows),
                      "resident_mib": round(llm.model.weight_bytes() / 2**20, 1)}
        del llm
    print(f"{args.model}: {len(ids)} prompts x {args.max_new_tokens} tokens, perplexity over "
          f"{rows['float32']['tokens']} WikiText-2 tokens\n")
    print("| weights | teacher-forced agreement with float32 | perplexity | resident MiB |")
    print("|---|---|---|---|")
    for mode, r in rows.items():
        print(f"| {mode} | {r['agreement']:.3f} | {r['perplexity']:.3f} | {r['resident_mib']} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
