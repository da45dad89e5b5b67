"""The configuration `specee tune` chose, stored and found again.

One JSON file per model path under $SPECEE_TUNE_DIR (default: the specee cache's `tune/`), holding
the model's fingerprint and one entry per machine (CPU name and the int4 kernels' level, activations and build, or GPU), thread
count, quantization and dtype: what a speed ranking depends on. `generate`, `chat` and `serve`
look it up when no mode is given (`lookup`, `apply`); an entry measured under other conditions, a
changed model file or an unreadable profile is ignored with a one-line reason, so a stale
measurement never silently picks the mode.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT = "specee-tune-profile"
VERSION = 1
DIR_ENV = "SPECEE_TUNE_DIR"
KEY_FIELDS = ("machine", "threads", "quantization", "dtype")  # an entry applies only where all four match


class ProfileError(ValueError):
    """A profile file that cannot be used as written (not JSON, another format, missing fields)."""


def profile_dir() -> Path:
    from ..cache_dir import default_cache_dir

    return Path(os.environ.get(DIR_ENV) or default_cache_dir() / "tune").expanduser()


def profile_path(model_dir: str | Path) -> Path:
    """The profile of the model at this path: its name, for a reader, and a hash of the full path."""
    resolved = str(Path(model_dir).expanduser().resolve())
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(resolved).stem)[:60]
    return profile_dir() / f"{stem}-{hashlib.sha256(resolved.encode()).hexdigest()[:12]}.json"


def machine(device) -> str:
    """What the speed ranking was measured on: the CPU's name and the int4 kernels in force (their
    level, which SPECEE_CPU_LEVEL lowers, their activations and their build), or the GPU's name."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA)"
    from ..bench.report import cpu_name
    from ..model.kernels import describe

    return f"{cpu_name()} ({describe()})"


def key_of(llm) -> dict[str, Any]:
    """The conditions `llm` decodes under, as an entry's key."""
    return {"machine": machine(llm.model.device), "threads": llm.threads.choice.threads,
            "quantization": llm.quantization or "none", "dtype": str(llm.model.dtype).removeprefix("torch.")}


# ---- reading and writing -------------------------------------------------------------------------
def _check_entry(entry: Any) -> None:
    if not isinstance(entry, dict) or not isinstance(entry.get("config"), dict):
        raise ProfileError("an entry is not an object with a 'config'")
    types = {"machine": str, "threads": int, "quantization": str, "dtype": str, "measured": str, "ratio": (int, float)}
    for field, kind in types.items():
        if not isinstance(entry.get(field), kind):
            raise ProfileError(f"an entry's {field!r} is missing or not a {getattr(kind, '__name__', 'number')}")
    config = entry["config"]
    if not isinstance(config.get("label"), str):
        raise ProfileError("an entry's config has no label")
    fields = {"speculative_config": {}, "early_exit": {"draft": str, "k": int, "bank": str},
              "draft": {"path": str, "fingerprint": str}}  # what `apply` reads of each
    for field, inner in fields.items():
        value = config.get(field)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise ProfileError(f"an entry's config {field!r} is not an object")
        for name, kind in inner.items():
            if not isinstance(value.get(name), kind) or isinstance(value.get(name), bool):
                raise ProfileError(f"an entry's config {field!r} has no {name!r} {kind.__name__}")


