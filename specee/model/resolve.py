"""Turning what the user names as a model into a loadable path.

A model is one of: a Hugging Face checkpoint directory (config.json + safetensors), a `.gguf`
file, a directory holding exactly one `.gguf`, or a Hugging Face hub id (`org/name`, or
`org/name/file.gguf` to pick one file of a repository of GGUF quantizations) found through
`huggingface_hub`, which honours its cache, `HF_HUB_OFFLINE` and a revision.
"""
from __future__ import annotations

import glob
import re
from pathlib import Path

from .weights import CheckpointError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(/[^/]+\.gguf)?$")
_HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*"]  # what a checkpoint directory needs


def is_gguf(path: Path) -> bool:
    return path.suffix.lower() == ".gguf"


def local_model(path: str | Path, what: str = "model") -> Path:
    """The checkpoint directory or .gguf file at `path` (a directory holding one .gguf gives that file)."""
    path = Path(path).expanduser()
    if not path.exists():
        kind = "file" if is_gguf(path) else "directory"  # a missing .gguf path names a file
        raise FileNotFoundError(f"{what} {kind} not found: {path}")
    if path.is_file():
        if is_gguf(path):
            return path
        raise CheckpointError(f"{path}: not a model (pass a checkpoint directory or a .gguf file)")
    if (path / "config.json").exists():
        return path
    ggufs = sorted(p for p in path.iterdir() if is_gguf(p) and p.is_file())
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        raise CheckpointError(f"{path} holds {len(ggufs)} GGUF files ({', '.join(p.name for p in ggufs)}); "
                              "pass the one to load as the model path")
    raise CheckpointError(f"{path}: no config.json (is this a Hugging Face checkpoint directory?) and no .gguf file")


def hub_snapshot(model_id: str, revision: str | None = None) -> Path:
    """The local snapshot (or file, for `org/name/file.gguf`) of a hub model, downloaded if the hub is reachable."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled
    except ImportError:
        raise FileNotFoundError(f"model directory not found: {model_id} (and huggingface_hub, which resolves "
                                "hub ids, is not installed)") from None
    parts = model_id.split("/")
    repo_id, filename = "/".join(parts[:2]), (parts[2] if len(parts) == 3 else None)
    # one file is fetched as a one-file snapshot too: hf_hub_download retries a hub it cannot reach for ~25 s
    patterns = [glob.escape(filename)] if filename else _HUB_FILES + ["*.gguf"]
    try:
        snapshot = Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
        return snapshot / filename if filename else snapshot
    except (LocalEntryNotFoundError, OfflineModeIsEnabled, HfHubHTTPError, OSError, ValueError) as e:
        detail = " ".join(str(e).split())[:300]
        at = f" at revision {revision!r}" if revision else ""
        raise FileNotFoundError(f"model {model_id!r}{at} is not a local path and could not be found in the Hugging "
                                f"Face hub cache or on the hub ({type(e).__name__}: {detail})") from None


def resolve_model(model: str | Path, revision: str | None = None, what: str = "model") -> Path:
    """A local checkpoint directory or .gguf file for `model` (a path or a hub id)."""
    if not str(model).strip():  # Path("") is the working directory, whose one .gguf file would load
        raise ValueError(f"{what} is empty: pass a checkpoint directory, a .gguf file or a hub id")
    path = Path(model).expanduser()
    if not path.exists() and _HUB_ID.match(str(model)) and not str(model).startswith("."):
        return local_model(hub_snapshot(str(model), revision), what)
    if revision is not None:  # it was ignored: the local files loaded, whatever revision was asked for
        raise ValueError(f"revision (--revision) {revision!r} applies to Hugging Face hub ids only, not to the "
                         f"local path {path}")
    return local_model(path, what)
