"""Reading a Hugging Face checkpoint directory's safetensors weights (single or sharded)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from .config import ModelConfig


class CheckpointError(ValueError):
    """The checkpoint directory is missing files or holds weights that do not fit its config."""


def find_weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / f for f in weight_map.values()})
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


def read_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in find_weight_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def fingerprint_weights(model_dir: Path) -> str:
    """A cheap identity for a checkpoint: config plus weight file names and sizes (no hashing of GBs)."""
    import hashlib

    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for file in find_weight_files(model_dir):
        h.update(f"{file.name}:{file.stat().st_size}".encode())
        with safe_open(str(file), framework="pt") as f:  # the tensor names and one slice of values
            names = sorted(f.keys())
            h.update("\n".join(names).encode())
            first = f.get_slice(names[0])
            h.update(first[: min(4, first.get_shape()[0])].float().numpy().tobytes())
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
