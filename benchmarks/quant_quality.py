"""What quantized arithmetic costs in quality, judged on the same positions for every path: specee's
weight formats and int4 activation modes, and llama.cpp on the same GGUF file, each against the
float32 model of that file (specee with quantization=None: gguf's dequantization).

    python benchmarks/quant_quality.py --model FILE.gguf [--paths auto/bf16 auto/int8 llama.cpp]
        [--text-tokens 4096] [--prompts 16] [--max-new-tokens 128] [--threads 2] [--json OUT]

Positions: WikiText-2 (test) in windows of --window tokens (the first two of each unscored context),
and Spec-Bench prompts (chat template) followed by the float32 model's greedy continuation; every
position's token is predicted from all before it (teacher forcing; specee in one pass per sequence,
llama.cpp one token per call: its decode arithmetic, since its batched path computes differently).
Per path: agreement = share of positions where its argmax is the float32 model's argmax (95% Wilson
interval), perplexity of the next token on each source, and, paired with llama.cpp on the same
positions, b (this path agrees, llama.cpp not) / c (the reverse) with the exact McNemar p-value.

Paths: QUANT[/ACTS][:KV] runs specee with quantization=QUANT (auto, int4 or int8; ACTS: the int4
kernel's activations, bf16 or int8, else kernels.DEFAULT_ACTIVATIONS; KV: kv_cache_dtype, float16 or
float32, else auto), `bf16` the whole model in bfloat16, `llama.cpp` llama-cpp-python
(run under --llama-python, a separate environment, as a subprocess of this script).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

LLAMA = "llama.cpp"


def llama_worker(spec_file: str, out_file: str) -> None:
    """Under llama-cpp-python's interpreter (numpy and llama_cpp only): each sequence one token per
    call; writes, per scored position, the argmax and the log-probability of the next token."""
    import numpy as np
    from llama_cpp import Llama

    spec = json.loads(Path(spec_file).read_text())
    m = Llama(model_path=spec["model"], logits_all=True, n_ctx=spec["n_ctx"], n_threads=spec["threads"],
              n_threads_batch=spec["threads"], n_batch=1, verbose=False)
    preds, logps = [], []
    for ids, first in spec["sequences"]:
        m.reset()
        for token in ids[:-1]:
            m.eval([token])
        z = np.asarray(m.scores[first - 1:len(ids) - 1], dtype=np.float64)  # row j predicts ids[j + 1]
        z -= z.max(-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        preds += z.argmax(-1).tolist()
        logps += logp[np.arange(len(z)), ids[first:]].tolist()
    np.savez(out_file, pred=np.array(preds), logp=np.array(logps))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a .gguf file (llama.cpp needs one) or a checkpoint directory")
    ap.add_argument("--paths", nargs="+", default=["auto/bf16", "auto/int8", LLAMA])
    ap.add_argument("--text-tokens", type=int, default=4096, help="scored WikiText-2 tokens")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=16, help="Spec-Bench prompts, round-robin over categories")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-python", default="/work/venvs/llamacpp/bin/python",
                    help="a Python with llama-cpp-python installed")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--llama-worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.llama_worker:
        return llama_worker(*args.llama_worker)
    if not args.model:
        ap.error("--model is required")
    run(args)


def run(args) -> None:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from specee.bench.report import environment, environment_md

    torch.set_num_threads(args.threads)
    env = environment()
    ref = load(args.model, "float32")
    sequences, sources = positions(ref, args)
    scores = {"float32": score_specee(ref, sequences)}
    del ref
    for path in args.paths:
        scores[path] = score_llama(args, sequences) if path == LLAMA else score_specee(load(args.model, path), sequences)
        print(f"scored {path}", file=sys.stderr, flush=True)
    rows = summarize(scores, sources)
    print(f"{args.model}: {len(sources)} positions ({sources.count('wikitext')} WikiText-2 in windows of "
          f"{args.window}, {sources.count('spec-bench')} Spec-Bench: {args.prompts} prompts x up to "
          f"{args.max_new_tokens} float32 greedy tokens), {args.threads} threads\n")
    print(table(rows))
    print("\n" + environment_md(env) + f"\n\nload average at the end: {os.getloadavg()}")
    if args.json:
        args.json.write_text(json.dumps({"model": str(args.model), "positions": len(sources), "rows": rows,
                                         "environment": env}, indent=1) + "\n")


def load(model: str, path: str):
    """specee for a path name: float32, bf16, or QUANT[/ACTS][:KV] (ACTS set for every int4 product)."""
    from specee import LLM
    from specee.model import kernels

    if path in ("float32", "bf16"):
        return LLM(model, dtype="float32" if path == "float32" else "bfloat16", quantization=None, progress=False)
    path, _, kv = path.partition(":")
    quant, _, acts = path.partition("/")
    kernels.use_activations(acts or kernels.DEFAULT_ACTIVATIONS)
    return LLM(model, dtype="float32", quantization=quant, progress=False, kv_cache_dtype=kv or "auto")


def positions(ref, args) -> tuple[list[tuple[list[int], int]], list[str]]:
    """(sequence ids, index of its first scored token) and each scored position's source."""
    from specee.bench.common import find_shared, fit_prompt, shared_file
    from specee.bench.quality import full_depth_continuations, perplexity_windows, read_text_tokens
    from specee.bench.tasks import load_prompts

    text_file = shared_file(find_shared(), "data", "text", "wikitext2_test.txt", what="WikiText-2")
    text = read_text_tokens(ref, text_file, args.text_tokens)
    sequences = [(ctx + cont, len(ctx)) for ctx, cont in perplexity_windows(ref, text, args.text_tokens, args.window)]
    sources = ["wikitext"] * sum(len(ids) - first for ids, first in sequences)
    prompts = [fit_prompt(ref, p.text, True, args.max_new_tokens)[0] for p in load_prompts(None, total=args.prompts)]
    for ids, cont in zip(prompts, full_depth_continuations(ref, prompts, args.max_new_tokens)):
        sequences.append((ids + cont, len(ids)))
        sources += ["spec-bench"] * len(cont)
    return sequences, sources


