"""The `specee` command line: `specee generate | chat | info` (also `python -m specee`).

Layout, so that more subcommands and flags slot in without touching the others:

* `add_model_args(parser)`    --model / --device / --dtype, shared by every command that loads a model
* `add_sampling_args(parser)` --max-new-tokens / --temperature / --top-k / --top-p / --seed / --stop
* `load_llm(args)`            the one place an `LLM` is built from parsed arguments (early-exit
                              options such as --draft / --bank / --no-exit / --mode belong here)
* one `add_<name>_parser(subparsers)` + one `cmd_<name>(args) -> int` per subcommand, listed in
  `SUBCOMMANDS`; `main(argv=None)` parses, dispatches and turns library errors into one line
  `specee: error: ...` with exit status 2.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

PROG = "specee"
DEFAULT_MODEL = Path("../shared/models/smollm2-135m-instruct")  # SmolLM2-135M-Instruct, a GGUF file
REFERENCE_MODEL = "ref-target-24L"  # the project's reference target: ref-draft-4L is its default drafter
MAX_K = 64  # speculative tokens per step: SpecEE uses 4; features and predictors grow with k
REPO_ROOT = Path(__file__).resolve().parents[1]
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
EXIT_USAGE = 2  # bad arguments or a library error (argparse uses 2 as well)


class CLIError(Exception):
    """A user-facing error: printed as `specee: error: <message>` and exit status 2."""


# ---- shared arguments ----------------------------------------------------------------------
def default_model_candidates() -> list[Path]:
    """Where the default model may live: relative to the current directory, then to the repo root."""
    return [Path.cwd() / DEFAULT_MODEL, REPO_ROOT / DEFAULT_MODEL]


def resolve_model_dir(model: str | None, revision: str | None = None) -> Path:
    """The checkpoint directory or .gguf file --model names (a path or a hub id), or the default model."""
    from .model.resolve import resolve_model

    if model is not None:
        return resolve_model(model, revision)
    candidates = default_model_candidates()
    for path in candidates:
        if path.is_dir():
            return resolve_model(path.resolve())
    looked = ", ".join(str(p) for p in dict.fromkeys(candidates))
    raise CLIError(f"no --model given and the default model {DEFAULT_MODEL} was not found (looked in {looked}); "
                   "pass --model PATH (a checkpoint directory or .gguf file) or a Hugging Face hub id")


def device_arg(value: str) -> str:
    if value == "cpu" or value == "cuda" or (value.startswith("cuda:") and value[5:].isdigit()):
        return value
    raise argparse.ArgumentTypeError(f"invalid device {value!r} (choose cpu, cuda or cuda:N)")


def add_model_args(parser: argparse.ArgumentParser, runtime: bool = True, fastest: bool = False) -> None:
    """--model, plus --device, --dtype and --quantization when the command runs the model; `fastest`:
    the command decodes for a user (generate, chat), so its defaults are the fastest measured."""
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


QUANTIZATION_HELP = ("weight-only quantized linears: int4 (groups of 32), int8 (per channel), auto (a GGUF's "
                     "own precision: Q4 -> int4, Q5/Q6/Q8 -> int8, float -> none) or none (float weights)")
FASTEST_QUANTIZATION = {"cpu": "auto"}  # measured on SmolLM2 Q4_1, 2 CPU threads: 3.9x float32 (BENCHMARKS.md)


def add_quantization_arg(group, fastest: bool = False) -> None:
    """--quantization, for every command that runs a model (shared with `specee bench`)."""
    default = ("auto on CPU (the fastest measured; a checkpoint with float weights stays float), none on CUDA"
               if fastest else "none")
    group.add_argument("--quantization", choices=("int4", "int8", "auto", "none"), default=None,
                       help=f"{QUANTIZATION_HELP}; default: {default}")
    group.set_defaults(fastest_quantization=fastest)


def quantization_mode(args: argparse.Namespace) -> str | None:
    """The quantization LLM(...) gets: the flag, else the command's default for the device."""
    mode = args.quantization
    if mode is None and getattr(args, "fastest_quantization", False):
        mode = FASTEST_QUANTIZATION.get(args.device)
    return None if mode == "none" else mode


