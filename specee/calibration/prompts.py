"""Calibration prompts: the calibration data (alpaca-style, {text} records, plain lines; read by
specee.records) as prompts, and encoding them for the target."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..records import data_files, question, raw_text, read_file

_REPO_ROOT = Path(__file__).resolve().parents[2]
_REL_CALIBRATION = Path("..") / "shared" / "data" / "calibration"


class ChatPrompt(str):
    """A calibration prompt to be sent as a user message through the chat template."""


def default_calibration_dir() -> Path | None:
    """`../shared/data/calibration`, relative to the repository root, then to the cwd."""
    for base in (_REPO_ROOT, Path.cwd()):
        p = (base / _REL_CALIBRATION).resolve()
        if p.exists():
            return p
    return None


def calibration_data(path: str | Path | None = None) -> Path:
    """`path`, or the default calibration data (see `default_calibration_dir`); without either, a
    FileNotFoundError that says where it looked, so a missing ../shared is obvious."""
    if path is not None:
        return Path(path)
    found = default_calibration_dir()
    if found is None:
        raise FileNotFoundError(
            f"no calibration data: {_REL_CALIBRATION} not found from the repository root ({_REPO_ROOT}) "
            f"or the current directory ({Path.cwd()}); pass a path to a .json/.jsonl file or directory")
    return found


def _record_prompt(rec: Any, max_chars: int) -> str | None:
    """A record's question as a `ChatPrompt`; raw text as it is, or its head (cut at a space) if long."""
    asked = question(rec)
    if asked:
        return ChatPrompt(asked)
    text = raw_text(rec)
    if text and len(text) > max_chars:  # a raw document: its head is the prompt
        cut = text.rfind(" ", 0, max_chars)
        text = text[: cut if cut > max_chars // 2 else max_chars]
    return text


def _read_prompt_file(path: Path, max_chars: int) -> list[str]:
    prompts = [p for p in (_record_prompt(r, max_chars) for r in read_file(path)) if p]
    if not prompts:
        raise ValueError(f"{path}: no prompts found (expected alpaca-style {{instruction, input}} records, "
                         "{text} records, or lines of text)")
    return prompts


def load_calibration_prompts(path: str | Path | None = None, limit: int | None = None,
                             max_chars: int = 1500) -> list[str]:
    """Calibration prompts from a file or a directory of files (default: the shared
    calibration data, /work/shared/data/calibration, found as ../shared/data/calibration from
    the repository root or the cwd). Files are read by `specee.records.read_file`.

    Records that ask a question (`specee.records.question`: alpaca {instruction, input} as the
    instruction, then the input after a blank line; or `turns`/`prompt`/`question`) become
    `ChatPrompt`s, sent through the chat template; {"text"} records (C4) are raw text, cut to
    `max_chars`; .txt files give one prompt per line. Several files are interleaved in proportion
    to their sizes, in file order, so `limit` keeps the mix.
    """
    files = data_files(calibration_data(path), (".json", ".jsonl", ".txt"), "calibration data")
    per_file = [_read_prompt_file(f, max_chars) for f in files]
    keyed = [((j + 0.5) / len(ps), i, p) for i, ps in enumerate(per_file) for j, p in enumerate(ps)]
    keyed.sort(key=lambda t: (t[0], t[1]))
    prompts = [p for _, _, p in keyed]
    return prompts[:limit] if limit is not None else prompts


def encode_prompt(tokenizer, prompt: str | list[int], chat: bool, max_prompt_tokens: int) -> list[int]:
    """Token ids of one calibration prompt: `ChatPrompt`s (all strings with chat=True) through the
    chat template, keeping the tail; raw text keeping the head; token-id lists as given (tail)."""
    if isinstance(prompt, list):
        return list(prompt)[-max_prompt_tokens:]
    as_chat = (chat or isinstance(prompt, ChatPrompt)) and tokenizer.chat_template is not None
    if as_chat:  # keep the tail: the generation prompt must survive truncation
        return tokenizer.encode_chat([{"role": "user", "content": str(prompt)}])[-max_prompt_tokens:]
    return tokenizer.encode(str(prompt))[:max_prompt_tokens]
