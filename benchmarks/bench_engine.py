"""Aggregate decode throughput of the engine at several concurrencies, per decoding mode.

For each mode (full depth, speculative configs) and each concurrency c, the same prompts are
served c at a time (`LLM.generate` over c prompts, greedy, EOS ignored so every request makes
max_tokens) and one at a time; it reports generated tokens per second of wall time, and each
ratio within this one run. It uses only `LLM(...)` and `generate`, so it runs on older commits
too (to compare a change against its parent on the same machine). The modes take turns at each
concurrency (forward, then backward at the next, the order flipped each round), `--rounds N`
times, each keeping its decoding (a speculation gate learns from turn to turn, as a long-lived
LLM's does); each figure is the median of its N, and a mode's ratio to full depth the median of
its N ratios within a turn: the development VMs' speed drifts by a quarter within minutes, which a
mode's whole pass would take for its own. So too a concurrency's ratio to the first (its "x"): the
median of the rounds' ratios. `--llama-cpp` adds llama.cpp on the same GGUF file as one more mode
(its own batched decoding, the same token ids, greedy, the same threads: `specee.bench.llama_cpp`), and
every mode reports how many prompts got the same tokens at each concurrency as at the first.

    python benchmarks/bench_engine.py --model ../shared/models/smollm2-135m-instruct --prompts 8 \
        --concurrency 1 4 8 --speculative-config '{"method": "ngram", "num_speculative_tokens": 3}' \
        --early-exit '{"draft": "ngram", "mode": "lossless"}' --rounds 3
"""
from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time
from pathlib import Path

import torch

from specee import LLM, SamplingParams
from specee.bench.report import cpu_name
from specee.exit.config import EarlyExitConfig

HOLDOUT = Path(__file__).resolve().parents[2] / "shared" / "data" / "specee_bench"


def holdout_prompts(n: int) -> list[str]:
    """Prompts from the SpecEE paper's speed sets (none of them used to tune anything here), mixed."""
    sets = sorted(HOLDOUT.glob("*_question.jsonl"))
    if not sets:
        raise SystemExit(f"no prompt sets (*_question.jsonl) in {HOLDOUT}: the shared data sits beside the repository")
    rows = [[json.loads(line)["turns"][0] for line in f.open()] for f in sets]
    mixed = [r[i] for i in range(max(map(len, rows))) for r in rows if i < len(r)]
    return mixed[:n]


def median_ratio(a: list[float], b: list[float]) -> float:
    """The median of the turns' ratios a / b (each pair measured minutes apart at most)."""
    return round(statistics.median(x / y for x, y in zip(a, b)), 3)


def serve(group, count: int, concurrency: int) -> tuple[float, float, int, list]:
    """Serving `count` prompts, `concurrency` at a time (`group(i, j)` decodes prompts i..j-1 together: their
    tokens, decode-phase tokens and seconds): wall seconds end to end, the decode phase's (a group's requests
    decode together after their prefills: its longest decode time) and its tokens, and each prompt's tokens."""
    tokens, decoded, decode_seconds, t0 = [], 0, 0.0, time.perf_counter()
    for i in range(0, count, concurrency):
        outs, n, seconds = group(i, min(i + concurrency, count))
        tokens, decoded, decode_seconds = tokens + outs, decoded + n, decode_seconds + seconds
    return time.perf_counter() - t0, decode_seconds, decoded, tokens


def specee_group(llm: LLM, prompts: list[str], params: SamplingParams):
    def group(i: int, j: int):
        outs = llm.generate(prompts[i:j], params, chat=True)
        return ([list(o.token_ids) for o in outs], sum(o.stats.decode_tokens for o in outs),
                max(o.stats.decode_seconds for o in outs))
    return group


