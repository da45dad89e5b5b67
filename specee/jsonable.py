"""Values as strict JSON: reports and bank manifests must load in any JSON reader."""
from __future__ import annotations

import math
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

import torch


def jsonable(x: Any) -> Any:
    """NaN/inf -> None, tensors -> lists, dataclasses -> dicts, paths -> strings, keys -> strings."""
    if isinstance(x, torch.Tensor):
        x = x.tolist()
    if is_dataclass(x) and not isinstance(x, type):
        x = asdict(x)
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    return x
