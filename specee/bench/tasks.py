"""The data the benchmarks read: prompt sets (Spec-Bench by default, or a prompt file: MT-Bench /
Spec-Bench style JSONL, a JSON list, plain text), the multiple-choice tasks (CommonsenseQA, SST-2,
MMLU: loading them and rendering an item as a few-shot prompt ending in "Answer:") and the text
for perplexity."""
from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..records import question, raw_text, read_file
from .common import BenchError, round_robin, shared_file

SPEC_BENCH = ("data", "spec_bench", "question.jsonl")
LETTERS = "ABCDEFGHIJ"
MC_TASKS = ("csqa", "sst2", "mmlu")


# ---- prompt sets ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str


def read_prompt_file(path: Path) -> list[Prompt]:
    """A prompt file (read by specee.records.read_file): JSONL or a JSON list of records, each
    giving its question (specee.records.question: Spec-Bench / MT-Bench `turns`, of which the first
    is used, an alpaca instruction and input, `prompt` or `question`) or raw `text`; or plain text
    with one prompt per line."""
    if not path.is_file():
        raise BenchError(f"{path} is {'a directory, not a prompt file' if path.is_dir() else 'not found'}")
    try:
        records = read_file(path)
    except ValueError as e:  # bad JSON or encoding: a one-line error naming the file
        raise BenchError(str(e)) from None
    out: list[Prompt] = []
    for i, rec in enumerate(records):
        text = question(rec) or raw_text(rec)
        if text is None:
            raise BenchError(f"{path}: record {i} has no prompt "
                             "(expected 'turns', 'instruction', 'prompt', 'question' or 'text')")
        meta = rec if isinstance(rec, dict) else {}
        pid = meta.get("question_id", meta.get("id", i))
        out.append(Prompt(str(pid), str(meta.get("category") or path.stem), text))
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


# ---- text for perplexity -------------------------------------------------------------------------
def read_text_tokens(llm, path: Path, tokens_needed: int) -> list[int]:
    """Tokens of the start of a text file (no special tokens), at least `tokens_needed` if it has them."""
    text = path.read_text(encoding="utf-8")
    chars = max(4096, tokens_needed * 8)
    while True:
        ids = llm.tokenizer.encode(text[:chars], add_special_tokens=False)
        if len(ids) > tokens_needed + 1 or chars >= len(text):
            return ids
        chars *= 2


# ---- multiple choice -------------------------------------------------------------------------------
@dataclass
class MCItem:
    task: str
    id: str
    question: str  # the question block without the answer line
    options: list[str]
    answer: int  # index of the gold option
    header: str = ""  # e.g. MMLU's "The following are ... about <subject>."
    shots: list["MCItem"] = field(default_factory=list)


SEPARATORS = (" ", "\n", "")  # between "Answer:" and the letter, first one the tokenizer keeps apart


def _block(item: MCItem, with_answer: bool, sep: str = " ") -> str:
    lines = [f"Question: {item.question}"]
    lines += [f"{LETTERS[i]}. {o}" for i, o in enumerate(item.options)]
    lines.append("Answer:" + (f"{sep}{LETTERS[item.answer]}" if with_answer else ""))
    return "\n".join(lines)


def mc_prompt(item: MCItem, shots: int | None = None, sep: str = " ") -> str:
    ex = item.shots if shots is None else item.shots[:shots]
    parts = [_block(s, True, sep) for s in ex] + [_block(item, False, sep)]
    return (item.header + "\n\n" if item.header else "") + "\n\n".join(parts)


def _answer_tokens(llm, text: str, sep: str, n: int) -> tuple[list[int], list[int]] | None:
    """(prompt ids, one distinct token per letter) for text + sep + letter, or None if the
    tokenizer merges the separator into some letters but not others (no common split point)."""
    encs = [llm.tokenizer.encode(f"{text}{sep}{LETTERS[i]}") for i in range(n)]
    c = 0
    while all(len(e) > c for e in encs) and len({e[c] for e in encs}) == 1:
        c += 1
    if c == 0 or any(len(e) <= c for e in encs):
        return None
    cands = [e[c] for e in encs]
    if len(set(cands)) != n:
        return None
    return encs[0][:c], cands


def answer_separator(llm, n_options: int) -> str:
    """The first separator ("Answer: A", "Answer:\nA", "Answer:A") for which every letter is one
    distinct token after a common prompt with this tokenizer."""
    probe = "Question: Which one?\nA. one\nB. two\nAnswer:"
    for sep in SEPARATORS:
        if _answer_tokens(llm, probe, sep, n_options) is not None:
            return sep
    raise BenchError("this tokenizer does not give the answer letters single distinct tokens in any answer format")


