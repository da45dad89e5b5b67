"""`specee bench speed | quality | oracle | sweep | serve`: the flags.

`add_bench_parser(subparsers)` registers the `bench` command on the main `specee` parser;
each benchmark sets `func(args) -> int`, one of `commands`' handlers. Errors are raised as `BenchError`
(a ValueError), which `specee`'s main turns into one `specee: error: ...` line. `main(argv)` runs the same
commands standalone: `python -m specee.bench.cli speed --count 1 ...`.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..cli.arg_types import (bank_dir, device_arg, draft_tokens, non_negative_float, non_negative_int,
                             positive_float, positive_int, positive_int_list, speculative_config_arg, speculative_k,
                             text_file)
from ..cli.args import DTYPE_CHOICES, add_quantization_arg, add_threads_arg
from ..cli.outputs import output_dir
from .commands import cmd_oracle, cmd_quality, cmd_serve_bench, cmd_speed, cmd_sweep


def add_common_args(p: argparse.ArgumentParser, *, bank: bool = True, ee_options: bool = True,
                    count: int = 1, max_new_tokens: int = 128) -> None:
    g = p.add_argument_group("models")
    g.add_argument("--model", metavar="PATH|ID", default=None,
                   help="target: a checkpoint directory, a .gguf file (or a directory holding one), or a hub id "
                        "(default: <shared>/models/ref-target-24L)")
    g.add_argument("--draft", metavar="PATH|ngram", default=None,
                   help="drafter: a draft model (directory or .gguf) or 'ngram' (default with the default --model: "
                        "<shared>/models/ref-draft-4L; required with --model)")
    if bank:
        g.add_argument("--bank", metavar="DIR", type=bank_dir, default=None,
                       help="predictor bank directory (default: calibrate once and cache under ~/.cache/specee, "
                            "or $SPECEE_CACHE)")
    g.add_argument("--k", type=speculative_k, default=4, help="speculative tokens per step (default: 4)")
    g.add_argument("--device", type=device_arg, default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    g.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                   help="compute dtype (default: auto = float32 on CPU, bfloat16 on CUDA)")
    add_quantization_arg(g)
    add_threads_arg(g)
    g.add_argument("--shared", metavar="DIR", default=None,
                   help="the shared models/data folder (default: ../shared next to the repository)")
    d = p.add_argument_group("prompts")
    d.add_argument("--prompts", metavar="FILE", default=None,
                   help="prompt file (.jsonl with 'turns'/'prompt'/'instruction', .json list, or .txt one per line; "
                        "default: <shared>/data/spec_bench/question.jsonl)")
    d.add_argument("--categories", metavar="A,B", default=None, help="only these categories (comma-separated)")
    d.add_argument("--count", type=positive_int, default=count,
                   help=f"prompts per category, first in file order (default: {count})")
    d.add_argument("--total", type=positive_int, default=None,
                   help="at most this many prompts in all, round-robin over the categories")
    d.add_argument("--chat", choices=("auto", "yes", "no"), default="auto",
                   help="wrap prompts in the chat template (default: auto = if the tokenizer has one)")
    d.add_argument("--max-new-tokens", type=positive_int, default=max_new_tokens,
                   help=f"tokens to generate per prompt (default: {max_new_tokens})")
    if ee_options:
        e = p.add_argument_group("early-exit options (EarlyExitConfig)")
        e.add_argument("--threshold-scale", type=positive_float, default=1.0, help="scale of the thresholds' distance from 1 "
                       "(> 1 = lower thresholds = more exits; default 1)")
        e.add_argument("--offline-size", type=non_negative_int, default=None,
                       help="offline schedule: the bank's first N ranked layers (default: the bank's set)")
        e.add_argument("--online-window", type=non_negative_int, default=4, help="online schedule window (default 4)")
        e.add_argument("--online-radius", type=non_negative_int, default=1, help="online schedule radius (default 1)")
        e.add_argument("--max-pending", type=positive_int, default=8,
                       help="most carried rows / unverified tokens before a forced full-depth step (default 8)")
        e.add_argument("--check-cost", type=non_negative_float, default=0.2, metavar="C",
                       help="a predictor check's cost in layers: layers whose exits save less per check are not "
                            "checked (default 0.2; 0 = check every scheduled layer)")
        e.add_argument("--draft-tokens", type=draft_tokens, default=0, metavar="N",
                       help="draft N tokens per pass with the early-exit drafter and verify them in the pass, "
                            "exits inside (speculative decoding + SpecEE; default 0: one token per pass)")
    o = p.add_argument_group("output")
    o.add_argument("--out", metavar="DIR", type=output_dir, default=None,
                   help="write report.json, report.md and PNG figures here")
    o.add_argument("--no-progress", action="store_true", help="no progress bars")


def add_speculative_bench_args(s: argparse.ArgumentParser) -> None:
    g = s.add_argument_group("speculative decoding (specee.speculative) and transformers' assisted generation")
    g.add_argument("--speculative-config", type=speculative_config_arg, action="append", default=[], metavar="JSON",
                   help='a speculative configuration to run, as in vLLM (repeatable): \'{"method": "ngram", '
                        '"num_speculative_tokens": 4}\'')
    g.add_argument("--hf-prompt-lookup", type=positive_int, default=None, metavar="N",
                   help="peer: transformers assisted generation with prompt lookup of N tokens")
    g.add_argument("--hf-assistant", metavar="DIR", default=None,
                   help="peer: transformers assisted generation with this assistant model")
    g.add_argument("--llama-cpp", action="store_true",
                   help="peer: llama.cpp on the same GGUF file (needs llama-cpp-python)")
    g.add_argument("--llama-cpp-lookup", type=non_negative_int, default=0, metavar="N",
                   help="peer: llama.cpp with its prompt-lookup speculation (LlamaPromptLookupDecoding), N tokens "
                        "per step (default 0: not run)")
    g.add_argument("--row-costs", action="store_true",
                   help="also time one target pass over 1, 2, 4, 8 rows with float32, bfloat16, int8 and int4 weights (verification cost)")


# ---- registration -----------------------------------------------------------------------------
def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Register `bench` (with speed / quality / oracle / sweep / serve) on a subparsers object."""
    p = subparsers.add_parser("bench",
                              help="benchmarks: speed, quality, oracle bound, threshold sweep, serving load",
                              description="Measure specee: decoding speed, quality under early exit, the oracle "
                                          "bound of a model + drafter, threshold/schedule sweeps, and the load a "
                                          "server takes (serve). Each prints a "
                                          "Markdown summary; --out DIR also writes report.json, report.md and PNGs.")
    sub = p.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)

    s = sub.add_parser("speed", help="tokens/s: transformers, full depth, early exit per KV policy, lossless",
                       description="Batch-1 greedy decoding speed on a prompt set; every configuration decodes "
                                   "exactly --max-new-tokens tokens (EOS ignored).")
    add_common_args(s, count=1, max_new_tokens=128)
    s.add_argument("--repeats", type=positive_int, default=3, help="timed runs per prompt; the median counts (default 3)")
    s.add_argument("--warmup", type=non_negative_int, default=1, help="untimed warm-up runs per configuration (default 1)")
    s.add_argument("--policies", default="skip,propagate,recompute", help="KV policies to run in lossy mode")
    s.add_argument("--no-lossless", action="store_true", help="skip lossless mode")
    s.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    s.add_argument("--oracle-layers", type=positive_float, default=None, metavar="X",
                   help="the oracle's mean layers run (from `specee bench oracle`): adds the speedup ceiling at "
                        "that depth to the cost breakdown")
    add_speculative_bench_args(s)
    s.set_defaults(func=cmd_speed)

    q = sub.add_parser("quality", help="agreement with full depth, perplexity, multiple-choice accuracy",
                       description="Quality of lossy early exit against the full model: teacher-forced agreement "
                                   "on a prompt set, WikiText-2 perplexity, and few-shot multiple choice "
                                   "(CommonsenseQA, SST-2, MMLU) with 95% Wilson intervals and McNemar tests.")
    add_common_args(q, count=1, max_new_tokens=128)
    q.add_argument("--policies", default="skip,propagate,recompute", help="KV policies to evaluate")
    q.add_argument("--parts", default="agreement,ppl,mc", help="which parts: agreement, ppl, mc")
    q.add_argument("--ppl-tokens", type=positive_int, default=2048, help="tokens scored for perplexity (default 2048)")
    q.add_argument("--ppl-window", type=positive_int, default=None,
                   help="perplexity window in tokens, at most the model's context (default 512, or the context "
                        "if shorter)")
    q.add_argument("--ppl-file", metavar="FILE", type=text_file, default=None,
                   help="text for perplexity (default: <shared>/data/text/wikitext2_test.txt)")
    q.add_argument("--mc-tasks", default="csqa,sst2,mmlu", help="multiple-choice tasks: csqa, sst2, mmlu")
    q.add_argument("--mc-items", type=positive_int, default=100, help="items per task (default 100)")
    q.add_argument("--shots", type=non_negative_int, default=3, help="few-shot exemplars (dropped if the context is short)")
    q.add_argument("--mmlu-subjects", default=None, help="MMLU subjects (default: all, round-robin)")
    q.set_defaults(func=cmd_quality)

    o = sub.add_parser("oracle", help="oracle exit layers and the speedup bound of a model + drafter",
                       description="Logit-lens oracle: the first layer whose argmax is and stays the final token, "
                                   "full depth where the drafter's top-k misses it; bound = L / mean.")
    add_common_args(o, bank=False, ee_options=False, count=3, max_new_tokens=128)
    o.add_argument("--draft-tokens", type=draft_tokens, default=0, metavar="N",
                   help="also bound exits inside speculative verification passes of N drafted tokens (default: 0)")
    o.set_defaults(func=cmd_oracle)

    w = sub.add_parser("sweep", help="threshold and schedule sweep: speedup vs agreement, Pareto plot",
                       description="Sweep threshold_scale, offline schedule size and online window; per point the "
                                   "speedup against full depth (same run) and teacher-forced agreement.")
    add_common_args(w, count=1, max_new_tokens=64)
    w.add_argument("--policy", default="recompute", help="KV policy (default: recompute)")
    w.add_argument("--scales", default="0.5,0.75,1,1.25,1.5,2", help="threshold_scale values")
    w.add_argument("--offline-sizes", default="0,2,4,8", help="offline schedule sizes ('bank' = the bank's own)")
    w.add_argument("--online-windows", default="0,1,2,4,8", help="online window sizes")
    w.add_argument("--grid", action="store_true", help="the full cross product instead of one-at-a-time sweeps")
    w.add_argument("--repeats", type=positive_int, default=1, help="timed runs per prompt and point (default 1)")
    w.add_argument("--warmup", type=non_negative_int, default=1, help="untimed warm-up runs (default 1)")
    w.set_defaults(func=cmd_sweep)

    v = sub.add_parser("serve", help="load on OpenAI-compatible servers: tokens/s, TTFT and ITL per concurrency",
                       description="Streamed chat completions against running servers (specee serve, "
                                   "python -m llama_cpp.server, vLLM's api_server) at each concurrency level.")
    v.add_argument("--server", action="append", metavar="NAME=URL",
                   help="a server to load (repeatable; default: specee=http://127.0.0.1:8000)")
    v.add_argument("--served-model", metavar="NAME", default=None,
                   help="model id to send (default: the server's first)")
    v.add_argument("--api-key", default=None, help="bearer key for the servers")
    v.add_argument("--concurrency", type=positive_int_list, default=[1, 4, 16, 64],
                   help="concurrency levels (default: 1,4,16,64)")
    v.add_argument("--requests", type=positive_int, default=None, help="requests per level (default: 2x, at least 8)")
    v.add_argument("--max-new-tokens", type=positive_int, default=128, help="tokens per answer (default 128)")
    v.add_argument("--no-ignore-eos", action="store_true", help="let answers end at end-of-sequence")
    v.add_argument("--min-tokens-for", action="append", default=[], metavar="NAME",
                   help="a server without vLLM's ignore_eos (llama-cpp-python's): send min_tokens = "
                        "--max-new-tokens instead (repeatable)")
    v.add_argument("--prompts", metavar="FILE", default=None, help="prompt file (default: Spec-Bench)")
    v.add_argument("--categories", metavar="A,B", default=None, help="only these categories")
    v.add_argument("--total", type=positive_int, default=64, help="prompts, round-robin over categories (default 64)")
    v.add_argument("--shared", metavar="DIR", default=None, help="the shared folder (default: ../shared)")
    v.add_argument("--out", metavar="DIR", type=output_dir, default=None,
                   help="write report.json, report.md and serve.png here")
    v.set_defaults(func=cmd_serve_bench)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry: `python -m specee.bench.cli [bench] speed ...`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] != "bench" and not argv[0].startswith("-"):
        argv = ["bench", *argv]
    parser = argparse.ArgumentParser(prog="specee")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    args._argv = ["specee", *argv]
    try:
        return args.func(args)
    except (ValueError, OSError) as e:
        print(f"specee: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