def _int_at_least(value: str, low: int, what: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a {what} integer, got {value!r}") from None
    if n < low:
        raise argparse.ArgumentTypeError(f"expected a {what} integer, got {value!r}")
    return n


def positive_int(value: str) -> int:
    return _int_at_least(value, 1, "positive")


def non_negative_int(value: str) -> int:
    return _int_at_least(value, 0, "non-negative")


def speculative_k(value: str) -> int:
    """--k: checked here, before a model loads or a calibration starts (a huge k would fail minutes later)."""
    k = _int_at_least(value, 1, "positive")
    if k > MAX_K:
        raise argparse.ArgumentTypeError(f"--k {k} is too large: at most {MAX_K} speculative tokens per step "
                                         "(SpecEE uses 4)")
    return k


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=positive_int, default=128, metavar="N",
                   help="most tokens to generate (default: 128)")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0 = greedy (default), > 0 samples")
    g.add_argument("--top-k", type=int, default=0, metavar="K", help="sample among the k most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (1.0 = off)")
    g.add_argument("--seed", type=int, default=None, metavar="N", help="random seed for sampling (reproducible runs)")
    g.add_argument("--stop", nargs="+", action="extend", default=[], metavar="S",
                   help="stop when any of these strings is produced (not included in the output)")


def sampling_params(args: argparse.Namespace):
    from .sampling import SamplingParams

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
    g.add_argument("--bank", metavar="DIR", default=None,
                   help="predictor bank from `specee calibrate` (default: calibrate once and cache it under "
                        "~/.cache/specee, or $SPECEE_CACHE)")
    g.add_argument("--no-exit", action="store_true", help="run every token at full depth, even with --draft")
    g.add_argument("--mode", choices=("lossy", "lossless"), default="lossy",
                   help="lossy: SpecEE's early exit; lossless: exits are drafts verified by the full model, "
                        "output identical to full depth (default: lossy)")
    g.add_argument("--kv-policy", choices=("skip", "propagate", "recompute"), default="recompute",
                   help="how the KV entries of skipped layers are filled (default: recompute, exact)")
    g.add_argument("--k", type=speculative_k, default=4, help=f"speculative tokens per step, 1-{MAX_K} (default: 4)")
    g.add_argument("--threshold-scale", type=float, default=1.0, metavar="S",
                   help="scale the bank's thresholds' distance from 1: > 1 exits more, < 1 less (default: 1)")
    g.add_argument("--max-pending", type=positive_int, default=8, metavar="N",
                   help="carried rows / unverified tokens before a forced full-depth step (default: 8)")
    g.add_argument("--offline-size", type=positive_int, default=None, metavar="N",
                   help="offline predictor layers to use (default: the bank's set)")
    g.add_argument("--online-window", type=int, default=4, metavar="N",
                   help="recent tokens whose exit layers get online predictors (default: 4; 0 = off)")


def default_draft(model_dir: Path) -> Path | None:
    """`specee calibrate`'s drafter when none is given: the reference draft, for the project's
    reference model (a bank for the pair its figures are measured on)."""
    if model_dir.is_dir() and model_dir.name == REFERENCE_MODEL:
        draft = model_dir.parent / DEFAULT_DRAFT.name
        return draft if draft.is_dir() else None
    return None


def early_exit_config(args: argparse.Namespace):
    """The EarlyExitConfig the flags ask for, or None for full depth."""
    from .engine.early_exit import EarlyExitConfig

    if getattr(args, "no_exit", True):
        return None
    if args.draft is None:
        if args.bank is not None or args.mode == "lossless":
            raise CLIError("early exit needs a drafter: pass --draft DIR (a draft model) or --draft ngram")
        return None
    return EarlyExitConfig(draft=str(args.draft), bank=args.bank, k=args.k, kv_policy=args.kv_policy, mode=args.mode,
                           offline_size=args.offline_size, online_window=args.online_window,
                           max_pending=args.max_pending, threshold_scale=args.threshold_scale)


# ---- speculative decoding (specee.spec) ----------------------------------------------------
def speculative_config_arg(value: str) -> dict:
    try:
        config = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {value!r}") from None
    if not isinstance(config, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}")
    return config


def add_speculative_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument_group("speculative decoding").add_argument(
        "--speculative-config", type=speculative_config_arg, default=None, metavar="JSON",
        help='draft-and-verify decoding, lossless, as in vLLM: \'{"method": "eagle", "model": HEAD_DIR, '
             '"num_speculative_tokens": 4}\' (methods: eagle, draft_model with a model dir, ngram; optional '
             '"tree": {"topk": K, "size": S}). Replaces early exit')


