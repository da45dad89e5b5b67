"""`specee calibrate | train-draft | distill`: the artefacts the fast paths load (banks, heads, training text)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .arg_types import MAX_K, existing_path, non_negative_int, positive_float, positive_int, speculative_k
from .args import CLIError, add_model_args, default_draft, load_llm, resolve_model_dir
from .outputs import output_dir, output_file, writable_destination


# ---- specee calibrate ----------------------------------------------------------------------
def add_calibrate_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("calibrate", help="train the exit predictors for a target + drafter",
                       description="Run the target at full depth over calibration prompts, record the exit "
                                   "features per layer, train one small predictor per layer, choose thresholds "
                                   "on held-out data and the offline layer set; save the bank to -o.")
    add_model_args(p, fastest=True)  # the weights generate runs: the bank's features depend on them
    p.add_argument("--draft", metavar="DIR|ngram", default=None,
                   help="drafter: a draft model (directory or .gguf) or 'ngram' (default: ref-draft-4L for ref-target-24L)")
    p.add_argument("--data", metavar="PATH", type=existing_path, default=None,
                   help="calibration prompts: a file (alpaca .json or .jsonl with text/instruction) or a "
                        "directory of them (default: ../shared/data/calibration)")
    p.add_argument("-o", "--output", metavar="BANK", type=output_dir, default=None,
                   help="directory to write the bank to (default: the cache `generate --draft` reads, "
                        "~/.cache/specee/banks or $SPECEE_CACHE/banks)")
    p.add_argument("--prompts", type=positive_int, default=None, metavar="N",
                   help="use at most N prompts (default: 96, which takes 1-2 minutes for the reference pair on a 2-core CPU)")
    p.add_argument("--max-new-tokens", type=positive_int, default=96, metavar="N",
                   help="tokens the target generates per prompt to calibrate on (default: 96)")
    p.add_argument("--k", type=speculative_k, default=4, help=f"speculative tokens per step, 1-{MAX_K} (default: 4)")
    p.add_argument("--offline-size", type=positive_int, default=None, metavar="N",
                   help="size of the offline layer set (default: a quarter of the layers)")
    p.add_argument("--draft-vocab", type=non_negative_int, default=None, metavar="N",
                   help="a draft model scores only the N most frequent tokens of the calibration text "
                        "(FR-Spec shortlist; default: a quarter of the vocabulary; 0: the whole vocabulary)")
    p.add_argument("--json", action="store_true", help="print the calibration summary as JSON")
    p.set_defaults(func=cmd_calibrate)
    return p


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Calibrate a bank; without -o it goes where `generate --draft` looks for it (outside the repository)."""
    from ..calibration import calibrate, format_summary, load_calibration_prompts
    from ..cache_dir import default_cache_dir
    from ..engine.loading import check_draft_tokenizers
    from ..exit.bank import PredictorBank
    from ..model.llama import model_config
    from ..model.resolve import resolve_model
    from ..tokenizer import Tokenizer

    if args.output is None:
        try:
            writable_destination(default_cache_dir() / "banks", directory=True)
        except ValueError as e:
            raise CLIError(f"the bank cache: {e}; pass -o BANK (or set $SPECEE_CACHE)") from None
    else:
        try:
            PredictorBank.check_destination(args.output)
        except FileExistsError as e:
            raise CLIError(f"-o {e}") from None
    model_dir = resolve_model_dir(args.model, args.revision)
    draft = args.draft if args.draft is not None else default_draft(model_dir)
    if draft is None:
        raise CLIError("calibrate needs a drafter: pass --draft DIR (a draft model) or --draft ngram")
    if draft == "ngram":
        if args.draft_vocab:  # refused by the n-gram drafter only after the target had loaded
            raise CLIError(f"--draft-vocab {args.draft_vocab}: the shortlist restricts a draft model's LM head; "
                           "--draft ngram scores no vocabulary")
    else:
        check_draft_tokenizers(Tokenizer(model_dir), model_dir, [str(draft)])
        if args.draft_vocab:  # past the draft's vocabulary: found after both models had loaded
            vocab = model_config(resolve_model(str(draft), what="draft model")).vocab_size
            if args.draft_vocab > vocab:
                raise CLIError(f"--draft-vocab {args.draft_vocab} exceeds the draft's vocabulary ({vocab} tokens)")
    check_room(model_dir, args.max_new_tokens)
    prompts = load_calibration_prompts(args.data, limit=args.prompts)
    args.no_exit = True
    llm = load_llm(args)
    drafter = llm.make_drafter(str(draft), args.k)
    limit = {} if args.prompts is None else {"max_prompts": args.prompts}
    bank = calibrate(llm.model, llm.tokenizer, drafter, prompts, k=args.k, max_new_tokens=args.max_new_tokens,
                     offline_size=args.offline_size, target_dir=llm.model_dir, target_fingerprint=llm.fingerprint,
                     eos_ids=llm.eos_ids, draft_vocab=args.draft_vocab, **limit)
    path = bank.save(args.output or llm.bank_cache_path(drafter.fingerprint, args.k))
    if args.json:
        print(json.dumps(bank.manifest()))
    else:
        print(format_summary(bank))
        print(f"bank written to {path}", file=sys.stderr)
    return 0


