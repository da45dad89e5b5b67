"""Tokenizer, chat template and incremental detokenization for a checkpoint directory or GGUF file.

Wraps the `tokenizers` library (the same `tokenizer.json` transformers uses; for a GGUF, the
tokenizer transformers converts from its metadata, stored once converted) and renders the Jinja
chat template the way transformers does.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import threading
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError, nodes
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from .cache_dir import default_cache_dir
from .files import replacing


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # older tokenizer_config stores AddedToken dicts
        return value.get("content")
    return value


def utf8_text(text: str | bytes, what: str = "prompt") -> str:
    """`text` as valid Unicode, or a one-line ValueError naming the first bad byte: bytes must be UTF-8,
    and a str must not hold lone surrogates (what Python makes of undecodable bytes in argv or a file
    read with errors="surrogateescape"). Refused rather than replaced: the model would read U+FFFD,
    not what the user meant."""
    if isinstance(text, bytes):
        try:
            return text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{what} is not valid UTF-8: byte 0x{text[e.start]:02x} at position {e.start}; "
                             "convert it to UTF-8 (e.g. with iconv)") from None
    if not isinstance(text, str):
        raise TypeError(f"{what} must be a str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        char = ord(text[e.start])
        bad = f"byte 0x{char - 0xDC00:02x}" if 0xDC80 <= char <= 0xDCFF else f"lone surrogate U+{char:04X}"
        raise ValueError(f"{what} is not valid UTF-8: {bad} at position {e.start}; convert it to UTF-8 "
                         "(e.g. with iconv)") from None
    return text


# Characters past which a text is encoded through `encode_batch`, which releases the GIL while it works:
# `encode` holds it, so a server's 4 MB prompt stopped its event loop, every stream with it, for 3 s
LONG_TEXT = 1 << 16


class Tokenizer:
    """source: a checkpoint directory (tokenizer.json, tokenizer_config.json) or a .gguf file."""

    def __init__(self, source: str | Path):
        source = Path(source)
        if source.suffix.lower() == ".gguf":
            self.tok, config, template = _read_gguf(source)
        else:
            self.tok, config, template = _read_directory(source)
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.pad_token = _token_text(config.get("pad_token"))
        self.unk_token = _token_text(config.get("unk_token"))
        if isinstance(template, list):  # named templates: use the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template: str | None = template
        self.source = source
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.tok.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self.token_id(self.pad_token)

    def encode(self, text: str | bytes, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (a str, or UTF-8 bytes); text that is not valid UTF-8 is refused (utf8_text)."""
        text = utf8_text(text, "text")
        if len(text) > LONG_TEXT:  # the same ids; encode_batch lets other threads run meanwhile
            return self.tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template; pass raw text (CLI: --no-chat)")
        # like transformers, only the special tokens the tokenizer has are defined in the template
        specials = {k: v for k, v in (("bos_token", self.bos_token), ("eos_token", self.eos_token),
                                      ("unk_token", self.unk_token), ("pad_token", self.pad_token)) if v is not None}
        _steps.left = TEMPLATE_STEPS
        try:
            return _compiled(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, tools=None, documents=None, **specials)
        except (TemplateError, OverflowError, RecursionError, MemoryError) as e:  # the file's template is untrusted
            raise ValueError(f"{self.source}: chat template error: {' '.join(str(e).split()) or type(e).__name__}") from None

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        # The template already places any special tokens; transformers encodes it without adding more.
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)


# Loop iterations and repeated elements one render may spend: a template from a model file is untrusted, and
# the sandbox caps each range at 100,000 but not loops inside loops (two nested ones hung the CLI). Chat
# templates of real models spend a few hundred.
TEMPLATE_STEPS = 1_000_000
_steps = threading.local()


def _spend(n: int) -> None:
    _steps.left = getattr(_steps, "left", TEMPLATE_STEPS) - n
    if _steps.left < 0:
        raise TemplateError(f"the template runs past {TEMPLATE_STEPS} loop steps")


def _counted(iterable):
    for item in iterable:
        _spend(1)
        yield item


class _BudgetEnvironment(ImmutableSandboxedEnvironment):
    """Loops (each iterates through `_counted`) and sequence repetition ("x" * n) spend from the render's budget."""

    intercepted_binops = frozenset({"*"})

    def _parse(self, source, name, filename):
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):
            loop.iter = nodes.Call(nodes.Name("_counted", "load"), [loop.iter], [], None, None)
        return tree

    def call_binop(self, context, operator: str, left, right):
        if operator == "*":
            seq, times = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(seq, (str, list, tuple)) and isinstance(times, int):
                _spend(len(seq) * max(times, 0))
        return super().call_binop(context, operator, left, right)


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    """A chat template compiled once (about a millisecond per request otherwise, on a server's event loop),
    in the environment transformers renders templates in: loop controls, a tojson that does not
    HTML-escape, strftime_now (Llama 3.x templates date their system prompt with it)."""
    env = _BudgetEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])

    def raise_exception(message: str) -> None:
        raise ValueError(f"chat template error: {message}")

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env.globals["raise_exception"] = raise_exception
    env.globals["_counted"] = _counted
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = tojson
    return env.from_string(template)


