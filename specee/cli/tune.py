"""`specee tune`: measure the decoding modes on this machine, print the table, store the fastest lossless one."""
from __future__ import annotations

import argparse
import datetime as dt
from pathlib import Path

from .arg_types import MAX_K, positive_int
from .args import CLIError, add_model_args, load_llm, note, resolve_model_dir

DEFAULT_PROMPTS = 4  # prompts `specee tune` times on by default


def lengths_arg(value: str) -> tuple[int, ...]:
    """--lengths: distinct speculative lengths, 1 to MAX_K."""
    try:
        lengths = tuple(sorted({int(v) for v in value.split(",") if v.strip()}))
    except ValueError:
        lengths = ()
    if not lengths or not all(1 <= n <= MAX_K for n in lengths):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers from 1 to {MAX_K}, got {value!r}")
    return lengths


def add_tune_parser(sub) -> argparse.ArgumentParser:
    from ..tune.measure import BUILTIN_PROMPTS, LENGTHS

    p = sub.add_parser("tune", help="measure the decoding modes on this machine; generate, chat and serve then "
                                    "use the fastest lossless one",
                       description="Time full depth, n-gram and draft-model speculation at several lengths, "
                                   "lossless early exit and exits inside verification on this machine (greedy "
                                   "decode tokens/s, one process, interleaved runs), print the table and store the "
                                   "fastest configuration whose output equals full depth's (full depth unless one "
                                   "beat it by 2% and in significantly many runs paired with it), for this model, "
                                   "CPU and thread count. generate, chat and serve use it when no --speculative-config or "
                                   "--draft is given (--no-tune ignores it).")
    add_model_args(p, fastest=True)
    g = p.add_argument_group("tuning")
    g.add_argument("--draft", metavar="DIR|GGUF", default=None,
                   help="also measure speculation (and early exit) with this draft model, which must share the "
                        "target's tokenizer (n-gram lookup is always measured)")
    g.add_argument("--lengths", type=lengths_arg, default=LENGTHS, metavar="N,N,...",
                   help=f"speculative tokens per step to try (default: {','.join(map(str, LENGTHS))})")
    g.add_argument("--prompts", type=positive_int, default=None, metavar="N",
                   help=f"prompts to time on (default: {DEFAULT_PROMPTS} of the {len(BUILTIN_PROMPTS)} built-in ones, or of "
                        "--prompt-file, all of its prompts where it has fewer)")
    g.add_argument("--prompt-file", metavar="PATH", default=None,
                   help="time on your own prompts: JSONL / JSON records (Spec-Bench, MT-Bench, alpaca style) or one "
                        "prompt per line")
    g.add_argument("--max-new-tokens", type=positive_int, default=96, metavar="N",
                   help="tokens decoded per prompt and run, EOS ignored (default: 96)")
    g.add_argument("--rounds", type=positive_int, default=2, metavar="N",
                   help="runs of every configuration per prompt; a prompt's time is the median (default: 2)")
    g.add_argument("--early-exit", action="store_true",
                   help="calibrate the predictor banks early exit needs where none is cached (minutes each; "
                        "by default early exit is measured only with cached banks)")
    p.set_defaults(func=cmd_tune)
    return p


def prompt_texts(args: argparse.Namespace) -> list[str]:
    from ..bench.common import BenchError
    from ..bench.tasks import read_prompt_file
    from ..tune.measure import BUILTIN_PROMPTS

    if args.prompt_file is None:
        texts, source = list(BUILTIN_PROMPTS), "built-in prompts"
    else:
        try:
            texts = [p.text for p in read_prompt_file(Path(args.prompt_file).expanduser())]
        except BenchError as e:
            raise CLIError(f"--prompt-file: {e}") from None
        source = f"prompts in {args.prompt_file}"
        if not texts:
            raise CLIError(f"--prompt-file: no prompts in {args.prompt_file}")
    if args.prompts is None:
        return texts[:DEFAULT_PROMPTS]
    if args.prompts > len(texts):
        raise CLIError(f"--prompts {args.prompts}: there are {len(texts)} {source}"
                       + ("" if args.prompt_file else " (--prompt-file PATH times on more)"))
    return texts[: args.prompts]