def score_specee(llm, sequences) -> dict[str, list]:
    import torch

    from specee.bench.quality import full_logprobs

    pred, logp = [], []
    with torch.inference_mode():
        for ids, first in sequences:
            lp, p = full_logprobs(llm, ids[:first], ids[first:])
            pred += p.tolist()
            logp += lp.double().tolist()
    return {"pred": pred, "logp": logp}


def score_llama(args, sequences) -> dict[str, list]:
    import numpy as np

    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.npz"
        spec.write_text(json.dumps({"model": str(Path(args.model).resolve()), "threads": args.threads,
                                    "n_ctx": max(len(ids) for ids, _ in sequences) + 8, "sequences": sequences}))
        subprocess.run([args.llama_python, __file__, "--llama-worker", str(spec), str(out)], check=True)
        data = np.load(out)
        return {"pred": data["pred"].tolist(), "logp": data["logp"].tolist()}


def summarize(scores: dict[str, dict], sources: list[str]) -> dict[str, dict]:
    from specee.bench.common import mcnemar, wilson

    truth = scores["float32"]["pred"]
    n = len(truth)
    agree = {p: [a == t for a, t in zip(s["pred"], truth)] for p, s in scores.items()}
    rows = {}
    for path, s in scores.items():
        assert len(s["pred"]) == n, f"{path}: {len(s['pred'])} positions, float32 {n}"
        right = sum(agree[path])
        row = {"agreement": right / n, "interval": wilson(right, n)}
        for src in ("wikitext", "spec-bench"):
            idx = [i for i, x in enumerate(sources) if x == src]
            row[f"agreement_{src}"] = sum(agree[path][i] for i in idx) / len(idx)
            row[f"perplexity_{src}"] = math.exp(-sum(s["logp"][i] for i in idx) / len(idx))
        if LLAMA in scores and path != LLAMA:
            b = sum(x and not y for x, y in zip(agree[path], agree[LLAMA]))
            c = sum(y and not x for x, y in zip(agree[path], agree[LLAMA]))
            row.update(vs_llama_cpp=(b - c) / n, b=b, c=c, p=mcnemar(b, c))
        rows[path] = row
    return rows


def table(rows: dict[str, dict]) -> str:
    out = ["| path | agreement with float32 (95% interval) | WikiText-2 / Spec-Bench | perplexity WikiText-2 / "
           "Spec-Bench | minus llama.cpp's agreement (b / c, McNemar p) |", "|---|---|---|---|---|"]
    for path, r in rows.items():
        paired = (f"{r['vs_llama_cpp']:+.4f} ({r['b']} / {r['c']}, p = {r['p']:.3g})" if "b" in r else "")
        out.append(f"| {path} | {r['agreement']:.4f} ({r['interval'][0]:.4f}-{r['interval'][1]:.4f}) | "
                   f"{r['agreement_wikitext']:.4f} / {r['agreement_spec-bench']:.4f} | "
                   f"{r['perplexity_wikitext']:.3f} / {r['perplexity_spec-bench']:.3f} | {paired} |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
