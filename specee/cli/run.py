"""`specee generate | chat | info`: decoding for a user, and what a checkpoint holds."""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

from .args import (CLIError, PROG, cli_wording, add_early_exit_args, add_model_args, add_sampling_args,
                   add_speculative_args, load_llm, note, resolve_model_dir, sampling_params)
from .outputs import print_stats, write_out


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
    p.set_defaults(func=cmd_generate, prefill_chunk=0)  # one request: no one decodes beside its prompt
    return p


def read_prompt(value: str) -> str:
    """The prompt text; an empty one (most often an unset shell variable, not a wish) and one that is not
    valid UTF-8 are refused before any work."""
    from ..tokenizer import utf8_text

    try:
        if value == "-":
            stdin = getattr(sys.stdin, "buffer", sys.stdin)  # the bytes, where the stream has them
            text = utf8_text(stdin.read(), "--prompt - (stdin)")
            text = text[:-1] if text.endswith("\n") else text  # the newline `echo` adds is not part of the prompt
        else:
            text = utf8_text(value, "--prompt")
    except ValueError as e:
        raise CLIError(str(e)) from None
    if not text.strip():
        raise CLIError("empty prompt: give the text with --prompt TEXT, or --prompt - to read it from stdin")
    return text


def use_chat_template(llm, no_chat: bool) -> bool:
    if no_chat:
        return False
    if llm.tokenizer.chat_template is None:
        note(f"{llm.model_dir} has no chat template; using the prompt as raw text (--no-chat silences this)")
        return False
    return True


def check_fits_before_loading(args: argparse.Namespace, prompt: str, params, chat_command: bool = False) -> None:
    """A prompt too long for the model's context fails here, in a second, not after the weights load
    (and, on a first run, the kernels build). The engine checks again; this is the early word. For
    `specee chat` (no prompt yet): a model without a chat template, or a --max-new-tokens past the context."""
    from ..engine.scheduler import check_fits
    from ..model.llama import model_config
    from ..tokenizer import Tokenizer

    model_dir = resolve_model_dir(args.model, args.revision)
    context = model_config(model_dir).context_limit  # first: it names a truncated or corrupt file as such
    try:
        tokenizer = Tokenizer(model_dir)
    except (ValueError, OSError):
        return  # loading says what is wrong with the checkpoint, weights first
    if chat_command and tokenizer.chat_template is None:
        raise CLIError(f"{model_dir} has no chat template, which chat needs; "
                       "use `specee generate --no-chat --prompt ...` for raw text")
    chat = chat_command or not args.no_chat and tokenizer.chat_template is not None
    system = [{"role": "system", "content": args.system}] if getattr(args, "system", None) else []
    ids = tokenizer.encode_chat([*system, {"role": "user", "content": prompt}]) if chat else tokenizer.encode(prompt)
    try:
        check_fits(context, len(ids), params.max_tokens)
    except ValueError as e:
        raise CLIError(f"{'--max-new-tokens' if chat_command else '--prompt'}: {cli_wording(str(e))}") from None


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = read_prompt(args.prompt)
    params = sampling_params(args)  # before loading, so bad values fail fast
    check_fits_before_loading(args, prompt, params)
    llm = load_llm(args)
    chat = use_chat_template(llm, args.no_chat)
    if args.kv_cache_memory is None:  # one request: a pool its size (LLM.fit_kv_cache says why)
        llm.fit_kv_cache(len(llm.encode(prompt, chat)) + params.max_tokens)
    if args.json:
        out = llm.generate(prompt, params, chat=chat)[0]
        print(json.dumps({"model": str(llm.model_dir), "prompt": prompt, "chat": chat, "text": out.text,
                          "prompt_token_ids": out.prompt_token_ids, "token_ids": out.token_ids,
                          "finish_reason": out.finish_reason, "error": out.error, "stats": out.stats.as_dict(),
                          "quantization": llm.quantization, "weight_bytes": llm.model.weight_bytes()}, ensure_ascii=False))
    else:
        for delta in llm.stream(prompt, params, chat=chat):
            write_out(delta)
        write_out("\n")
        out = llm.last_output
        if out.finish_reason != "error":
            print_stats(out.stats, args.stats)
    if out.finish_reason == "error":
        raise CLIError(out.error)
    return 0


# ---- specee chat ---------------------------------------------------------------------------
CHAT_HELP = ("commands: /reset clears the conversation, /help shows this, /exit or /quit (or end of input) quits; "
             "a line starting with // is sent with one /")


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
    p.set_defaults(func=cmd_chat, prefill_chunk=0)  # one request at a time: its prompt prefills at once
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
    check_fits_before_loading(args, "", params, chat_command=True)
    llm = load_llm(args)
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages: list[dict[str, str]] = list(start)
    if sys.stdin.isatty():
        print(f"chatting with {llm.model_dir} ({CHAT_HELP})", file=sys.stderr)
    while True:
        line = read_line(">>> ")
        command = None if line is None else line.strip()
        if command is None or command in ("/exit", "/quit"):
            return 0
        if command.startswith("//"):  # text that begins with a slash
            line = line.replace("//", "/", 1)
        elif command.startswith("/"):  # a command, never sent to the model
            if command == "/reset":
                messages = list(start)
                note("conversation cleared")
            else:
                note(CHAT_HELP if command == "/help" else f"unknown command {command.split()[0]}; {CHAT_HELP}")
            continue
        if not command:
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
        if out.finish_reason == "error":
            messages.pop()
            print(f"{PROG}: error: {out.error} (/reset starts a new conversation)", file=sys.stderr)
            continue
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
    from ..model.weights import find_weight_files, open_safetensors

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
    """(config, parameter count, bytes, tokenizer vocabulary, has a chat template) from a GGUF's header;
    the tensors are checked for NaN / Inf too (from their scales: ~20 ms for SmolLM2)."""
    from ..model.gguf import check_finite, check_tensor_types, config_from_gguf, open_gguf

    gguf_file = open_gguf(path)
    cfg = config_from_gguf(gguf_file, path)
    check_tensor_types(gguf_file, path)
    for tensor in gguf_file.tensors:
        check_finite(tensor, path)
    return (cfg, sum(int(t.n_elements) for t in gguf_file.tensors), path.stat().st_size, gguf_file.vocab_size,
            "tokenizer.chat_template" in gguf_file.metadata)


def model_info(model_dir: Path) -> dict[str, Any]:
    from ..model.config import ModelConfig
    from ..model.resolve import is_gguf
    from ..tokenizer import Tokenizer

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
