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
import copy
import json
import sys
import time
from pathlib import Path

import torch

from specee.bench.common import cpu_name

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
DEFAULT_MODEL = SHARED / "models" / "ref-target-24L"
SPEC_BENCH = SHARED / "data" / "spec_bench" / "question.jsonl"
# Spec-Bench's six task groups; the eight MT-Bench categories form one of them.
GROUPS = ("translation", "summarization", "qa", "math_reasoning", "rag")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_prompts(n: int) -> list[dict]:
    """n first-turn prompts taken round-robin over the task groups (mt_bench, translation, ...)."""
    groups: dict[str, list[dict]] = {}
    for line in SPEC_BENCH.read_text().splitlines():
        if line.strip():
            q = json.loads(line)
            groups.setdefault(q["category"] if q["category"] in GROUPS else "mt_bench", []).append(q)
    chosen: list[dict] = []
    depth = 0
    while len(chosen) < n and any(depth < len(g) for g in groups.values()):
        for g in groups.values():
            if depth < len(g) and len(chosen) < n:
                chosen.append(g[depth])
        depth += 1
    return chosen


class TokenTimer:
    """A transformers streamer that timestamps every `put` (the prompt first, then each token)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_specee(llm, ids: list[int], max_new: int) -> dict:
    from specee import SamplingParams

    t0 = time.perf_counter()
    out = llm.generate(ids, SamplingParams(max_tokens=max_new, ignore_eos=True))[0]
    wall = time.perf_counter() - t0
    s = out.stats
    assert s.generated_tokens == max_new, s
    return {"tokens": list(out.token_ids), "prefill_s": s.prefill_seconds, "decode_s": s.decode_seconds,
            "decode_tps": s.decode_tokens_per_second, "wall_s": wall}


def run_transformers(model, gen_config, ids: list[int], max_new: int) -> dict:
    """greedy, max_new_tokens = min_new_tokens = max_new (all set in gen_config), no EOS"""
    input_ids = torch.tensor([ids])
    timer = TokenTimer()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                             generation_config=gen_config, streamer=timer)
    wall = time.perf_counter() - t0
    tokens = out[0, len(ids):].tolist()
    assert len(tokens) == max_new and len(timer.times) == max_new + 1, (len(tokens), len(timer.times))
    decode_s = timer.times[-1] - timer.times[1]
    return {"tokens": tokens, "prefill_s": timer.times[1] - timer.times[0], "decode_s": decode_s,
            "decode_tps": (max_new - 1) / decode_s, "wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL, help=f"checkpoint directory (default: {DEFAULT_MODEL})")
    ap.add_argument("--prompts", type=int, default=5, help="number of Spec-Bench prompts (default: 5)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="tokens decoded per prompt (default: 128)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="dtype for both engines (default: float32)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads for both (default: torch's default)")
    ap.add_argument("--json", type=Path, default=None, metavar="OUT", help="also write the results as JSON to OUT")
    args = ap.parse_args(argv)
    if not args.model.is_dir() or not SPEC_BENCH.exists():
        print(f"bench_full_depth: needs {args.model} and {SPEC_BENCH} (the shared folder next to the repo)",
              file=sys.stderr)
        return 2
    if args.max_new_tokens < 2:
        ap.error("--max-new-tokens must be at least 2 (decode speed needs tokens after the first)")

    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

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

    llm = LLM(args.model, device="cpu", dtype=dtype)
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
    # No EOS for transformers either: min_new_tokens alone masks EOS out of the argmax, which changes
    # the greedy stream wherever EOS is the top token (specee's ignore_eos keeps it and goes on).
    # transformers refills an unset eos_token_id from the model's generation_config / config, so
    # it is cleared there; min_new_tokens then has nothing to mask and is kept only as a guard.
    hf.generation_config.eos_token_id = None
    hf.config.eos_token_id = None
    gen_config = copy.deepcopy(hf.generation_config)
    gen_config.update(do_sample=False, max_new_tokens=max_new, min_new_tokens=max_new)
    print(f"transformers attention: {hf.config._attn_implementation}")

    hf_tok = AutoTokenizer.from_pretrained(args.model)
    questions = load_prompts(args.prompts)
    prompts, same_ids = [], 0
    for q in questions:
        messages = [{"role": "user", "content": q["turns"][0]}]
        ids = llm.tokenizer.encode_chat(messages)  # both engines get exactly these ids
        hf_ids = hf_tok(hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                        add_special_tokens=False)["input_ids"]
        same_ids += hf_ids == ids
        prompts.append((q, ids))
    print(f"prompts: {len(prompts)} Spec-Bench first turns, chat template applied "
          f"(token ids equal to transformers' tokenizer for {same_ids}/{len(prompts)})")

    # one warm-up each (not measured)
    run_specee(llm, prompts[0][1], max_new)
    run_transformers(hf, gen_config, prompts[0][1], max_new)

    rows = []
    header = f"{'id':>4} {'category':<15} {'prompt':>6} {'specee tok/s':>12} {'hf tok/s':>9} {'ratio':>6}  greedy"
    print(header)
    print("-" * len(header))
    for i, (q, ids) in enumerate(prompts):
        if i % 2 == 0:
            sp = run_specee(llm, ids, max_new)
            tf = run_transformers(hf, gen_config, ids, max_new)
        else:
            tf = run_transformers(hf, gen_config, ids, max_new)
            sp = run_specee(llm, ids, max_new)
        same = sp["tokens"] == tf["tokens"]
        diverge = None if same else next(j for j, (a, b) in enumerate(zip(sp["tokens"], tf["tokens"])) if a != b)
        row = {"question_id": q["question_id"], "category": q["category"], "prompt_tokens": len(ids),
               "specee": {k: v for k, v in sp.items() if k != "tokens"},
               "transformers": {k: v for k, v in tf.items() if k != "tokens"},
               "ratio": sp["decode_tps"] / tf["decode_tps"], "identical": same, "first_difference": diverge}
        rows.append(row)
        mark = "identical" if same else f"differs from token {diverge}"
        print(f"{q['question_id']:>4} {q['category']:<15} {len(ids):>6} {sp['decode_tps']:>12.1f} "
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
