"""Writing benchmark reports: the environment record every report carries (models and their
fingerprints, drafter, bank, dtype, device, versions, threads, CPU/GPU, date, git commit, command
line), the JSON / Markdown writers and the Markdown table helpers."""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..files import replacing

from ..jsonable import jsonable
from .common import REPO_ROOT


# ---- the environment record --------------------------------------------------------------------
def git_commit(root: Path = REPO_ROOT) -> dict[str, Any] | None:
    """The repository's HEAD commit and whether tracked files differ from it (read-only git calls)."""
    env = dict(os.environ, GIT_OPTIONAL_LOCKS="0")  # never touch the index
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10, env=env)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=20, env=env)
        return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip()) if dirty.returncode == 0 else None}
    except (OSError, subprocess.SubprocessError):
        return None


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(llm=None, *, draft: str | None = None, drafter=None, bank: str | None = None,
                argv: Sequence[str] | None = None) -> dict[str, Any]:
    """What a report ran on: models (+ fingerprints), drafter, bank, dtype, device, versions,
    threads, CPU/GPU, date, git commit and the command line."""
    import torch

    from .. import __version__

    env: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).astimezone().isoformat(timespec="seconds"),
        "specee_version": __version__,
        "git": git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "command": list(argv) if argv is not None else [Path(sys.argv[0]).name, *sys.argv[1:]],
    }
    from ..model.kernels import loaded_cpu_kernels

    if (kernels := loaded_cpu_kernels()) is not None:
        env["int4_prefetch"] = bool(kernels.int4_prefetch())  # chosen at load (engine/threads.py)
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    if llm is not None:
        env["target"] = {"path": str(Path(llm.model_dir).resolve()), "fingerprint": llm.fingerprint,
                         "layers": llm.model.cfg.num_layers, "hidden_size": llm.model.cfg.hidden_size,
                         "vocab_size": llm.model.cfg.vocab_size}
        env["device"] = str(llm.model.device)
        env["dtype"] = str(llm.model.dtype).replace("torch.", "")
        if llm.model.device.type == "cuda" and torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(llm.model.device)
    dec = None if llm is None else (getattr(llm, "early_exit", None) or getattr(llm, "_bench_decoder", None))
    if drafter is None and dec is not None:
        drafter = dec.drafter
    if draft is not None or drafter is not None:
        d: dict[str, Any] = {"source": draft}
        if draft not in (None, "ngram"):
            d["path"] = str(Path(draft).resolve())
        if drafter is not None:
            d.update(name=drafter.name, fingerprint=drafter.fingerprint, k=drafter.k)
        env["drafter"] = d
    if bank is not None or dec is not None:
        if bank is not None:
            where = str(Path(bank).resolve())
        else:
            where = str(llm.bank_cache_path(dec.drafter.fingerprint, dec.bank.k))
        b: dict[str, Any] = {"path": where, "calibrated_on_first_use": bank is None}
        if dec is not None:
            pb = dec.bank
            b.update(k=pb.k, thresholds=[t if math.isfinite(t) else None for t in pb.thresholds],
                     offline_layers=list(pb.offline_layers),
                     target_fingerprint=getattr(pb, "target_fingerprint", None),
                     drafter_fingerprint=getattr(pb, "drafter_fingerprint", None))
        env["bank"] = b
    return env


# ---- output ---------------------------------------------------------------------------------
def write_json(path: str | Path, obj: Any) -> Path:
    return write_text(path, json.dumps(jsonable(obj), indent=2, allow_nan=False, ensure_ascii=False))


def write_text(path: str | Path, text: str) -> Path:
    with replacing(path) as tmp:
        tmp.write_text(text if text.endswith("\n") else text + "\n", encoding="utf-8")
    return Path(path)


def fmt(x: Any, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        if x != x:
            return "-"
        return f"{x:.{digits}f}"
    return str(x)


def md_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], digits: int = 2) -> str:
    cells = [[fmt(c, digits) for c in row] for row in rows]
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in cells]
    return "\n".join(out)


def environment_md(env: dict[str, Any]) -> str:
    lines = ["| item | value |", "|---|---|"]
    target = env.get("target") or {}
    drafter = env.get("drafter") or {}
    bank = env.get("bank") or {}
    git = env.get("git") or {}
    rows = [
        ("date", env.get("date")),
        ("target", f"{target.get('path')} (fingerprint {target.get('fingerprint')}, {target.get('layers')} layers)"
         if target else None),
        ("drafter", f"{drafter.get('source')} ({drafter.get('name')}, fingerprint {drafter.get('fingerprint')}, "
                    f"k={drafter.get('k')})" if drafter else None),
        ("bank", f"{bank.get('path')} (offline layers {bank.get('offline_layers')})" if bank else None),
        ("device / dtype", f"{env.get('device')} / {env.get('dtype')}" + (f" ({env['gpu']})" if env.get("gpu") else "")),
        ("torch / transformers", f"{env.get('torch')} / {env.get('transformers')}"),
        ("threads / CPU", f"{env.get('torch_threads')} / {env.get('cpu')}"
         + (f" (int4 products {'' if env['int4_prefetch'] else 'do not '}prefetch)" if "int4_prefetch" in env else "")),
        ("git", f"{git.get('commit')}{' (dirty)' if git.get('dirty') else ''}" if git else "n/a"),
        ("command", " ".join(env.get("command") or [])),
    ]
    for key, value in rows:
        if value is not None:
            lines.append(f"| {key} | {str(value).replace('|', '/')} |")
    return "\n".join(lines)
