"""What every benchmark shares: finding ../shared, loading prompt sets, fitting prompts into the
context, the environment record, switching early-exit configurations, statistics helpers
(median, Wilson interval, McNemar test) and the JSON / Markdown writers."""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..jsonable import jsonable

REPO_ROOT = Path(__file__).resolve().parents[2]
SPEC_BENCH = ("data", "spec_bench", "question.jsonl")
DEFAULT_TARGET = ("models", "ref-target-24L")
DEFAULT_DRAFT = ("models", "ref-draft-4L")


class BenchError(ValueError):
    """A user-facing benchmark error (bad arguments, missing data); the CLI prints it on one line."""


# ---- locating ../shared --------------------------------------------------------------------
def find_shared(explicit: str | Path | None = None) -> Path | None:
    """The shared models/data folder: `explicit` (--shared), $SPECEE_SHARED, ../shared next to the
    repository root, or ../shared / ./shared relative to the current directory. None if absent."""
    if explicit is not None:
        path = Path(explicit).expanduser()
        if not path.is_dir():
            raise BenchError(f"--shared {path}: not a directory")
        return path.resolve()
    candidates = []
    if os.environ.get("SPECEE_SHARED"):
        candidates.append(Path(os.environ["SPECEE_SHARED"]).expanduser())
    candidates += [REPO_ROOT.parent / "shared", Path.cwd().parent / "shared", Path.cwd() / "shared"]
    for path in candidates:
        if path.is_dir():
            return path.resolve()
    return None


def shared_file(shared: str | Path | None, *parts: str, what: str = "file") -> Path:
    """A path under the shared folder, or a BenchError naming what is missing and how to point at it."""
    root = find_shared(shared)
    if root is None:
        raise BenchError(f"the shared models/data folder was not found (looked for ../shared next to "
                         f"{REPO_ROOT}); pass --shared DIR or an explicit path for the {what}")
    path = root.joinpath(*parts)
    if not path.exists():
        raise BenchError(f"{what} not found: {path}")
    return path


# ---- prompt sets ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str


def _record_text(rec: dict[str, Any]) -> str | None:
    turns = rec.get("turns")
    if isinstance(turns, list) and turns:
        return str(turns[0])
    for key in ("prompt", "instruction", "question", "text"):
        value = rec.get(key)
        if isinstance(value, str) and value:
            if key == "instruction" and rec.get("input"):
                return f"{value}\n\n{rec['input']}"
            return value
    return None


def read_prompt_file(path: Path) -> list[Prompt]:
    """A prompt file: JSONL (Spec-Bench / MT-Bench style `turns`, or `prompt`/`instruction`/`text`;
    the first turn is used), a JSON list of such records, or plain text with one prompt per line."""
    if not path.is_file():
        raise BenchError(f"prompt file not found: {path}")
    raw = path.read_text(encoding="utf-8")
    records: list[dict[str, Any]] | None = None
    if path.suffix == ".jsonl":
        records = [json.loads(line) for line in raw.splitlines() if line.strip()]
    elif path.suffix == ".json":
        data = json.loads(raw)
        records = data if isinstance(data, list) else None
        if records is None:
            raise BenchError(f"{path}: expected a JSON list of prompt records")
    out: list[Prompt] = []
    if records is None:
        for i, line in enumerate(l for l in raw.splitlines() if l.strip()):
            out.append(Prompt(str(i), path.stem, line.replace("\\n", "\n")))
        return out
    for i, rec in enumerate(records):
        text = _record_text(rec)
        if text is None:
            raise BenchError(f"{path}: record {i} has no prompt (expected 'turns', 'prompt', 'instruction' or 'text')")
        pid = rec.get("question_id", rec.get("id", i))
        out.append(Prompt(str(pid), str(rec.get("category") or path.stem), text))
    return out



def round_robin(groups: list[list], n: int) -> list:
    """Up to n items taking one from each group in turn (first items of every group first)."""
    out: list = []
    depth = 0
    while len(out) < n and any(depth < len(g) for g in groups):
        for g in groups:
            if depth < len(g) and len(out) < n:
                out.append(g[depth])
        depth += 1
    return out

def select_prompts(prompts: Sequence[Prompt], categories: Sequence[str] | None = None,
                   count: int | None = None, total: int | None = None) -> list[Prompt]:
    """Filter by category, keep the first `count` of each category (file order), then at most
    `total` overall, taken round-robin over the categories so every category stays represented."""
    present = list(dict.fromkeys(p.category for p in prompts))
    if categories:
        unknown = [c for c in categories if c not in present]
        if unknown:
            raise BenchError(f"unknown categories {unknown}; this prompt set has: {', '.join(present)}")
        present = [c for c in present if c in categories]
    by_cat = {c: [p for p in prompts if p.category == c] for c in present}
    if count is not None:
        by_cat = {c: ps[:count] for c, ps in by_cat.items()}
    if total is None:
        return [p for c in present for p in by_cat[c]]
    chosen = round_robin([by_cat[c] for c in present], total)
    order = {p: i for i, p in enumerate(prompts)}
    return sorted(chosen, key=lambda p: (present.index(p.category), order[p]))