def load_llm(args: argparse.Namespace):
    """Build the LLM the command asked for (the single place model-loading options are read)."""
    import torch

    from .engine.llm import LLM

    model_dir = resolve_model_dir(args.model, args.revision)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise CLIError(f"--device {args.device}: CUDA is not available (torch {torch.__version__}); use --device cpu")
    speculative = getattr(args, "speculative_config", None)
    if speculative is not None:
        from .spec.config import SpeculativeConfig

        speculative = SpeculativeConfig.parse(speculative)  # before loading: bad configs fail fast
        args.no_exit = True
    config = early_exit_config(args) if hasattr(args, "no_exit") else None
    quantization = quantization_mode(args)
    llm = LLM(model_dir, device=args.device, dtype=args.dtype, early_exit=config, quantization=quantization,
              speculative_config=speculative)
    if args.quantization:
        note(f"{quantization or 'float'} weights: {llm.model.weight_bytes() / 2**20:.1f} MiB resident")
    return llm


def stats_line(stats) -> str:
    line = (f"{stats.generated_tokens} tokens in {stats.seconds:.2f} s ({stats.tokens_per_second:.1f} tokens/s; "
            f"decode {stats.decode_tokens_per_second:.1f} tokens/s; prompt {stats.prompt_tokens} tokens)")
    ee = stats.early_exit
    if ee:
        line += (f"; early exit {ee['mode']}/{ee['kv_policy']}: mean {ee['mean_exit_layer']:.1f} of "
                 f"{ee['num_layers']} layers, {ee['exits_accepted']} exits")
        if "lossless" in ee:
            line += f", {ee['lossless']['rollbacks']} rollbacks"
    sp = stats.speculative
    if sp:
        line += (f"; speculative {sp['method']}: mean accepted length {sp['mean_accepted_length']:.2f}, "
                 f"acceptance rate {sp['acceptance_rate']:.2f}")
    return line


def print_stats(stats, detailed: bool) -> None:
    if not detailed:
        print(f"[{stats_line(stats)}]", file=sys.stderr)
        return
    for key, value in stats.as_dict().items():
        if isinstance(value, dict):
            value = json.dumps(value, sort_keys=True)
        print(f"{key:>26}: {value}", file=sys.stderr)


def note(message: str) -> None:
    print(f"{PROG}: note: {message}", file=sys.stderr)


def write_out(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


# ---- specee generate -----------------------------------------------------------------------
def add_generate_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout",
                       description="Generate a completion for one prompt. Text streams to stdout; "
                                   "a stats line goes to stderr afterwards.")
    p.add_argument("--prompt", required=True, metavar="TEXT", help="the prompt; '-' reads it from stdin")
    p.add_argument("--no-chat", action="store_true",
                   help="use the prompt as raw text (default: wrap it in the model's chat template if it has one)")
    add_model_args(p, fastest=True)
    add_sampling_args(p)
    add_early_exit_args(p)
    add_speculative_args(p)
    out = p.add_argument_group("output")
    out.add_argument("--stats", action="store_true", help="print all request statistics to stderr, one per line")
    out.add_argument("--json", action="store_true",
                     help="print one JSON object (text, token ids, finish reason, stats) instead of streaming")
    p.set_defaults(func=cmd_generate)
    return p


def read_prompt(value: str) -> str:
    if value != "-":
        return value
    text = sys.stdin.read()
    return text[:-1] if text.endswith("\n") else text  # the newline `echo` adds is not part of the prompt


def use_chat_template(llm, no_chat: bool) -> bool:
    if no_chat:
        return False
    if llm.tokenizer.chat_template is None:
        note(f"{llm.model_dir} has no chat template; using the prompt as raw text (--no-chat silences this)")
        return False
    return True


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = read_prompt(args.prompt)
    params = sampling_params(args)  # before loading, so bad values fail fast
    llm = load_llm(args)
    chat = use_chat_template(llm, args.no_chat)
    if args.json:
        out = llm.generate(prompt, params, chat=chat)[0]
        print(json.dumps({"model": str(llm.model_dir), "prompt": prompt, "chat": chat, "text": out.text,
                          "prompt_token_ids": out.prompt_token_ids, "token_ids": out.token_ids,
                          "finish_reason": out.finish_reason, "stats": out.stats.as_dict(),
                          "quantization": llm.quantization, "weight_bytes": llm.model.weight_bytes()}, ensure_ascii=False))
        return 0
    for delta in llm.stream(prompt, params, chat=chat):
        write_out(delta)
    write_out("\n")
    print_stats(llm.last_output.stats, args.stats)
    return 0


