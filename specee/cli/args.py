"""Argument groups shared by the subcommands, and the one place an `LLM` is built from them (`load_llm`);
the converters that check each flag's value live in `arg_types`."""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from ..engine.scheduling import DEFAULT_SWAP_SPACE
from .arg_types import (MAX_K, bank_dir, device_arg, kv_cache_memory_arg, non_negative_float, non_negative_int,
                        positive_float, positive_int, probability, seed_int, speculative_config_arg, speculative_k,
                        swap_space_arg)
from .outputs import exit_room_note

PROG = "specee"
DEFAULT_MODEL = Path("../shared/models/smollm2-135m-instruct")  # SmolLM2-135M-Instruct, a GGUF file
REFERENCE_MODEL = "ref-target-24L"  # the project's reference target: ref-draft-4L is its default drafter
REPO_ROOT = Path(__file__).resolve().parents[2]
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "float16", "float32")  # model/kv_cache.py's (not imported here: parsing loads no torch)
EXIT_USAGE = 2  # bad arguments or a library error (argparse uses 2 as well)


class CLIError(Exception):
    """A user-facing error: printed as `specee: error: <message>` and exit status 2."""


class Parser(argparse.ArgumentParser):
    """argparse with a usage error as the one line every other error is (`--help` shows the usage)."""

    def parse_args(self, args=None, namespace=None):
        """Unknown flags are named against the command they were given to (argparse's top level named
        `specee --help` for `specee generate --bogus`)."""
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            self.command_parser(ns).error(f"unrecognized arguments: {' '.join(extras)}")
        return ns

    def command_parser(self, ns: argparse.Namespace) -> argparse.ArgumentParser:
        """The (sub)command's own parser that `ns` was parsed by."""
        parser = self
        while (sub := next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)) \
                and getattr(ns, sub.dest, None) in sub.choices:
            parser = sub.choices[getattr(ns, sub.dest)]
        return parser

    def error(self, message: str):
        command = self.prog.removeprefix(PROG).strip()
        self.exit(EXIT_USAGE, f"{PROG}: error: {command + ': ' if command else ''}{message} "
                              f"(`{self.prog} --help` lists the flags)\n")


# ---- shared arguments ----------------------------------------------------------------------
def default_model_candidates() -> list[Path]:
    """Where the default model may live: relative to the current directory, then to the repo root."""
    return [Path.cwd() / DEFAULT_MODEL, REPO_ROOT / DEFAULT_MODEL]


def resolve_model_dir(model: str | None, revision: str | None = None) -> Path:
    """The checkpoint directory or .gguf file --model names (a path or a hub id), or the default model."""
    from ..model.resolve import resolve_model

    if model is not None:
        if not model.strip():
            raise CLIError("--model is empty: pass a checkpoint directory, a .gguf file or a hub id")
        return resolve_model(model, revision)
    candidates = default_model_candidates()
    for path in candidates:
        if path.is_dir():
            return resolve_model(path.resolve(), revision)  # a --revision of the local default: refused
    looked = ", ".join(str(p) for p in dict.fromkeys(candidates))
    raise CLIError(f"no --model given and the default model {DEFAULT_MODEL} was not found (looked in {looked}); "
                   "pass --model PATH (a checkpoint directory or .gguf file) or a Hugging Face hub id")