def checked_draft(args: argparse.Namespace, model_dir: Path) -> Path | None:
    """The draft model --draft names, resolved, its tokenizer checked against the target's (before loading)."""
    from ..engine.loading import check_draft_tokenizers
    from ..model.resolve import resolve_model
    from ..tokenizer import Tokenizer

    if args.draft is None:
        return None
    if args.draft == "ngram":
        raise CLIError("--draft ngram: n-gram speculation is always measured; --draft names a draft model")
    try:
        draft = resolve_model(args.draft, what="draft model")
        check_draft_tokenizers(Tokenizer(model_dir), model_dir, [str(draft)])
    except (ValueError, OSError) as e:
        raise CLIError(f"--draft {args.draft}: {e}") from None
    return draft.resolve()


def cmd_tune(args: argparse.Namespace) -> int:
    from ..tune.measure import count, tune
    from ..tune.profile import DIR_ENV, key_of, profile_dir, store
    from .outputs import writable_destination

    texts = prompt_texts(args)
    model_dir = resolve_model_dir(args.model, args.revision)
    draft = checked_draft(args, model_dir)
    try:
        writable_destination(profile_dir(), directory=True)
    except ValueError as e:
        raise CLIError(f"the tuned profiles' directory: {e}; set ${DIR_ENV} (or $SPECEE_CACHE)") from None
    llm = load_llm(args)
    tuning = tune(llm, texts, draft=draft, lengths=args.lengths, max_new_tokens=args.max_new_tokens,
                  rounds=args.rounds, early_exit=args.early_exit, progress=True, say=note)
    key = key_of(llm)
    print(table(tuning, key, llm.model_dir))
    path = store(llm.model_dir, llm.fingerprint, profile_entry(tuning, key))
    note(f"stored in {path}: generate, chat and serve use {tuning.chosen.candidate.label} for this model on "
         f"{key['machine']} with {count(key['threads'], 'thread')} when no mode is given (--no-tune ignores it)")
    return 0


def profile_entry(tuning, key: dict) -> dict:
    """What the profile keeps: the key, the chosen configuration and every result (JSON, no pickle)."""
    from .. import __version__

    chosen = tuning.chosen
    return {**key, "measured": dt.datetime.now(dt.timezone.utc).astimezone().isoformat(timespec="seconds"),
            "specee_version": __version__, "ratio": round(chosen.ratio, 4),
            "decode_tokens_per_second": round(chosen.decode_tokens_per_second, 2), "config": chosen.candidate.config,
            "settings": tuning.settings,
            "results": [{"name": r.candidate.name, "label": r.candidate.label, "lossless": r.candidate.lossless,
                         "decode_tokens_per_second": round(r.decode_tokens_per_second, 2), "ratio": round(r.ratio, 4),
                         "differing_prompts": r.differing, "faster_runs": [r.wins, r.pairs], "detail": r.detail,
                         "second_pass": r.second_pass}
                        for r in tuning.results]}


def table(tuning, key: dict, model_dir: Path) -> str:
    """The results as a Markdown table (as llama-bench prints), with what it was measured on above it."""
    from ..bench.report import md_table
    from ..tune.measure import ALPHA, MARGIN, count

    s = tuning.settings
    rows = []
    for r in tuning.results:
        notes = [r.detail] if r.detail else []
        if not r.candidate.lossless:
            notes.append("lossy: never chosen")
        elif r.differing:
            notes.append(f"tokens differ from full depth on {r.differing}/{s['prompts']} prompts: not chosen")
        if r.second_pass:
            notes.append("ratio to full depth timed again beside it")
        if r is tuning.chosen and r is tuning.results[0] and any(x.eligible and x.ratio > 1 for x in tuning.results[1:]):
            notes.append(f"kept: nothing lossless was {MARGIN - 1:.0%} faster overall and in enough paired runs "
                         f"(sign test, p < {ALPHA})")
        rows.append([r.candidate.label, f"{r.decode_tokens_per_second:.1f}", f"{r.ratio:.2f}x",
                     "" if r is tuning.results[0] else f"{r.wins}/{r.pairs}", "**chosen**" if r is tuning.chosen else "",
                     "; ".join(notes)])
    head = (f"specee tune: {model_dir} on {key['machine']}, {count(key['threads'], 'thread')}, quantization "
            f"{key['quantization']}, {key['dtype']}; {count(s['prompts'], 'prompt')} x {s['max_new_tokens']} tokens, "
            f"median of {count(s['rounds'], 'round')}, greedy, EOS ignored")
    return "\n".join([head, "", md_table(["configuration", "decode tok/s", "vs full depth", "faster runs", "", "notes"], rows)])
