"""argparse `type=` converters: each checks one flag's value as it is parsed, so a bad value fails
before any model loads (with argparse's one-line error naming the flag)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..engine.scheduling import swap_space_bytes

MAX_K = 64  # speculative tokens per step (speculative/config.py's MAX_SPECULATIVE_TOKENS): SpecEE uses 4


def _int_at_least(value: str, low: int, what: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a {what} integer, got {value!r}") from None
    if n < low:
        raise argparse.ArgumentTypeError(f"expected a {what} integer, got {value!r}")
    return n


def _float_where(value: str, ok, what: str) -> float:
    try:
        x = float(value)
    except ValueError:
        x = None
    if x is None or not ok(x):
        raise argparse.ArgumentTypeError(f"expected {what}, got {value!r}")
    return x


def non_negative_float(value: str) -> float:
    return _float_where(value, lambda x: 0 <= x < float("inf"), "a finite number >= 0")


def positive_float(value: str) -> float:
    return _float_where(value, lambda x: 0 < x < float("inf"), "a finite number > 0")


def probability(value: str) -> float:
    return _float_where(value, lambda x: 0 < x <= 1, "a number in (0, 1]")


def positive_int(value: str) -> int:
    return _int_at_least(value, 1, "positive")


def positive_int_list(value: str) -> list[int]:
    """Comma-separated positive integers ("1,4,16")."""
    parts = [v.strip() for v in value.split(",") if v.strip()]
    if not parts or not all(v.isdecimal() and int(v) > 0 for v in parts):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {value!r}")
    return [int(v) for v in parts]


def non_negative_int(value: str) -> int:
    return _int_at_least(value, 0, "non-negative")


def seed_int(value: str) -> int:
    from ..sampling import SEED_LIMIT

    n = _int_at_least(value, 0, "non-negative")
    if n >= SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"expected a seed below 2**64, got {value!r}")
    return n


def port_number(value: str) -> int:
    n = _int_at_least(value, 1, "positive")
    if n > 65535:
        raise argparse.ArgumentTypeError(f"expected a port from 1 to 65535, got {value!r}")
    return n


def prefill_chunk_arg(value: str) -> int:
    from ..engine.scheduling import PREFILL_CHUNK_RULE, prefill_chunk_allowed

    n = _int_at_least(value, 0, "non-negative")
    if not prefill_chunk_allowed(n):
        raise argparse.ArgumentTypeError(f"expected {PREFILL_CHUNK_RULE}, got {value!r}")
    return n


def draft_tokens(value: str) -> int:
    """--draft-tokens of `specee bench`: 0 (one token per pass) to MAX_K, as --k and num_speculative_tokens."""
    n = _int_at_least(value, 0, "non-negative")
    if n > MAX_K:
        raise argparse.ArgumentTypeError(f"expected 0 to {MAX_K} draft tokens per pass, got {value!r}")
    return n


def speculative_k(value: str) -> int:
    """--k: checked here, before a model loads or a calibration starts (a huge k would fail minutes later)."""
    k = _int_at_least(value, 1, "positive")
    if k > MAX_K:
        raise argparse.ArgumentTypeError(f"--k {k} is too large: at most {MAX_K} speculative tokens per step "
                                         "(SpecEE uses 4)")
    return k


def device_arg(value: str) -> str:
    if value == "cpu" or value == "cuda" or (value.startswith("cuda:") and value[5:].isdigit()):
        return value
    raise argparse.ArgumentTypeError(f"invalid device {value!r} (choose cpu, cuda or cuda:N)")


def existing_path(value: str) -> str:
    """A file or directory that must exist (--data, --bank): checked before any model loads."""
    if not Path(value).expanduser().exists():
        raise argparse.ArgumentTypeError(f"no such file or directory: {value!r}")
    return value


def text_file(value: str) -> str:
    """A readable, non-empty text file (--ppl-file): a directory or an empty file failed after the run's
    other parts, naming no flag."""
    path = Path(existing_path(value)).expanduser()
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{value!r} is not a file")
    try:
        with path.open(encoding="utf-8") as f:
            if not f.read(4096).strip():
                raise argparse.ArgumentTypeError(f"{value!r} holds no text")
    except (OSError, UnicodeDecodeError) as e:
        raise argparse.ArgumentTypeError(f"cannot read {value!r} as UTF-8 text ({e})") from None
    return value


def bank_dir(value: str) -> str:
    """--bank: a directory holding a bank's files (a wrong one failed only after the model had loaded)."""
    from ..exit.bank import PredictorBank

    try:
        PredictorBank.check_files(Path(existing_path(value)).expanduser())
    except (OSError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def swap_space_arg(value: str) -> float:
    """--swap-space: GiB, checked as LLM checks it."""
    try:
        gib = float(value)
        swap_space_bytes(gib)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not GiB of host memory from 0 to 1 PiB") from None
    return gib


def kv_cache_memory_arg(value: str) -> int | str:
    """--kv-cache-memory: a token count, or a size with a unit (checked here, converted with the model)."""
    from ..engine.kv_manager import MAX_KV_MEMORY, SIZE, size_bytes

    if value.strip().isdigit() and 0 < int(value) <= MAX_KV_MEMORY:
        return int(value)
    if not SIZE.fullmatch(value) or not value.strip()[:1].isdigit():
        raise argparse.ArgumentTypeError(f"{value!r} is not a token count or a size like 512MiB or 2GB")
    try:
        size_bytes(value)
    except ValueError as e:  # no memory, or past 1 PiB
        raise argparse.ArgumentTypeError(str(e).split(": ", 1)[1]) from None
    return value


def speculative_config_arg(value: str) -> dict:
    try:
        config = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {value!r}") from None
    if not isinstance(config, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}")
    return config