def load_csqa(path: Path, n: int, shots: int) -> list[MCItem]:
    rows = read_file(path)
    items = []
    for r in rows:
        q = r["question"]
        labels = [c["label"] for c in q["choices"]]
        items.append(MCItem("csqa", str(r.get("id", len(items))), q["stem"], [c["text"] for c in q["choices"]],
                            labels.index(r["answerKey"])))
    ex, rest = items[:shots], items[shots:shots + n]
    for it in rest:
        it.shots = ex
    return rest


def load_sst2(path: Path, n: int, shots: int) -> list[MCItem]:
    items = []
    with path.open(encoding="utf-8") as f:
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        for i, row in enumerate(reader):
            if i == 0 and row and row[0].strip().lower() in ("text", "sentence"):
                continue  # header
            if len(row) < 2:
                continue
            text = row[0].strip()
            items.append(MCItem("sst2", str(i), f'What is the sentiment of this review? "{text}"',
                                ["negative", "positive"], int(row[1])))
    # few-shot exemplars alternate labels (negative first), taken from the start of the file
    ex: list[MCItem] = []
    want = 0
    for it in items:
        if len(ex) == shots:
            break
        if it.answer == want:
            ex.append(it)
            want = 1 - want
    taken = {id(x) for x in ex}
    rest = [it for it in items if id(it) not in taken][:n]
    for it in rest:
        it.shots = ex
    return rest


def _read_mmlu_csv(path: Path) -> list[list[str]]:
    with path.open(encoding="utf-8", newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    if rows and [c.strip().lower() for c in rows[0][:2]] == ["question", "choice0"]:
        rows = rows[1:]  # header row
    return rows


def _mmlu_answer(value: str) -> int:
    value = value.strip()
    return int(value) if value.isdigit() else LETTERS.index(value.upper())


def load_mmlu(root: Path, n: int, shots: int, subjects: Sequence[str] | None = None) -> list[MCItem]:
    """MMLU test items, round-robin over subjects (sorted), each with its subject's dev exemplars."""
    test_dir, dev_dir = root / "test", root / "dev"
    available = sorted(p.name[: -len("_test.csv")] for p in test_dir.glob("*_test.csv"))
    if subjects:
        unknown = [s for s in subjects if s not in available]
        if unknown:
            raise BenchError(f"unknown MMLU subjects {unknown}; available: {', '.join(available)}")
        available = [s for s in available if s in subjects]
    per_subject: dict[str, list[MCItem]] = {}
    for s in available:
        name = s.replace("_", " ")
        header = f"The following are multiple choice questions (with answers) about {name}."

        def item(row: list[str], idx: int, s=s, header=header) -> MCItem:
            return MCItem("mmlu", f"{s}/{idx}", row[0], row[1:5], _mmlu_answer(row[5]), header)

        dev = [item(r, i) for i, r in enumerate(_read_mmlu_csv(dev_dir / f"{s}_dev.csv"))][:shots] \
            if (dev_dir / f"{s}_dev.csv").exists() else []
        test = [item(r, i) for i, r in enumerate(_read_mmlu_csv(test_dir / f"{s}_test.csv"))]
        for it in test:
            it.shots = dev
        per_subject[s] = test
    return round_robin([per_subject[s] for s in available], n)


def load_mc_task(task: str, n: int, shots: int, shared=None, mmlu_subjects=None) -> list[MCItem]:
    if task == "csqa":
        return load_csqa(shared_file(shared, "data", "commonsenseqa", "dev_rand_split.jsonl", what="CommonsenseQA"),
                         n, shots)
    if task == "sst2":
        return load_sst2(shared_file(shared, "data", "sst2", "dev.tsv", what="SST-2"), n, shots)
    if task == "mmlu":
        return load_mmlu(shared_file(shared, "data", "mmlu", what="MMLU"), n, shots, mmlu_subjects)
    raise BenchError(f"unknown multiple-choice task {task!r}; choose from {', '.join(MC_TASKS)}")


def encode_mc(llm, item: MCItem, sep: str = " ") -> tuple[list[int], list[int], int] | None | str:
    """(prompt ids up to the answer token, candidate token per option, shots used), dropping
    exemplars until it fits the context; None if even zero-shot does not fit, "tokenization"
    if the letters do not get distinct single tokens for this item.

    Candidates: encode prompt + sep + X for each letter X; the prompt is the common prefix of
    those encodings and each letter's candidate the token right after it (so tokenizers that
    split " A" into "▁" + "A" still give one answer token per letter)."""
    limit = llm.model.cfg.context_limit
    for shots in range(len(item.shots), -1, -1):
        got = _answer_tokens(llm, mc_prompt(item, shots, sep), sep, len(item.options))
        if got is None:
            return "tokenization"
        ids, cands = got
        if len(ids) + 1 <= limit:
            return ids, cands, shots
    return None