# ---- specee chat ---------------------------------------------------------------------------
CHAT_HELP = "commands: /reset clears the conversation, /exit (or end of input) quits"


def add_chat_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("chat", help="interactive multi-turn chat with the model's chat template",
                       description="Interactive chat. Each turn renders the whole conversation with the "
                                   f"model's chat template. {CHAT_HELP}.")
    p.add_argument("--system", metavar="TEXT", default=None, help="a system message that starts the conversation")
    add_model_args(p, fastest=True)
    add_sampling_args(p)
    add_early_exit_args(p)
    add_speculative_args(p)
    p.add_argument("--stats", action="store_true", help="print a stats line to stderr after every reply")
    p.set_defaults(func=cmd_chat)
    return p


def read_line(prompt: str) -> str | None:
    """One line of user input, or None at end of input; the prompt is shown only on a terminal."""
    if sys.stdin.isatty():
        try:
            return input(prompt)
        except EOFError:
            return None
    line = sys.stdin.readline()
    return line.rstrip("\r\n") if line else None


def cmd_chat(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    llm = load_llm(args)
    if llm.tokenizer.chat_template is None:
        raise CLIError(f"{llm.model_dir} has no chat template, which chat needs; "
                       "use `specee generate --no-chat --prompt ...` for raw text")
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages: list[dict[str, str]] = list(start)
    if sys.stdin.isatty():
        print(f"chatting with {llm.model_dir} ({CHAT_HELP})", file=sys.stderr)
    while True:
        line = read_line(">>> ")
        if line is None or line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = list(start)
            note("conversation cleared")
            continue
        if line.strip() == "/help":
            note(CHAT_HELP)
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        reply = []
        try:
            ids = llm.tokenizer.encode_chat(messages)
            with contextlib.closing(llm.stream(ids, params)) as stream:  # closing it stops the decode
                for delta in stream:
                    reply.append(delta)
                    write_out(delta)
        except ValueError as e:  # e.g. the conversation outgrew the context: keep the session going
            messages.pop()
            write_out("\n")
            print(f"{PROG}: error: {cli_wording(str(e))} (/reset starts a new conversation)", file=sys.stderr)
            continue
        except KeyboardInterrupt:  # Ctrl-C stops this reply; the conversation goes on with what was said
            write_out("\n")
            note("reply interrupted (Ctrl-C again at the prompt, /exit or end of input quits)")
            messages.append({"role": "assistant", "content": "".join(reply)})
            continue
        write_out("\n")
        out = llm.last_output
        messages.append({"role": "assistant", "content": out.text})
        if args.stats:
            print_stats(out.stats, False)


# ---- specee info ---------------------------------------------------------------------------
def add_info_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("info", help="show a checkpoint's parsed configuration (no weights are loaded)",
                       description="Parse a checkpoint's config.json, tokenizer and weight headers and "
                                   "print what specee will run.")
    add_model_args(p, runtime=False)
    p.add_argument("--json", action="store_true", help="print the fields as one JSON object")
    p.set_defaults(func=cmd_info)
    return p


def count_parameters(model_dir: Path) -> tuple[int, int]:
    """(parameter count, bytes on disk) from the safetensors headers, without reading tensor data."""
    from .model.weights import find_weight_files, open_safetensors

    count = size = 0
    for file in find_weight_files(model_dir):
        size += file.stat().st_size
        with open_safetensors(file) as f:
            for name in f.keys():
                n = 1
                for d in f.get_slice(name).get_shape():
                    n *= d
                count += n
    return count, size


def gguf_summary(path: Path):
    """(config, parameter count, bytes, tokenizer vocabulary, has a chat template) from a GGUF's header."""
    from .model.gguf import check_tensor_types, config_from_gguf, open_gguf

    reader = open_gguf(path)
    cfg = config_from_gguf(reader, path)
    check_tensor_types(reader, path)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    return (cfg, sum(int(t.n_elements) for t in reader.tensors), path.stat().st_size,
            None if tokens is None else len(tokens.data), "tokenizer.chat_template" in reader.fields)


def model_info(model_dir: Path) -> dict[str, Any]:
    from .model.config import ModelConfig
    from .model.resolve import is_gguf
    from .tokenizer import Tokenizer

    if is_gguf(model_dir):
        cfg, params, size, vocab, template = gguf_summary(model_dir)
    else:
        cfg = ModelConfig.from_file(model_dir / "config.json")
        params, size = count_parameters(model_dir)
        try:
            tok = Tokenizer(model_dir)
            vocab, template = tok.vocab_size, tok.chat_template is not None
        except FileNotFoundError:
            vocab, template = None, False
    info: dict[str, Any] = {
        "model": str(model_dir),
        "architecture": cfg.architecture,
        "layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "attention_heads": cfg.num_heads,
        "kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "context": cfg.max_position_embeddings,
        "sliding_window": cfg.sliding_window,
        "rope_theta": cfg.rope_theta,
        "rope_type": cfg.rope_type,
        "tied_embeddings": cfg.tie_word_embeddings,
        "qkv_bias": cfg.qkv_bias,
        "checkpoint_dtype": cfg.checkpoint_dtype,
        "parameters": params,
        "weights_bytes": size,
        "eos_token_ids": list(cfg.eos_token_ids),
        "tokenizer_vocab": vocab,
        "chat_template": template,
    }
    return info


def cmd_info(args: argparse.Namespace) -> int:
    info = model_info(resolve_model_dir(args.model, args.revision))
    if args.json:
        print(json.dumps(info))
        return 0
    gqa = " (GQA)" if info["kv_heads"] != info["attention_heads"] else ""
    window = f", sliding window {info['sliding_window']}" if info["sliding_window"] else ""
    tok = ("none (no tokenizer.json)" if info["tokenizer_vocab"] is None else
           f"{info['tokenizer_vocab']} tokens, chat template: {'yes' if info['chat_template'] else 'no'}")
    rows = [
        ("model", info["model"]),
        ("architecture", info["architecture"]),
        ("layers", info["layers"]),
        ("hidden size", f"{info['hidden_size']} (MLP {info['intermediate_size']})"),
        ("heads / kv heads", f"{info['attention_heads']} / {info['kv_heads']}{gqa}, head_dim {info['head_dim']}"),
        ("vocab", info["vocab_size"]),
        ("context", f"{info['context']} tokens{window}"),
        ("rope", f"theta {info['rope_theta']:g}, type {info['rope_type']}"),
        ("tied embeddings", "yes" if info["tied_embeddings"] else "no"),
        ("q/k/v bias", "yes" if info["qkv_bias"] else "no"),
        ("dtype", f"{info['checkpoint_dtype']} (checkpoint); runs as --dtype auto: float32 on CPU, bfloat16 on CUDA"),
        ("parameters", f"{info['parameters'] / 1e6:.2f} M ({info['weights_bytes'] / 2**20:.1f} MiB on disk)"),
        ("eos token ids", ", ".join(map(str, info["eos_token_ids"])) or "none"),
        ("tokenizer", tok),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


# ---- specee calibrate ----------------------------------------------------------------------
def add_calibrate_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("calibrate", help="train the exit predictors for a target + drafter",
                       description="Run the target at full depth over calibration prompts, record the exit "
                                   "features per layer, train one small predictor per layer, choose thresholds "
                                   "on held-out data and the offline layer set; save the bank to -o.")
    add_model_args(p)
    p.add_argument("--draft", metavar="DIR|ngram", default=None,
                   help="drafter: a draft model (directory or .gguf) or 'ngram' (default: ref-draft-4L for ref-target-24L)")
    p.add_argument("--data", metavar="PATH", default=None,
                   help="calibration prompts: a file (alpaca .json or .jsonl with text/instruction) or a "
                        "directory of them (default: ../shared/data/calibration)")
    p.add_argument("-o", "--output", metavar="BANK", required=True, help="directory to write the bank to")
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
    from .exit.calibrate import calibrate, format_summary, load_calibration_prompts

    prompts = load_calibration_prompts(args.data, limit=args.prompts)
    args.no_exit = True
    llm = load_llm(args)
    draft = args.draft if args.draft is not None else default_draft(llm.model_dir)
    if draft is None:
        raise CLIError("calibrate needs a drafter: pass --draft DIR (a draft model) or --draft ngram")
    drafter = llm.make_drafter(str(draft), args.k)
    limit = {} if args.prompts is None else {"max_prompts": args.prompts}
    bank = calibrate(llm, llm.tokenizer, drafter, prompts, k=args.k, max_new_tokens=args.max_new_tokens,
                     offline_size=args.offline_size, target_fingerprint=llm.fingerprint,
                     draft_vocab=args.draft_vocab, **limit)
    path = bank.save(args.output)
    if args.json:
        print(json.dumps(bank.manifest()))
    else:
        print(format_summary(bank))
        print(f"bank written to {path}", file=sys.stderr)
    return 0


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
    p.add_argument("-o", "--output", metavar="HEAD_DIR", required=True, help="directory to write the head to")
    p.add_argument("--minutes", type=float, default=5.0, metavar="M",
                   help="time budget for recording and training (default: 5)")
    p.add_argument("--feature-layers", type=layer_list, default=None, metavar="I,J,K",
                   help="target layers whose outputs the head reads (default: the last, EAGLE-1; three "
                        "layers, low/middle/high, fuse them as EAGLE-3 does)")
    p.add_argument("--shortlist", type=positive_int, default=None, metavar="N",
                   help="the head proposes among the N most frequent tokens of the training text (default: a quarter of the vocabulary, at most 4096)")
    p.add_argument("--data", metavar="PATH", default=None,
                   help="training text: alpaca .json / {text} .jsonl file or directory (default: ../shared/data/calibration)")
    p.add_argument("--resume", action="store_true", help="continue the training checkpoint in HEAD_DIR")
    p.add_argument("--json", action="store_true", help="print the manifest (without the shortlist) as JSON")
    p.set_defaults(func=cmd_train_draft)
    return p


def cmd_train_draft(args: argparse.Namespace) -> int:
    from .calibration import train_draft

    if args.minutes <= 0:
        raise CLIError(f"--minutes must be positive, got {args.minutes}")
    if args.dtype not in ("auto", "float32"):
        raise CLIError("train-draft trains in float32; leave --dtype out")
    args.dtype = "float32"
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
    p.add_argument("-o", "--output", metavar="FILE", required=True, help="the .json file to write")
    p.add_argument("--data", metavar="PATH", default=None,
                   help="instruction records: alpaca .json / .jsonl file or directory (default: ../shared/data/calibration)")
    p.add_argument("--max-new-tokens", type=positive_int, default=256, help="answer length cap (default: 256)")
    p.add_argument("--batch-size", type=positive_int, default=32, help="answers decoded together (default: 32)")
    p.add_argument("--minutes", type=float, default=None, metavar="M",
                   help="stop after the batch that passes this budget (default: answer every instruction)")
    p.set_defaults(func=cmd_distill)
    return p


def cmd_distill(args: argparse.Namespace) -> int:
    from .calibration.self_distill import distill

    if args.minutes is not None and args.minutes <= 0:
        raise CLIError(f"--minutes must be positive, got {args.minutes}")
    llm = load_llm(args)
    t = time.perf_counter()
    n = distill(llm, args.output, args.data, args.max_new_tokens, args.batch_size, args.minutes)
    print(f"{n} answers written to {args.output} in {time.perf_counter() - t:.0f} s")
    return 0


# ---- entry point ---------------------------------------------------------------------------
LIBRARY_NAMES = {"max_tokens": "--max-new-tokens", "top_k": "--top-k", "top_p": "--top-p"}


def cli_wording(message: str) -> str:
    """A library message as the CLI user reads it: SamplingParams field names become the flags they typed."""
    import re

    message = message.replace("max_tokens (max_new_tokens)", "max_tokens")
    return re.sub(r"\b(" + "|".join(LIBRARY_NAMES) + r")\b", lambda m: LIBRARY_NAMES[m.group(1)], message)



def add_bench_parser(sub) -> argparse.ArgumentParser:
    from .bench.cli import add_bench_parser as add

    return add(sub)


SUBCOMMANDS: list[Callable[[Any], argparse.ArgumentParser]] = [
    add_generate_parser, add_chat_parser, add_info_parser, add_calibrate_parser, add_bench_parser,
    add_train_draft_parser, add_distill_parser]


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog=PROG, description="specee: faster decoding of Hugging Face causal LMs by speculative early exiting")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 2 usage or library error, 130 interrupted)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, usage errors: argparse already printed the message
        return e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_USAGE)
    try:
        return args.func(args)
    except BrokenPipeError:  # `specee generate ... | head`: the reader left; stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except (CLIError, ValueError, OSError, ImportError) as e:
        sys.stdout.flush()
        message = cli_wording(" ".join(str(e).split()) or type(e).__name__)
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