def add_model_args(parser: argparse.ArgumentParser, runtime: bool = True, fastest: bool = False) -> None:
    """--model, plus --device, --dtype and --quantization when the command runs the model; `fastest`:
    the command decodes for a user (generate, chat) or calibrates for them, so its defaults are the
    fastest measured (LLM's own)."""
    g = parser.add_argument_group("model")
    g.add_argument("--model", metavar="PATH|ID", default=None,
                   help="a Hugging Face checkpoint directory, a .gguf file (or a directory holding one), or a hub "
                        f"id such as HuggingFaceTB/SmolLM2-135M-Instruct (default: {DEFAULT_MODEL}, looked up "
                        "relative to the current directory and to the specee repository root)")
    g.add_argument("--revision", metavar="REV", default=None,
                   help="branch, tag or commit of a hub id (default: main)")
    if runtime:
        g.add_argument("--device", type=device_arg, default="cpu", metavar="{cpu,cuda}",
                       help="where to run (default: cpu; cuda:N picks a GPU)")
        g.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                       help="compute dtype (default: auto = float32 on CPU, bfloat16 on CUDA)")
        add_quantization_arg(g, fastest)
        add_threads_arg(g)
        g.add_argument("--kv-cache-memory", type=kv_cache_memory_arg, default=None, metavar="SIZE|TOKENS",
                       help="the KV cache pool requests share: a size (512MiB, 2GB) or a token count "
                            "(default: 1 GiB, at least one full context; generate: its one request's size)")
        g.add_argument("--swap-space", type=swap_space_arg, default=DEFAULT_SWAP_SPACE, metavar="GiB",
                       help="host memory for requests parked out of a full KV cache; one whose parking would pass "
                            f"it ends with an error (default: {DEFAULT_SWAP_SPACE:g}, as vLLM's)")
        g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                       help="a prompt that starts as an earlier one did prefills only the rest (a chat's next turn "
                            "does not prefill the conversation again); the same tokens (default: on, as vLLM's)")
        g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                       help="what the KV cache stores (default: auto = float16 where specee's AVX-512 or AVX2 attention "
                            "reads it, as llama.cpp: half the memory and bytes read; else the compute dtype)")


QUANTIZATION_HELP = ("weight-only quantized linears: int4 (groups of 32), int8 (per channel), auto (on CPU a GGUF's "
                     "own precision: Q4_K/Q6_K/Q5_0/Q8_0 as stored, Q4_0/Q4_1 -> int4, other Q5/Q8 -> int8, float -> none; "
                     "on CUDA none) or none (float weights)")


def add_quantization_arg(group, fastest: bool = False) -> None:
    """--quantization, for every command that runs a model (shared with `specee bench`)."""
    default = ("auto, as LLM(...) in Python (the fastest measured; a checkpoint with float weights stays float)"
               if fastest else "none")
    group.add_argument("--quantization", choices=("int4", "int8", "auto", "none"), default=None,
                       help=f"{QUANTIZATION_HELP}; default: {default}")
    group.set_defaults(fastest_quantization=fastest)


def add_threads_arg(group) -> None:
    """--threads, for every command that runs a model (shared with `specee bench`)."""
    group.add_argument("--threads", type=positive_int, default=None, metavar="N",
                       help="CPU threads (default: the fastest of 1, all but one and all cores, timed on bursts of "
                            "decode steps at load and again while decoding: fewer when another process keeps the CPU "
                            "busy)")


def quantization_mode(args: argparse.Namespace) -> str | None:
    """The quantization LLM(...) gets: the flag, else the command's default (LLM's own "auto" where it decodes
    for a user: on CPU 3.9x float32 on SmolLM2 Q4_1, BENCHMARKS.md; float where it measures a reference)."""
    mode = args.quantization or ("auto" if getattr(args, "fastest_quantization", False) else "none")
    return None if mode == "none" else mode


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=positive_int, default=128, metavar="N",
                   help="most tokens to generate (default: 128)")
    g.add_argument("--temperature", type=non_negative_float, default=0.0, metavar="T",
                   help="0 = greedy (default), > 0 samples")
    g.add_argument("--top-k", type=non_negative_int, default=0, metavar="K",
                   help="sample among the k most likely tokens (0 = off)")
    g.add_argument("--top-p", type=probability, default=1.0, metavar="P", help="nucleus sampling mass (1.0 = off)")
    g.add_argument("--seed", type=seed_int, default=None, metavar="N",
                   help="random seed for sampling, 0 to 2**64 - 1 (reproducible runs)")
    g.add_argument("--stop", nargs="+", action="extend", default=[], metavar="S",
                   help="stop when any of these strings is produced (not included in the output)")


def sampling_params(args: argparse.Namespace):
    from ..sampling import SamplingParams

    return SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, seed=args.seed, stop=tuple(args.stop))


DEFAULT_DRAFT = Path("../shared/models/ref-draft-4L")