def load_prompts(source: str | Path | None = None, categories: Sequence[str] | None = None,
                 count: int | None = None, total: int | None = None, shared: str | Path | None = None) -> list[Prompt]:
    """Spec-Bench (../shared/data/spec_bench/question.jsonl) by default, or a prompt file."""
    path = Path(source) if source is not None else shared_file(shared, *SPEC_BENCH, what="Spec-Bench prompts")
    prompts = select_prompts(read_prompt_file(path), categories, count, total)
    if not prompts:
        raise BenchError(f"no prompts selected from {path}")
    return prompts


def parse_list(value: str | None, kind=str) -> list | None:
    if value is None or value == "":
        return None
    try:
        return [kind(v.strip()) for v in value.split(",") if v.strip()]
    except ValueError as e:
        raise BenchError(f"bad list {value!r}: {e}") from None


# ---- fitting prompts into the model ----------------------------------------------------------
def resolve_chat(llm, chat: str | bool) -> bool:
    """'auto' (or None): the chat template if the tokenizer has one; True/False force it."""
    if chat in ("auto", None):
        return llm.tokenizer.chat_template is not None
    if isinstance(chat, str):
        chat = chat in ("yes", "true", "on", "1")
    if chat and llm.tokenizer.chat_template is None:
        raise BenchError(f"{llm.model_dir} has no chat template; use --chat no")
    return bool(chat)


def fit_prompt(llm, text: str, chat: bool, max_new_tokens: int) -> tuple[list[int], bool]:
    """Token ids of the prompt (chat-templated if `chat`), its user text shortened until prompt +
    max_new_tokens fits the context. Returns (ids, truncated)."""
    limit = llm.model.cfg.context_limit
    if max_new_tokens + 2 > limit:
        raise BenchError(f"--max-new-tokens {max_new_tokens} does not fit the model's context of {limit} tokens")
    ids = llm.encode(text, chat=chat)
    truncated = False
    while len(ids) + max_new_tokens > limit and text:
        keep = max(0, int(len(text) * (limit - max_new_tokens) / len(ids) * 0.95) - 1)
        text = text[:keep]
        truncated = True
        ids = llm.encode(text, chat=chat)
    if len(ids) + max_new_tokens > limit or not ids:
        raise BenchError(f"the prompt template alone does not fit the context with {max_new_tokens} new tokens")
    return ids, truncated


# ---- early-exit configurations ---------------------------------------------------------------
def make_config(draft: str, bank: str | None, k: int, **kw):
    from ..engine.early_exit import EarlyExitConfig

    return EarlyExitConfig(draft=draft, bank=bank, k=k, **kw)


def use_config(llm, config) -> None:
    """Switch `llm` to early-exit `config` (None = full depth). Reuses the loaded drafter and
    predictor bank when only decoding options change (no reload of a draft model per point)."""
    if config is None:
        llm.early_exit = None
        return
    cur = getattr(llm, "_bench_decoder", None)
    if cur is not None and (cur.config.draft, cur.config.bank, cur.config.k) == (config.draft, config.bank, config.k):
        llm.early_exit = type(cur)(llm.model, cur.drafter, cur.bank, config)
        return
    llm.enable_early_exit(config)
    llm._bench_decoder = llm.early_exit


def sync(device) -> None:
    """Wait for the device's queued work (CUDA), so that host timers measure it."""
    import torch

    if getattr(device, "type", str(device)).startswith("cuda"):
        torch.cuda.synchronize(device)


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
            where = str(llm.bank_cache_path(dec.drafter, dec.bank.k))
        b: dict[str, Any] = {"path": where, "calibrated_on_first_use": bank is None}
        if dec is not None:
            pb = dec.bank
            b.update(k=pb.k, thresholds=[t if math.isfinite(t) else None for t in pb.thresholds],
                     offline_layers=list(pb.offline_layers),
                     target_fingerprint=getattr(pb, "target_fingerprint", None),
                     drafter_fingerprint=getattr(pb, "drafter_fingerprint", None))
        env["bank"] = b
    return env


# ---- statistics ----------------------------------------------------------------------------
def median(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def wilson(correct: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95% Wilson score interval for a proportion correct / n."""
    if n == 0:
        return (0.0, 1.0)
    p = correct / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def mcnemar(b: int, c: int) -> float:
    """Exact two-sided McNemar p-value for b (right -> wrong) and c (wrong -> right) changes:
    a binomial test of min(b, c) among b + c discordant items at p = 1/2. 1.0 when nothing changed."""
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b or a != a or b != b:
        return None
    return a / b


# ---- output ---------------------------------------------------------------------------------
def write_json(path: str | Path, obj: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(jsonable(obj), indent=2, allow_nan=False, ensure_ascii=False) + "\n")
    return path


def write_text(path: str | Path, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text if text.endswith("\n") else text + "\n", encoding="utf-8")
    return path


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
        ("threads / CPU", f"{env.get('torch_threads')} / {env.get('cpu')}"),
        ("git", f"{git.get('commit')}{' (dirty)' if git.get('dirty') else ''}" if git else "n/a"),
        ("command", " ".join(env.get("command") or [])),
    ]
    for key, value in rows:
        if value is not None:
            lines.append(f"| {key} | {str(value).replace('|', '/')} |")
    return "\n".join(lines)


def progress(iterable=None, *, enabled: bool = True, **kw):
    """A tqdm bar on stderr (a plain iterator when disabled)."""
    from tqdm.auto import tqdm

    return tqdm(iterable, disable=not enabled, file=sys.stderr, dynamic_ncols=True, leave=False, **kw)
