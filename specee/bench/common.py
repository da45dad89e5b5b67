"""What every benchmark shares: finding ../shared, fitting prompts into the context, switching
early-exit configurations, statistics helpers (median, Wilson interval, McNemar test) and progress
bars. Prompt sets and task loaders live in tasks.py; the environment record and the JSON /
Markdown writers in report.py."""
from __future__ import annotations

import math
import os
import statistics
from collections.abc import Iterable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
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


# ---- lists ------------------------------------------------------------------------------------
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
    from ..exit.config import EarlyExitConfig

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
    llm.calibrate()  # a bank on first use
    llm._bench_decoder = llm.early_exit


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


def progress(iterable=None, *, enabled: bool = True, **kw):
    """A progress bar on stderr, on a terminal only (a plain iterator otherwise)."""
    from ..progress import progress_bar

    return progress_bar(iterable, enabled, leave=False, **kw)