def read_profile(path: Path) -> dict[str, Any]:
    """The profile at `path`, checked; a ProfileError saying what is wrong with it."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProfileError(f"unreadable ({type(e).__name__}: {' '.join(str(e).split())[:120]})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ProfileError(f"not a {FORMAT} file")
    if data.get("version") != VERSION:
        raise ProfileError(f"format version {data.get('version')!r}, this specee reads version {VERSION}")
    if not isinstance(data.get("fingerprint"), str) or not isinstance(data.get("entries"), list):
        raise ProfileError("no 'fingerprint' or 'entries'")
    for entry in data["entries"]:
        _check_entry(entry)
    return data


def store(model_dir: Path, fingerprint: str, entry: dict[str, Any]) -> Path:
    """Add `entry` to the model's profile, replacing the one measured under the same key (and every
    entry, when the model's weights changed or the file was unreadable). Atomic: the new file is
    written beside the old one and renamed over it, so an interrupted run leaves the old profile."""
    _check_entry(entry)
    path = profile_path(model_dir)
    try:
        old = read_profile(path)
        kept = [e for e in old["entries"] if old["fingerprint"] == fingerprint
                and any(e[f] != entry[f] for f in KEY_FIELDS)]
    except ProfileError:
        kept = []
    data = {"format": FORMAT, "version": VERSION, "model": str(Path(model_dir).resolve()), "fingerprint": fingerprint,
            "entries": kept + [entry]}
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=path.parent, prefix=f".{path.name}.",
                                     suffix=".tmp", delete=False) as f:
        tmp = Path(f.name)
        try:
            json.dump(data, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        except BaseException:
            f.close()
            tmp.unlink(missing_ok=True)
            raise
    tmp.chmod(0o644)  # as banks and heads: not secret, and readable in a shared $SPECEE_TUNE_DIR (mkstemp's 0600)
    os.replace(tmp, path)
    return path


# ---- finding and using an entry --------------------------------------------------------------------
@dataclass
class Lookup:
    entry: dict[str, Any] | None  # the entry that applies, if one does
    note: str | None  # why none applies, when a profile exists


def _mismatch(entries: list[dict[str, Any]], key: dict[str, Any], path: Path) -> str:
    """Why no entry applies: the first of the key's fields that no entry measured under the others matches."""
    pool = entries
    for field in KEY_FIELDS:
        here = [e for e in pool if e[field] == key[field]]
        if not here:
            seen = ", ".join(sorted({str(e[field]) for e in pool}))
            hint = {"machine": "`specee tune` measures this one",
                    "threads": f"--threads {seen}, or `specee tune --threads {key['threads']}`",
                    "quantization": f"--quantization {seen}, or `specee tune` with this one",
                    "dtype": f"--dtype {seen}, or `specee tune` with this one"}[field]
            what = {"machine": "on", "threads": "with threads", "quantization": "with quantization",
                    "dtype": "with dtype"}[field]
            return (f"ignoring the tuned profile {path}: measured {what} {seen}, and this run has {key[field]} "
                    f"({hint})")
        pool = here
    raise AssertionError("an entry matches every field")


def lookup(model_dir: Path, fingerprint: str, key: dict[str, Any]) -> Lookup:
    """The entry for this model under `key`; no profile file gives neither entry nor note."""
    path = profile_path(model_dir)
    if not path.exists():
        return Lookup(None, None)
    try:
        data = read_profile(path)
    except ProfileError as e:
        return Lookup(None, f"ignoring the tuned profile {path}: {e}; `specee tune` writes a new one")
    if data["fingerprint"] != fingerprint:
        return Lookup(None, f"ignoring the tuned profile {path}: it was measured on other weights (the model at "
                            f"{model_dir} changed since); `specee tune` measures these")
    for entry in data["entries"]:
        if all(entry[f] == key[f] for f in KEY_FIELDS):
            return Lookup(entry, None)
    return Lookup(None, _mismatch(data["entries"], key, path))


def apply(llm, entry: dict[str, Any]) -> None:
    """Switch `llm` to the entry's configuration. A ValueError (or OSError) where a file it names is
    gone or changed: its draft model or predictor bank."""
    from ..exit.config import EarlyExitConfig
    from ..model.weights import fingerprint_weights

    config = entry["config"]
    draft = config.get("draft")
    if draft is not None and not Path(draft["path"]).exists():
        raise ValueError(f"its draft model {draft['path']} is gone")
    if draft is not None and fingerprint_weights(Path(draft["path"])) != draft["fingerprint"]:
        raise ValueError(f"its draft model {draft['path']} changed since it was measured")
    early_exit = config.get("early_exit")
    if early_exit is not None:
        bank = Path(early_exit["bank"])
        if not (bank / "manifest.json").exists():
            raise ValueError(f"its predictor bank {bank} is gone")
        llm.enable_early_exit(EarlyExitConfig(draft=early_exit["draft"], bank=str(bank), k=early_exit["k"],
                                              mode="lossless"), config.get("speculative_config"))
    elif config.get("speculative_config") is not None:
        llm.enable_speculative(config["speculative_config"])


def describe(entry: dict[str, Any], device_type: str) -> str:
    """The note a command prints when it uses the entry."""
    what = "GPU" if device_type == "cuda" else "CPU"
    label, day = entry["config"]["label"], entry["measured"][:10]
    if entry["config"].get("speculative_config") is None and entry["config"].get("early_exit") is None:
        return f"using the tuned configuration for this model and {what} ({label}, the fastest measured on {day}; " \
               "--no-tune ignores it)"
    return (f"using the tuned configuration for this model and {what} ({label}: {entry['ratio']:.2f}x full depth, "
            f"measured {day}; --no-tune ignores it)")