def llama_cpp_group(peer, ids: list[list[int]], max_tokens: int):
    def group(i: int, j: int):
        outs, _, decode = peer.run_batch(ids[i:j], max_tokens)
        return outs, sum(len(o) - 1 for o in outs), decode
    return group


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(Path(__file__).resolve().parents[2] / "shared" / "models" /
                                           "smollm2-135m-instruct"))
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--speculative-config", action="append", default=[], type=json.loads)
    ap.add_argument("--early-exit", action="append", default=[], type=json.loads, metavar="JSON",
                    help='EarlyExitConfig fields, e.g. {"draft": "ngram", "mode": "lossless"} (calibrates once)')
    ap.add_argument("--rounds", type=int, default=1, help="modes take turns this many times; figures are medians")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--llama-cpp", action="store_true",
                    help="llama.cpp's batched decoding of the same .gguf --model as one more mode (llama-cpp-python)")
    ap.add_argument("--prefix-caching", action="store_true",
                    help="keep prompts' rows between requests (off: the rounds repeat the prompts, which would then "
                         "skip most of their prefill)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    if args.llama_cpp and not args.model.endswith(".gguf"):
        ap.error(f"--llama-cpp runs the same GGUF file: give --model a .gguf file, not {args.model}")
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = holdout_prompts(args.prompts)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    extra = {"threads": args.threads} if args.threads and "threads" in inspect.signature(LLM).parameters else {}
    if "enable_prefix_caching" in inspect.signature(LLM).parameters:  # each round's prompts prefill in full,
        extra["enable_prefix_caching"] = args.prefix_caching           # as on commits before the cache
    llm = LLM(args.model, quantization=None if args.quantization == "none" else args.quantization, **extra)
    modes = [("full depth", None)] + [(json.dumps(c, sort_keys=True), c) for c in args.speculative_config]
    modes += [("early exit " + json.dumps(c, sort_keys=True), EarlyExitConfig(**c)) for c in args.early_exit]
    peer = None
    if args.llama_cpp:
        from specee.bench.llama_cpp import LlamaCppPeer

        ids = [llm.encode(p, chat=True) for p in prompts]
        peer = LlamaCppPeer(Path(args.model), torch.get_num_threads(), max(map(len, ids)) + args.max_tokens)
        modes.append(("llama.cpp", peer))
    samples: dict[str, dict[str, list[float]]] = {name: {} for name, _ in modes}
    outputs: dict[str, dict[int, list]] = {name: {} for name, _ in modes}  # the last round's tokens
    print(f"# {cpu_name()}, {torch.get_num_threads()} threads, {len(prompts)} prompts x {args.max_tokens} tokens, "
          f"{args.rounds} round(s)")
    decoders: dict[str, tuple] = {}  # each mode's decoding, kept from turn to turn (its gate learns, as a served LLM's)
    for rnd in range(args.rounds):
        for ci, c in enumerate(args.concurrency):
            # the order flips from one concurrency to the next and from round to round, so each concurrency's
            # modes take both places (a turn counted over concurrencies gave c=1 and c=8 one order each)
            for name, config in modes if (rnd + ci) % 2 == 0 else modes[::-1]:
                if peer is not None and config is peer:
                    warm_up, group = llama_cpp_group(peer, ids, 8), llama_cpp_group(peer, ids, args.max_tokens)
                else:
                    if name in decoders:
                        llm.early_exit, llm.speculative = decoders[name]
                    elif isinstance(config, EarlyExitConfig):
                        llm.enable_early_exit(config)
                        llm.calibrate()
                    else:
                        llm.early_exit = None
                        llm.enable_speculative(config)
                    decoders[name] = llm.early_exit, llm.speculative
                    warm_up = specee_group(llm, prompts, SamplingParams(max_tokens=8, ignore_eos=True))
                    group = specee_group(llm, prompts, params)
                serve(warm_up, 2, 2)
                seconds, decode_seconds, decoded, outputs[name][c] = serve(group, len(prompts), c)
                samples[name].setdefault(f"c{c}", []).append(sum(map(len, outputs[name][c])) / seconds)
                samples[name].setdefault(f"decode_c{c}", []).append(decoded / decode_seconds)
    results = []
    for name, _ in modes:
        own = samples[name]
        row = {"mode": name, **{k: round(statistics.median(v), 2) for k, v in own.items()}}
        # each concurrency against the first as the median of the rounds' ratios: a round's runs are
        # minutes apart at most, the rounds' medians of each concurrency up to the whole run
        row["to_first_concurrency"] = {f"{key}{c}": median_ratio(own[f"{key}{c}"], own[f"{key}{args.concurrency[0]}"])
                                       for key in ("c", "decode_c") for c in args.concurrency}
        first = outputs[name][args.concurrency[0]]
        row["same_tokens_as_first_concurrency"] = {f"c{c}": sum(a == b for a, b in zip(outputs[name][c], first))
                                                   for c in args.concurrency}
        if args.rounds > 1:
            row["rounds"] = {k: [round(x, 2) for x in v] for k, v in own.items()}
        results.append(row)
        for key, what in (("c", "end to end"), ("decode_c", "decode phase")):
            print(f"{name}, {what}: " + ", ".join(f"c={c} {row[f'{key}{c}']} tok/s ({row['to_first_concurrency'][f'{key}{c}']:.2f}x)"
                                                  for c in args.concurrency))
        print(f"{name}, prompts with the same tokens as at c={args.concurrency[0]} (last round): " + ", ".join(
            f"c={c} {row['same_tokens_as_first_concurrency'][f'c{c}']}/{len(prompts)}" for c in args.concurrency))
    full = samples[modes[0][0]]
    for row in results[1:]:
        own = samples[row["mode"]]
        row["to_full_depth"] = {k: median_ratio(own[k], full[k]) for k in own}
        for key, what in (("c", "end to end"), ("decode_c", "decode phase")):
            print(f"{row['mode']} / full depth, {what} (median of the turns' ratios): " + ", ".join(
                f"c={c} {row['to_full_depth'][f'{key}{c}']:.2f}x" for c in args.concurrency))
    if peer is not None:
        peer.close()
    if args.out:
        Path(args.out).write_text(json.dumps({"cpu": cpu_name(), "threads": torch.get_num_threads(),
                                              "prompts": len(prompts), "max_tokens": args.max_tokens,
                                              "results": results}, indent=1))


if __name__ == "__main__":
    main()
