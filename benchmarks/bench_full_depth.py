"""Full-depth greedy decoding speed: specee's runtime against Hugging Face transformers.

Both engines decode exactly --max-new-tokens tokens (EOS does not stop either of them) for the
same chat-templated Spec-Bench prompts, at batch 1, with the same dtype and the same torch
thread count, in the same process. Runs are interleaved per prompt (the order alternates) after
one warm-up run each, and the greedy token streams are compared token for token.

Decode tokens/s counts the tokens after the first (the first comes out of the prefill) over
the time from the first token to the last, the same definition for both engines: specee's
`RequestStats.decode_tokens_per_second`, and for transformers a streamer timestamps each token.

    python benchmarks/bench_full_depth.py [--model DIR] [--prompts 5] [--max-new-tokens 128]
        [--dtype float32] [--threads N] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from specee.bench.report import cpu_name
from specee.bench.speed import identity
from specee.bench.tasks import SPEC_BENCH, load_prompts
from specee.bench.timing import hf_run, load_hf_model, specee_run
from specee.engine.loading import DTYPES

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
DEFAULT_MODEL = SHARED / "models" / "ref-target-24L"


def timed(run) -> dict:
    """A specee.bench.speed Run as this script's row: tokens, seconds, decode tokens/s."""
    return {"tokens": run.token_ids, "prefill_s": run.prefill_seconds, "decode_s": run.decode_seconds,
            "decode_tps": run.decode_tokens / run.decode_seconds, "wall_s": run.prefill_seconds + run.decode_seconds}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL, help=f"checkpoint directory (default: {DEFAULT_MODEL})")
    ap.add_argument("--prompts", type=int, default=5, help="number of Spec-Bench prompts (default: 5)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="tokens decoded per prompt (default: 128)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="dtype for both engines (default: float32)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads for both (default: torch's default)")
    ap.add_argument("--json", type=Path, default=None, metavar="OUT", help="also write the results as JSON to OUT")
    args = ap.parse_args(argv)
    spec_bench = SHARED.joinpath(*SPEC_BENCH)
    if not args.model.is_dir() or not spec_bench.exists():
        print(f"bench_full_depth: needs {args.model} and {spec_bench} (the shared folder next to the repo)",
              file=sys.stderr)
        return 2
    if args.max_new_tokens < 2:
        ap.error("--max-new-tokens must be at least 2 (decode speed needs tokens after the first)")

    import transformers
    from transformers import AutoTokenizer

    from specee import LLM

    transformers.utils.logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    dtype = DTYPES[args.dtype]
    max_new = args.max_new_tokens
    print(f"model {args.model} | dtype {args.dtype} | device cpu | batch 1 | {max_new} new tokens, EOS ignored")
    print(f"torch {torch.__version__} | transformers {transformers.__version__} | torch threads {threads} "
          f"| cpu: {cpu_name()}")

    llm = LLM(args.model, device="cpu", dtype=dtype, quantization=None)
    hf = load_hf_model(args.model, "cpu", dtype)  # EOS cleared: it decodes exactly N tokens, like ignore_eos

    def run_specee(ids: list[int]) -> dict:
        return timed(specee_run(llm, ids, max_new))

    def run_transformers(ids: list[int]) -> dict:
        return timed(hf_run(hf, ids, max_new))

    print(f"transformers attention: {hf.config._attn_implementation}")

    hf_tok = AutoTokenizer.from_pretrained(args.model)
    questions = load_prompts(spec_bench, total=args.prompts)  # round-robin over Spec-Bench's categories
    prompts, same_ids = [], 0
    for q in questions:
        messages = [{"role": "user", "content": q.text}]
        ids = llm.tokenizer.encode_chat(messages)  # both engines get exactly these ids
        hf_ids = hf_tok(hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                        add_special_tokens=False)["input_ids"]
        same_ids += hf_ids == ids
        prompts.append((q, ids))
    print(f"prompts: {len(prompts)} Spec-Bench first turns, chat template applied "
          f"(token ids equal to transformers' tokenizer for {same_ids}/{len(prompts)})")

    # one warm-up each (not measured)
    run_specee(prompts[0][1])
    run_transformers(prompts[0][1])

    rows = []
    header = f"{'id':>4} {'category':<15} {'prompt':>6} {'specee tok/s':>12} {'hf tok/s':>9} {'ratio':>6}  greedy"
    print(header)
    print("-" * len(header))
    for i, (q, ids) in enumerate(prompts):
        if i % 2 == 0:
            sp = run_specee(ids)
            tf = run_transformers(ids)
        else:
            tf = run_transformers(ids)
            sp = run_specee(ids)
        same = sp["tokens"] == tf["tokens"]
        diverge = identity(sp["tokens"], tf["tokens"])["first_mismatch"]
        row = {"question_id": q.id, "category": q.category, "prompt_tokens": len(ids),
               "specee": {k: v for k, v in sp.items() if k != "tokens"},
               "transformers": {k: v for k, v in tf.items() if k != "tokens"},
               "ratio": sp["decode_tps"] / tf["decode_tps"], "identical": same, "first_difference": diverge}
        rows.append(row)
        mark = "identical" if same else f"differs from token {diverge}"
        print(f"{q.id:>4} {q.category:<15} {len(ids):>6} {sp['decode_tps']:>12.1f} "
              f"{tf['decode_tps']:>9.1f} {row['ratio']:>6.2f}  {mark}", flush=True)

    steps = (max_new - 1) * len(rows)
    sp_tps = steps / sum(r["specee"]["decode_s"] for r in rows)
    tf_tps = steps / sum(r["transformers"]["decode_s"] for r in rows)
    gen = max_new * len(rows)
    sp_e2e = gen / sum(r["specee"]["wall_s"] for r in rows)
    tf_e2e = gen / sum(r["transformers"]["wall_s"] for r in rows)
    identical = sum(r["identical"] for r in rows)
    print("-" * len(header))
    print(f"overall decode tokens/s: specee {sp_tps:.1f} | transformers {tf_tps:.1f} | "
          f"ratio specee/transformers {sp_tps / tf_tps:.2f}")
    print(f"overall end-to-end tokens/s (prefill + decode): specee {sp_e2e:.1f} | transformers {tf_e2e:.1f} | "
          f"ratio {sp_e2e / tf_e2e:.2f}")
    print(f"greedy token streams identical: {identical}/{len(rows)} prompts")

    if args.json:
        result = {"model": str(args.model), "dtype": args.dtype, "device": "cpu", "threads": threads,
                  "max_new_tokens": max_new, "torch": torch.__version__, "transformers": transformers.__version__,
                  "cpu": cpu_name(), "prompts": rows,
                  "overall": {"specee_decode_tps": sp_tps, "transformers_decode_tps": tf_tps,
                              "ratio": sp_tps / tf_tps, "specee_end_to_end_tps": sp_e2e,
                              "transformers_end_to_end_tps": tf_e2e, "identical": identical,
                              "prompts": len(rows)}}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