def check_room(model_dir: Path, max_new_tokens: int) -> None:
    """--max-new-tokens against the model's context, read from its config: before the weights load."""
    from ..model.llama import model_config

    context = model_config(model_dir).context_limit
    if max_new_tokens >= context:
        raise CLIError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the model's context of "
                       f"{context} tokens")


# ---- specee train-draft --------------------------------------------------------------------
def layer_list(value: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in value.replace(",", " ").split())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer indices like '2,12,23', got {value!r}") from None


def add_train_draft_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("train-draft", help="train an EAGLE-style draft head for a target",
                       description="Record the target's features over calibration text (teacher-forced), train "
                                   "a one-layer EAGLE head on them within a time budget and save it to -o "
                                   "(head.safetensors + manifest.json; resumable state in -o/checkpoint).")
    add_model_args(p)
    p.add_argument("-o", "--output", metavar="HEAD_DIR", type=output_dir, required=True,
                   help="directory to write the head to")
    p.add_argument("--minutes", type=positive_float, default=5.0, metavar="M",
                   help="time budget for recording and training (default: 5; at least 1, except with --resume)")
    p.add_argument("--feature-layers", type=layer_list, default=None, metavar="I,J,K",
                   help="target layers whose outputs the head reads (default: the last, EAGLE-1; three "
                        "layers, low/middle/high, fuse them as EAGLE-3 does)")
    p.add_argument("--shortlist", type=positive_int, default=None, metavar="N",
                   help="the head proposes among the N most frequent tokens of the training text (default: a quarter of the vocabulary, at most 4096)")
    p.add_argument("--data", metavar="PATH", type=existing_path, default=None,
                   help="training text: alpaca .json / {text} .jsonl file or directory (default: ../shared/data/calibration)")
    p.add_argument("--resume", action="store_true", help="continue the training checkpoint in HEAD_DIR")
    p.add_argument("--json", action="store_true", help="print the manifest (without the shortlist) as JSON")
    p.set_defaults(func=cmd_train_draft)
    return p


def cmd_train_draft(args: argparse.Namespace) -> int:
    from ..calibration.prompts import calibration_data
    from ..calibration.train_draft import check_run, train_draft
    from ..drafters.eagle_head import EagleHeadConfig
    from ..model.llama import model_config

    if args.dtype not in ("auto", "float32"):
        raise CLIError("train-draft trains in float32; leave --dtype out")
    args.dtype = "float32"
    try:  # each of these, and a bad --feature-layers below, was found only after the target had loaded
        check_run(args.output, args.minutes, args.resume)
    except FileNotFoundError as e:
        raise CLIError(f"--resume: {e}") from None
    except FileExistsError as e:
        raise CLIError(f"-o {e}") from None
    args.data = calibration_data(args.data)  # a missing ../shared: found only after the target had loaded
    if args.feature_layers is not None:
        cfg = model_config(resolve_model_dir(args.model, args.revision))
        try:
            EagleHeadConfig.for_target(cfg, args.feature_layers)
        except ValueError as e:
            raise CLIError(f"--feature-layers: {e}") from None
    llm = load_llm(args)
    m = train_draft(llm, args.output, minutes=args.minutes, feature_layers=args.feature_layers,
                    shortlist_size=args.shortlist, resume=args.resume, data=args.data)
    m.pop("shortlist")
    if args.json:
        print(json.dumps(m))
    else:
        top1, top4 = m["held_out_top1"], m["held_out_top4"]
        print(f"head for {m['target']} (layers {m['feature_layers']}, shortlist {m['config']['shortlist_size']}): "
              f"{m['steps']} steps; held-out top-1 {', '.join(f'{x:.3f}' for x in top1)}, "
              f"top-4 {', '.join(f'{x:.3f}' for x in top4)} (draft steps 1..{len(top1)})")
        print(f"head written to {args.output}", file=sys.stderr)
    return 0


# ---- specee distill --------------------------------------------------------------------------
def add_distill_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("distill", help="answer instructions with the target: training text for train-draft",
                       description="Answer the instructions of alpaca-style records with the target itself "
                                   "(greedy, full depth, chat template, batched) and write them as an alpaca "
                                   ".json file: the text a draft head should learn (train-draft --data FILE).")
    add_model_args(p)
    p.add_argument("-o", "--output", metavar="FILE", type=output_file, required=True, help="the .json file to write")
    p.add_argument("--data", metavar="PATH", type=existing_path, default=None,
                   help="instruction records: alpaca .json / .jsonl file or directory (default: ../shared/data/calibration)")
    p.add_argument("--max-new-tokens", type=positive_int, default=256, help="answer length cap (default: 256)")
    p.add_argument("--batch-size", type=positive_int, default=32, help="answers decoded together (default: 32)")
    p.add_argument("--minutes", type=positive_float, default=None, metavar="M",
                   help="stop after the batch that passes this budget (default: answer every instruction)")
    p.set_defaults(func=cmd_distill)
    return p


def cmd_distill(args: argparse.Namespace) -> int:
    from ..calibration.self_distill import distill

    check_room(resolve_model_dir(args.model, args.revision), args.max_new_tokens)
    llm = load_llm(args)
    t = time.perf_counter()
    n, left_out = distill(llm, args.output, args.data, args.max_new_tokens, args.batch_size, args.minutes)
    longer = f" ({left_out} instructions too long for the context beside --max-new-tokens left out)" if left_out else ""
    print(f"{n} answers written to {args.output} in {time.perf_counter() - t:.0f} s{longer}")
    return 0