def _read_directory(model_dir: Path) -> tuple[HFTokenizer, dict[str, Any], Any]:
    path = model_dir / "tokenizer.json"
    if not path.exists():
        raise FileNotFoundError(f"{model_dir}: no tokenizer.json (specee needs a fast-tokenizer file)")
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    template_file = model_dir / "chat_template.jinja"
    template = template_file.read_text() if template_file.exists() else config.get("chat_template")
    return HFTokenizer.from_file(str(path)), config, template


def _read_gguf(path: Path) -> tuple[HFTokenizer, dict[str, Any], Any]:
    """The tokenizer transformers converts from a GGUF's metadata (vocabulary, merges, pre-tokenizer,
    special tokens, chat template): the same conversion `AutoTokenizer.from_pretrained(gguf_file=)` runs.
    The conversion (4-5 s with transformers' import, SmolLM2 on an Intel Xeon) runs once per file:
    its result is stored under the cache directory (`gguf_tokenizer_cache`) and read back in
    milliseconds; kept in memory too, as a draft's tokenizer is read twice (checked against the
    target's before any weights load, then by the drafter)."""
    stat = path.stat()
    return _cached_gguf(path.resolve(), stat.st_mtime_ns, stat.st_size)


def gguf_tokenizer_cache(path: Path) -> Path:
    """Where the tokenizer converted from the GGUF at `path` is stored: keyed by the file's metadata
    bytes (all the conversion reads), and by the transformers and tokenizers versions that convert and
    read it. Not by the file's path or date: a copy, a move or a download again finds the same entry,
    where a key by path left a new 2 MB file in the cache for every temporary copy a test wrote."""
    from .model.gguf import open_gguf
    from .model.weights import CheckpointError

    try:
        digest = hashlib.sha256(open_gguf(path).metadata_digest.encode())
    except CheckpointError:  # unreadable: the conversion that follows says why
        digest = hashlib.sha256(str(path).encode())
    for package in ("transformers", "tokenizers"):
        try:
            digest.update(importlib.metadata.version(package).encode())
        except importlib.metadata.PackageNotFoundError:
            digest.update(b"-")
    return default_cache_dir() / "tokenizers" / f"gguf-{digest.hexdigest()[:24]}.json"


@functools.lru_cache(maxsize=2)
def _cached_gguf(path: Path, _mtime_ns: int, _size: int) -> tuple[HFTokenizer, dict[str, Any], Any]:
    stored = gguf_tokenizer_cache(path)
    try:
        saved = json.loads(stored.read_text())
        return HFTokenizer.from_str(saved["tokenizer"]), saved["specials"], saved["chat_template"]
    except Exception:  # absent, unreadable or damaged (tokenizers raises a bare Exception): convert again
        pass
    tok, specials, template = _convert_gguf(path)
    try:  # best effort: a read-only cache only costs the next run the conversion again
        with replacing(stored) as partial:  # whole or not at all, for a concurrent reader
            partial.write_text(json.dumps({"tokenizer": tok.to_str(), "specials": specials, "chat_template": template}))
    except OSError:
        pass
    return tok, specials, template


def _convert_gguf(path: Path) -> tuple[HFTokenizer, dict[str, Any], Any]:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ImportError("reading the tokenizer of a GGUF file needs transformers: pip install 'specee[gguf]'") from None
    try:
        hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # noqa: BLE001 -- third-party code parsing an untrusted file raises anything (bare Exception too)
        raise ValueError(f"{path}: cannot build the tokenizer from the GGUF metadata ({' '.join(str(e).split())})") from None
    specials = {k: getattr(hf, k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    return hf.backend_tokenizer, specials, hf.chat_template


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without re-decoding everything.

    Decodes a short window (prefix_offset..) and holds back text ending in an incomplete
    UTF-8 sequence, so multi-byte characters split across tokens stream correctly. When the
    output ends, `flush` releases what is still held (a dangling partial character decodes
    to U+FFFD, as a whole-sequence decode gives it).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]):
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids[-4:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """The text still held back (the output ended): decoded as it stands."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            delta = full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return delta
        return ""
