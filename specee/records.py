"""Prompt and record files, read one way everywhere.

Calibration prompts, draft-head training text, self-distillation instructions and benchmark prompt
sets all come from the same kinds of files (alpaca-style .json lists, {"text"} .jsonl, Spec-Bench /
MT-Bench `turns`, plain .txt lines). Reading them and taking a record's question in one place keeps
a file meaning the same thing to every command, with the same one-line error when it is broken.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def data_files(path: Path, suffixes: tuple[str, ...], what: str) -> list[Path]:
    """`path` itself, or the files with these suffixes in directory `path`, sorted by name so that
    any interleaving or limit applied to their records is reproducible. FileNotFoundError naming
    `what` when there is nothing to read."""
    if not path.exists():
        raise FileNotFoundError(f"{what} not found: {path}")
    if not path.is_dir():
        return [path]
    files = sorted(p for p in path.iterdir() if p.suffix in suffixes)
    if not files:
        raise FileNotFoundError(f"{path}: no {what} in it (looked for {', '.join(suffixes)} files)")
    return files


def read_file(path: Path) -> list[Any]:
    """The records of one file: a .json list (or the first list in a top-level object, as in
    {"data": [...]}), one JSON value per non-blank line of a .jsonl, else one string per non-blank
    line ("\\n" in a line stands for a newline, so one line can hold a multi-line prompt).
    ValueError on one line naming the file (and the line of a .jsonl) on bad JSON or bad UTF-8."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e})") from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if path.suffix == ".jsonl":
        return [_parse(path, line, n) for n, line in lines]
    if path.suffix == ".json":
        data = _parse(path, text)
        if isinstance(data, dict):
            data = next((v for v in data.values() if isinstance(v, list)), None)
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list of records (or an object holding one)")
        return data
    return [line.replace("\\n", "\n") for _, line in lines]


def _parse(path: Path, text: str, line: int | None = None) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        if line is None:
            raise ValueError(f"{path}: bad JSON ({e})") from None
        raise ValueError(f"{path}, line {line}: bad JSON ({e.msg} at column {e.colno})") from None


def question(rec: Any) -> str | None:
    """The question a record asks, stripped, or None (raw text asks none): an alpaca instruction
    with its input after a blank line; else the first of the MT-Bench / Spec-Bench `turns` (later
    turns follow the model's own first answer, which a fixed file cannot hold), `prompt` or `question`."""
    if not isinstance(rec, dict):
        return None
    instruction = _stripped(rec.get("instruction"))
    if instruction:
        extra = _stripped(rec.get("input"))
        return f"{instruction}\n\n{extra}" if extra else instruction
    for key in ("turns", "prompt", "question"):
        value = rec.get(key)
        value = _stripped(value[0] if isinstance(value, list) and value else value)
        if value:
            return value
    return None


def raw_text(rec: Any) -> str | None:
    """The text of a raw-text record ({"text": ...}, or a line of a .txt file), stripped; None if none."""
    return _stripped(rec.get("text") if isinstance(rec, dict) else rec)


def _stripped(value: Any) -> str | None:
    if not isinstance(value, str):
        return None
    return value.strip() or None
