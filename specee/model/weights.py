"""Reading a Hugging Face checkpoint directory's safetensors weights (single or sharded)."""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .config import ModelConfig


class CheckpointError(ValueError):
    """The checkpoint directory is missing files or holds weights that do not fit its config."""


def find_weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted({model_dir / f for f in shard_names(index)})
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"{model_dir}: shards listed in {index.name} are missing: {', '.join(missing)}")
        return files
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")):
        raise CheckpointError(
            f"{model_dir}: only pickle weights (*.bin/*.pt) found; specee loads safetensors only "
            "(convert with transformers: model.save_pretrained(dir, safe_serialization=True))"
        )
    raise CheckpointError(f"{model_dir}: no model.safetensors or model.safetensors.index.json found")


def shard_names(index: Path) -> set[str]:
    """The shard files a safetensors index lists (its weight_map's values: names in its directory)."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        reason = f"no {e}" if isinstance(e, KeyError) else " ".join(str(e).split())
        raise CheckpointError(f"{index}: not a valid safetensors index ({reason})") from None
    names = set(weight_map.values()) if isinstance(weight_map, dict) else None
    if not names or not all(isinstance(n, str) and n and Path(n).name == n for n in names):
        raise CheckpointError(f"{index}: weight_map must map tensor names to shard file names in its directory")
    return names


@contextmanager
def open_safetensors(file: Path) -> Iterator:
    """safe_open, with a truncated or corrupt file reported as a one-line CheckpointError."""
    try:
        with safe_open(str(file), framework="pt") as f:
            yield f
    except SafetensorError as e:
        raise CheckpointError(f"{file}: not a readable safetensors file (truncated or corrupt: {e})") from None


def read_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in find_weight_files(model_dir):
        with open_safetensors(file) as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
                if not torch.isfinite(tensors[name]).all():  # a corrupt file: refused before it is used
                    raise CheckpointError(f"{file}: tensor {name} holds NaN or infinite values (the file is corrupt)")
    return tensors


def fingerprint_weights(path: Path) -> str:
    """A cheap identity for a checkpoint directory or GGUF file: its configuration plus strided samples
    of several tensors' values (a few KB read, not the GBs of the whole file)."""
    path = Path(path)
    if path.suffix.lower() == ".gguf":
        from .gguf import fingerprint_gguf

        return fingerprint_gguf(path)
    h = hashlib.sha256((path / "config.json").read_bytes())
    for file in find_weight_files(path):
        h.update(f"{file.name}:{file.stat().st_size}".encode())
        with open_safetensors(file) as f:
            names = sorted(f.keys())
            h.update("\n".join(names).encode())
            for name in names[:: max(1, len(names) // 8)]:  # about 8 tensors, spread over the layers
                tensor = f.get_slice(name)
                rows = tensor.get_shape()[0] if tensor.get_shape() else 0
                for row in range(0, rows, max(1, rows // 8)):  # about 8 rows each
                    h.update(tensor[row : row + 1].float().numpy().tobytes())
    return h.hexdigest()[:16]


def take(tensors: dict[str, torch.Tensor], name: str, shape: tuple[int, ...], source: Path) -> torch.Tensor:
    if name not in tensors:
        raise CheckpointError(f"{source}: weight {name!r} is missing")
    t = tensors.pop(name)
    if tuple(t.shape) != shape:
        raise CheckpointError(f"{source}: weight {name!r} has shape {tuple(t.shape)}, config implies {shape}")
    return t


def check_config_fits(cfg: ModelConfig, tensors: dict[str, torch.Tensor], source: Path) -> None:
    extra = [n for n in tensors if not n.endswith("rotary_emb.inv_freq")]
    if extra:
        raise CheckpointError(f"{source}: unexpected weights not used by {cfg.architecture}: {extra[:5]}")