def add_early_exit_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("early exit (SpecEE)")
    g.add_argument("--draft", metavar="DIR|ngram", default=None,
                   help="turns early exit on, with this drafter for the speculative tokens: a draft model "
                        "(directory or .gguf) sharing the target's tokenizer, or 'ngram' (training-free prompt "
                        "lookup). Default: none, full depth (early exit measured slower than full depth on "
                        "every model so far, see BENCHMARKS.md)")
    g.add_argument("--bank", metavar="DIR", type=bank_dir, default=None,
                   help="predictor bank from `specee calibrate` (default: calibrate once and cache it under "
                        "~/.cache/specee, or $SPECEE_CACHE)")
    g.add_argument("--no-exit", action="store_true", help="run every token at full depth, even with --draft")
    g.add_argument("--mode", choices=("lossy", "lossless"), default="lossy",
                   help="lossy: SpecEE's early exit; lossless: exits are drafts verified by the full model, "
                        "output identical to full depth (default: lossy)")
    g.add_argument("--kv-policy", choices=("skip", "propagate", "recompute"), default="recompute",
                   help="how the KV entries of skipped layers are filled (default: recompute, exact)")
    g.add_argument("--k", type=speculative_k, default=4, help=f"speculative tokens per step, 1-{MAX_K} (default: 4)")
    g.add_argument("--threshold-scale", type=positive_float, default=1.0, metavar="S",
                   help="scale the bank's thresholds' distance from 1: > 1 exits more, < 1 less (default: 1)")
    g.add_argument("--max-pending", type=positive_int, default=8, metavar="N",
                   help="carried rows / unverified tokens before a forced full-depth step (default: 8)")
    g.add_argument("--offline-size", type=positive_int, default=None, metavar="N",
                   help="offline predictor layers to use (default: the bank's set)")
    g.add_argument("--online-window", type=non_negative_int, default=4, metavar="N",
                   help="recent tokens whose exit layers get online predictors (default: 4; 0 = off)")


def default_draft(model_dir: Path) -> Path | None:
    """`specee calibrate`'s drafter when none is given: the reference draft, for the project's
    reference model (a bank for the pair its figures are measured on)."""
    if model_dir.is_dir() and model_dir.name == REFERENCE_MODEL:
        draft = model_dir.parent / DEFAULT_DRAFT.name
        return draft if draft.is_dir() else None
    return None


# early exit's flags (EarlyExitConfig's fields, their defaults its own): one given without --draft says what
# full depth does not do
EXIT_FLAGS = ("bank", "mode", "kv_policy", "k", "threshold_scale", "max_pending", "offline_size", "online_window")


def early_exit_config(args: argparse.Namespace):
    """The EarlyExitConfig the flags ask for, or None for full depth."""
    from ..exit.config import LOSSLESS_KV_POLICY, EarlyExitConfig

    if getattr(args, "no_exit", True):
        return None
    if args.draft is None:
        defaults = {f.name: f.default for f in dataclasses.fields(EarlyExitConfig)}
        given = [f"--{name.replace('_', '-')} {getattr(args, name)}" for name in EXIT_FLAGS
                 if getattr(args, name) != defaults[name]]
        if given:
            raise CLIError(f"{given[0]} is early exit, which needs a drafter: pass --draft DIR (a draft model) or "
                           "--draft ngram")
        return None
    if args.mode == "lossless" and args.kv_policy != LOSSLESS_KV_POLICY:  # EarlyExitConfig's rule, in flags
        raise CLIError(f"--mode lossless needs --kv-policy {LOSSLESS_KV_POLICY} (the carried rows are what verifies), "
                       f"got --kv-policy {args.kv_policy}")
    return EarlyExitConfig(draft=str(args.draft), bank=args.bank, k=args.k, kv_policy=args.kv_policy, mode=args.mode,
                           offline_size=args.offline_size, online_window=args.online_window,
                           max_pending=args.max_pending, threshold_scale=args.threshold_scale)


def add_speculative_args(parser: argparse.ArgumentParser) -> None:
    """--speculative-config, and --no-tune: the commands that decode for a user (generate, chat, serve) use
    what `specee tune` stored when neither it nor --draft picks a mode."""
    g = parser.add_argument_group("speculative decoding")
    g.add_argument("--no-tune", action="store_true",
                   help="ignore the configuration `specee tune` stored for this model, CPU and thread count "
                        "(default: use it when neither --speculative-config nor --draft is given)")
    g.add_argument(
        "--speculative-config", type=speculative_config_arg, default=None, metavar="JSON",
        help='draft-and-verify decoding, lossless, as in vLLM: \'{"method": "eagle", "model": HEAD_DIR, '
             '"num_speculative_tokens": 4}\' (methods: eagle, draft_model with a model dir, ngram; optional '
             '"tree": {"topk": K, "size": S}). With --draft, SpecEE\'s exits run inside the verification '
             'passes (method ngram with --draft ngram, or draft_model with the same model)')


def llm_options(args: argparse.Namespace) -> dict:
    """The LLM's arguments from the flags, each checked (one line naming the flag) before anything loads:
    `serve` asks for them before its server starts, as the other commands before they load."""
    import torch

    model_dir = resolve_model_dir(args.model, args.revision)
    if model_dir.is_file():  # a truncated or corrupt GGUF's header, in one line (the loader reuses the read)
        from ..model.gguf import open_gguf

        open_gguf(model_dir)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise CLIError(f"--device {args.device}: CUDA is not available (torch {torch.__version__}); use --device cpu")
    speculative = getattr(args, "speculative_config", None)
    if speculative is not None:
        from ..speculative.config import SpeculativeConfig

        speculative = SpeculativeConfig.parse(speculative)  # before loading: bad configs fail fast
    return dict(model=model_dir, device=args.device, dtype=args.dtype, quantization=quantization_mode(args),
                early_exit=early_exit_config(args) if hasattr(args, "no_exit") else None,
                speculative_config=speculative, threads=args.threads,
                kv_cache_memory=getattr(args, "kv_cache_memory", None),
                swap_space=getattr(args, "swap_space", DEFAULT_SWAP_SPACE),
                enable_prefix_caching=getattr(args, "enable_prefix_caching", True),
                kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"), **scheduling(args))


def load_llm(args: argparse.Namespace, options: dict | None = None):
    """Build the LLM the command asked for (the single place model-loading options are read); options:
    `llm_options(args)`, where the command checked them already."""
    from ..engine.llm import LLM
    from ..model.quant import QuantizationError

    options = llm_options(args) if options is None else options
    try:
        llm = LLM(**options)
    except QuantizationError as e:
        raise CLIError(f"--quantization {options['quantization']}: {e}; --quantization none runs float weights") \
            from None
    if args.quantization:
        note(f"{llm.model.weight_formats()} weights: {llm.model.weight_bytes() / 2**20:.1f} MiB resident")
    llm.calibrate()  # early exit's bank, once per model + drafter, with its progress bars
    if llm.early_exit is not None and (warning := exit_room_note(llm.early_exit.bank.summary)):
        note(warning)
    if getattr(args, "no_tune", True) is False and args.draft is None and args.speculative_config is None:
        use_tuned(llm)
    return llm


def scheduling(args: argparse.Namespace) -> dict:
    """The engine's scheduling settings the command has: serve's flags, generate's and chat's whole prompts."""
    names = ("max_num_seqs", "max_num_batched_tokens", "prefill_chunk")
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


def use_tuned(llm) -> None:
    """Switch to the configuration `specee tune` stored for this model, machine and thread count, saying
    so; a profile that does not apply (or no longer can) is ignored with the reason."""
    from ..tune.profile import apply, describe, key_of, lookup, profile_path

    found = lookup(llm.model_dir, llm.fingerprint, key_of(llm))
    if found.entry is None:
        if found.note:
            note(found.note)
        return
    try:
        apply(llm, found.entry)
    except (ValueError, OSError) as e:
        note(f"ignoring the tuned profile {profile_path(llm.model_dir)}: {' '.join(str(e).split())}")
        return
    note(describe(found.entry, llm.model.device.type))


def note(message: str) -> None:
    print(f"{PROG}: note: {message}", file=sys.stderr)


LIBRARY_NAMES = {"max_tokens": "--max-new-tokens", "top_k": "--top-k", "top_p": "--top-p", "stop": "--stop",
                 "speculative_config": "--speculative-config"}


def cli_wording(message: str) -> str:
    """A library message as the CLI user reads it: the field names of SamplingParams and speculative_config
    become the flags they typed."""
    import re

    message = message.replace("max_tokens (max_new_tokens)", "max_tokens")
    return re.sub(r"\b(" + "|".join(LIBRARY_NAMES) + r")\b", lambda m: LIBRARY_NAMES[m.group(1)], message)
