"""`specee bench quality`: what lossy early exit costs in output quality.

(a) Agreement with full-depth greedy under teacher forcing. For each prompt the full model's
    greedy continuation is generated (stopping at EOS, the EOS included); then, per KV policy,
    `llm.teacher_forced(prompt, continuation)` replays it through early exit and reports at each
    position what early exit would have emitted. Agreement = fraction of positions where that
    equals the full model's token. Teacher forcing keeps positions comparable: one early
    mistake does not make every later position "disagree".

(b) Perplexity on WikiText-2 (test). The text is tokenized once (no special tokens) and cut
    into windows of `window` tokens: BOS (if the tokenizer has one) + text; the first two tokens
    of each window are unscored context (early exit needs a prompt of two tokens or more, see
    `perplexity_windows`), the rest is scored, `ppl_tokens` tokens in all. Full model: log-softmax of the final layer over each window in one pass.
    Early exit: exp(-mean logprob) from `teacher_forced`, whose logprob is taken under the
    distribution early exit used at that position (the exit layer's logit lens where it exited).

(c) Multiple choice: CommonsenseQA (5 choices), SST-2 (2) and an MMLU subset (4), few-shot,
    raw text prompts ending in "Answer:"; the answer is a letter.
    Scoring: the candidate letters' next-token logits at the answer position; the prediction
    is the letter with the highest logit (restricted argmax). The full model uses the final
    layer. For early exit the answer position is the first early-exit step (the prompt but
    its last token is prefilled at full depth), so the distribution early exit uses there is
    the logit lens of the layer it exits at. We run `teacher_forced(prompt, [gold letter])`
    once to learn that exit layer (the exit decision does not depend on the token fed
    afterwards), then compare the candidates under that layer's logits, taken from the same
    `hidden_states` pass that scores the full model. So both models answer by the same rule
    and differ only in the layer used. Because the prompt is prefilled at full depth, this is
    independent of the KV policy. As a consistency check the teacher-forced logprob of the
    gold letter is compared with the same layer's log-softmax (`max_logprob_deviation`), and
    `emitted_is_answer` counts how often early exit's unrestricted emitted token is the
    predicted letter.
    Reported per task and model: accuracy with a 95% Wilson interval; for early exit also
    the paired comparison against the full model on the same items: b = items the full model
    got right and early exit wrong, c = the reverse, answers changed, and the exact McNemar
    p-value for b vs c. A p-value well above 0.05 with few changed items means the accuracy
    difference is indistinguishable from noise at this item count.
"""
from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..engine.early_exit import KV_POLICIES, mean_layers_run
from .common import (BenchError, round_robin, Prompt, environment, environment_md, fit_prompt, make_config,
                     mcnemar, md_table, progress, resolve_chat, shared_file, use_config, wilson)

LETTERS = "ABCDEFGHIJ"
MC_TASKS = ("csqa", "sst2", "mmlu")


# ---- (a) agreement under teacher forcing ---------------------------------------------------------
def full_depth_continuations(llm, prompt_ids: Sequence[list[int]], max_new_tokens: int,
                             show_progress: bool = False) -> list[list[int]]:
    """The full model's greedy continuation of each prompt (stops at EOS, which it includes)."""
    from ..sampling import SamplingParams

    saved = llm.early_exit
    llm.early_exit = None
    try:
        params = SamplingParams(max_tokens=max_new_tokens)
        return [llm.generate(ids, params)[0].token_ids
                for ids in progress(prompt_ids, enabled=show_progress, desc="full-depth greedy")]
    finally:
        llm.early_exit = saved


def agreement(llm, prompt_ids: Sequence[list[int]], continuations: Sequence[list[int]],
              categories: Sequence[str] | None = None, show_progress: bool = False) -> dict[str, Any]:
    """Teacher-forced agreement of the current early-exit config with the given continuations."""
    if llm.early_exit is None:
        raise BenchError("agreement needs early exit enabled")
    categories = list(categories) if categories is not None else ["all"] * len(prompt_ids)
    L = llm.model.cfg.num_layers
    per_cat: dict[str, list[int]] = {}
    hist = [0] * L
    agree = n = exited = agree_exited = 0
    per_prompt = []
    for ids, cont, cat in progress(list(zip(prompt_ids, continuations, categories)), enabled=show_progress,
                                   desc="teacher forcing"):
        if not cont:
            continue
        steps = llm.teacher_forced(list(ids), list(cont))
        a = sum(s.predicted == s.target for s in steps)
        for s in steps:
            hist[s.exit_layer] += 1
            if s.exit_layer < L - 1:
                exited += 1
                agree_exited += s.predicted == s.target
        agree += a
        n += len(steps)
        c = per_cat.setdefault(cat, [0, 0])
        c[0] += a
        c[1] += len(steps)
        per_prompt.append({"category": cat, "positions": len(steps), "agreement": a / len(steps)})
    return {
        "agreement": agree / n if n else None,
        "positions": n,
        "mean_exit_layer": mean_layers_run(hist),
        "exit_rate": exited / n if n else None,
        "agreement_at_exits": agree_exited / exited if exited else None,
        "exit_histogram": hist,
        "per_category": {c: {"agreement": v[0] / v[1] if v[1] else None, "positions": v[1]} for c, v in per_cat.items()},
        "per_prompt": per_prompt,
    }


# ---- (b) perplexity ------------------------------------------------------------------------------
def read_text_tokens(llm, path: Path, tokens_needed: int) -> list[int]:
    """Tokens of the start of a text file (no special tokens), at least `tokens_needed` if it has them."""
    text = path.read_text(encoding="utf-8")
    chars = max(4096, tokens_needed * 8)
    while True:
        ids = llm.tokenizer.encode(text[:chars], add_special_tokens=False)
        if len(ids) > tokens_needed + 1 or chars >= len(text):
            return ids
        chars *= 2


def perplexity_windows(llm, token_ids: Sequence[int], tokens: int, window: int) -> list[tuple[list[int], list[int]]]:
    """(context, scored continuation) windows of at most `window` tokens, `tokens` scored in all.

    Each window is [BOS] + a chunk of the text (no BOS if the tokenizer has none); its first two
    tokens are the unscored context (early exit prefills all but the last prompt token, and a
    draft-model drafter needs at least one token before that), the rest are scored."""
    window = min(window, llm.model.cfg.context_limit)
    if window < 3:
        raise BenchError("--ppl-window must be at least 3")
    bos = llm.tokenizer.token_id(llm.tokenizer.bos_token)
    head = [] if bos is None else [bos]
    out: list[tuple[list[int], list[int]]] = []
    pos, left = 0, tokens
    while left > 0:
        chunk = (head + list(token_ids[pos:pos + window - len(head)]))[: left + 2]
        if len(chunk) < 3:
            break
        out.append((chunk[:2], chunk[2:]))
        pos += len(chunk) - len(head)
        left -= len(chunk) - 2
    if not out:
        raise BenchError("the perplexity text is too short")
    return out


@torch.inference_mode()
def full_logprobs(llm, context: list[int], continuation: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(continuation[j]) under the full model, its argmax predictions) teacher-forced, one pass."""
    ids = list(context) + list(continuation)
    h = llm.model.hidden_states(ids[:-1])[-1][len(context) - 1:]
    logp = torch.log_softmax(llm.model.logits(h).float(), dim=-1)
    target = torch.tensor(continuation, device=logp.device)
    return logp.gather(1, target[:, None])[:, 0].cpu(), logp.argmax(dim=-1).cpu()


def perplexity_full(llm, windows, show_progress: bool = False) -> dict[str, Any]:
    total, n, right = 0.0, 0, 0
    for ctx, cont in progress(windows, enabled=show_progress, desc="perplexity (full)"):
        lp, pred = full_logprobs(llm, ctx, cont)
        total += float(lp.double().sum())
        n += len(cont)
        right += int((pred == torch.tensor(cont)).sum())
    return {"perplexity": math.exp(-total / n), "mean_logprob": total / n, "tokens": n,
            "next_token_accuracy": right / n}


def perplexity_early_exit(llm, windows, show_progress: bool = False) -> dict[str, Any]:
    if llm.early_exit is None:
        raise BenchError("early-exit perplexity needs early exit enabled")
    L = llm.model.cfg.num_layers
    total, n, right = 0.0, 0, 0
    hist = [0] * L
    for ctx, cont in progress(windows, enabled=show_progress, desc="perplexity (early exit)"):
        for s in llm.teacher_forced(list(ctx), list(cont)):
            total += s.logprob
            n += 1
            right += s.predicted == s.target
            hist[s.exit_layer] += 1
    return {"perplexity": math.exp(-total / n), "mean_logprob": total / n, "tokens": n,
            "next_token_accuracy": right / n,
            "mean_exit_layer": mean_layers_run(hist), "exit_histogram": hist}


# ---- (c) multiple choice -------------------------------------------------------------------------
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
    rows = [json.loads(l) for l in path.read_text(encoding="utf-8").splitlines() if l.strip()]
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


@torch.inference_mode()
def score_mc(llm, items: Sequence[MCItem], show_progress: bool = False,
             desc: str = "multiple choice") -> dict[str, Any]:
    """Accuracy of the full model and of early exit on items; see the module doc."""
    L = llm.model.cfg.num_layers
    full_right: list[bool] = []
    ee_right: list[bool] = []
    changed = emitted = 0
    hist = [0] * L
    deviation = 0.0
    skipped = bad_tokens = 0
    shots_used = []
    per_item = []
    sep = answer_separator(llm, max((len(it.options) for it in items), default=2))
    for it in progress(items, enabled=show_progress, desc=desc):
        enc = encode_mc(llm, it, sep)
        if enc is None:
            skipped += 1
            continue
        if enc == "tokenization":
            bad_tokens += 1
            continue
        ids, cands, shots = enc
        shots_used.append(shots)
        hs = llm.model.hidden_states(ids)  # [L+1, S, H]
        cand = torch.tensor(cands, device=hs.device)
        full_logits = llm.model.logits(hs[-1, -1:]).float()[0]
        f_pred = int(full_logits[cand].argmax())
        full_right.append(f_pred == it.answer)
        step = llm.teacher_forced(list(ids), [cands[it.answer]])[0]
        e = step.exit_layer
        hist[e] += 1
        layer_logits = llm.model.logits(hs[e + 1, -1:]).float()[0]
        e_pred = int(layer_logits[cand].argmax())
        deviation = max(deviation, abs(float(torch.log_softmax(layer_logits, -1)[cands[it.answer]]) - step.logprob))
        emitted += step.predicted == cands[e_pred]
        ee_right.append(e_pred == it.answer)
        changed += e_pred != f_pred
        per_item.append({"id": it.id, "gold": LETTERS[it.answer], "full": LETTERS[f_pred],
                         "early_exit": LETTERS[e_pred], "exit_layer": e + 1})
    n = len(full_right)
    out: dict[str, Any] = {"items": n, "skipped_too_long": skipped, "skipped_tokenization": bad_tokens,
                           "answer_format": f"Answer:{sep}X",
                           "mean_shots": sum(shots_used) / len(shots_used) if shots_used else None}
    fc = sum(full_right)
    out["full"] = {"accuracy": fc / n if n else None, "correct": fc, "ci95": list(wilson(fc, n))}
    ec = sum(ee_right)
    b = sum(f and not e for f, e in zip(full_right, ee_right))
    c = sum(e and not f for f, e in zip(full_right, ee_right))
    out["early_exit"] = {
        "accuracy": ec / n if n else None, "correct": ec, "ci95": list(wilson(ec, n)),
        "delta": (ec - fc) / n if n else None,
        "answers_changed": changed, "full_right_ee_wrong": b, "full_wrong_ee_right": c,
        "mcnemar_p": mcnemar(b, c),
        "mean_exit_layer": mean_layers_run(hist),
        "exit_histogram": hist,
        "emitted_is_answer": emitted / n if n else None,
        "max_logprob_deviation": deviation,
    }
    out["per_item"] = per_item
    return out


# ---- the whole benchmark ---------------------------------------------------------------------------
def run_quality(llm, prompts: Sequence[Prompt], *, draft: str, bank: str | None = None, k: int = 4,
                policies: Sequence[str] = KV_POLICIES, parts: Sequence[str] = ("agreement", "ppl", "mc"),
                max_new_tokens: int = 128, chat: str | bool = "auto", ppl_tokens: int = 2048, ppl_window: int = 512,
                ppl_file: str | Path | None = None, mc_tasks: Sequence[str] = MC_TASKS, mc_items: int = 100,
                shots: int = 3, mmlu_subjects: Sequence[str] | None = None, shared=None,
                ee_options: dict[str, Any] | None = None, show_progress: bool = True,
                argv: Sequence[str] | None = None) -> dict[str, Any]:
    bad = [p for p in parts if p not in ("agreement", "ppl", "mc")]
    if bad:
        raise BenchError(f"unknown parts {bad}; choose from agreement, ppl, mc")
    opts = dict(ee_options or {})
    configs = {p: make_config(draft, bank, k, kv_policy=p, mode="lossy", **opts) for p in policies}
    if not configs:
        raise BenchError("no KV policy given")
    report: dict[str, Any] = {"benchmark": "quality"}
    try:
        if "agreement" in parts:
            use_chat = resolve_chat(llm, chat)
            ids = [fit_prompt(llm, p.text, use_chat, max_new_tokens)[0] for p in prompts]
            conts = full_depth_continuations(llm, ids, max_new_tokens, show_progress)
            cats = [p.category for p in prompts]
            res = {}
            for policy, cfg in configs.items():
                use_config(llm, cfg)
                res[policy] = agreement(llm, ids, conts, cats, show_progress)
            report["agreement"] = {"prompts": len(prompts), "max_new_tokens": max_new_tokens, "chat_template": use_chat,
                                   "continuation_tokens": sum(len(c) for c in conts), "policies": res}
        if "ppl" in parts:
            use_config(llm, None)
            path = Path(ppl_file) if ppl_file else shared_file(shared, "data", "text", "wikitext2_test.txt",
                                                               what="WikiText-2 text")
            windows = perplexity_windows(llm, read_text_tokens(llm, path, ppl_tokens), ppl_tokens, ppl_window)
            ppl = {"file": str(path), "window": min(ppl_window, llm.model.cfg.context_limit), "windows": len(windows),
                   "full": perplexity_full(llm, windows, show_progress), "early_exit": {}}
            for policy, cfg in configs.items():
                use_config(llm, cfg)
                ppl["early_exit"][policy] = perplexity_early_exit(llm, windows, show_progress)
                ppl["early_exit"][policy]["ratio_to_full"] = ppl["early_exit"][policy]["perplexity"] / ppl["full"]["perplexity"]
            report["perplexity"] = ppl
        if "mc" in parts:
            policy = "recompute" if "recompute" in configs else next(iter(configs))
            use_config(llm, configs[policy])
            mc = {"kv_policy": policy, "shots": shots, "scoring": "restricted argmax over answer-letter tokens; "
                  "early exit uses the logit lens of the layer it exits at on the answer position", "tasks": {}}
            for task in mc_tasks:
                items = load_mc_task(task, mc_items, shots, shared, mmlu_subjects)
                mc["tasks"][task] = score_mc(llm, items, show_progress, desc=f"mc {task}")
            report["multiple_choice"] = mc
    finally:
        use_config(llm, None)
    report["environment"] = environment(llm, draft=draft, bank=bank, argv=argv)
    report["settings"] = {"parts": list(parts), "policies": list(policies), "k": k, "max_new_tokens": max_new_tokens,
                          "ppl_tokens": ppl_tokens, "ppl_window": ppl_window, "mc_tasks": list(mc_tasks),
                          "mc_items": mc_items, "shots": shots, "early_exit_options": opts}
    return report


def quality_markdown(report: dict[str, Any]) -> str:
    lines = ["# specee bench quality", ""]
    if "agreement" in report:
        a = report["agreement"]
        pols = list(a["policies"])
        lines += [f"## Agreement with full-depth greedy (teacher forced; {a['prompts']} prompts, "
                  f"{a['continuation_tokens']} positions)", "",
                  md_table(["KV policy", "agreement", "agreement at early exits", "exit rate", "mean exit layer"],
                           [[p, a["policies"][p]["agreement"], a["policies"][p]["agreement_at_exits"],
                             a["policies"][p]["exit_rate"], a["policies"][p]["mean_exit_layer"]] for p in pols], 3), ""]
        cats = list(a["policies"][pols[0]]["per_category"])
        lines += ["Per category (agreement):", "",
                  md_table(["category", "positions"] + pols,
                           [[c, a["policies"][pols[0]]["per_category"][c]["positions"]]
                            + [a["policies"][p]["per_category"][c]["agreement"] for p in pols] for c in cats], 3), ""]
    if "perplexity" in report:
        p = report["perplexity"]
        rows = [["full model", p["full"]["perplexity"], p["full"]["next_token_accuracy"], None, None]]
        rows += [[f"early exit ({k})", v["perplexity"], v["next_token_accuracy"], v["ratio_to_full"], v["mean_exit_layer"]]
                 for k, v in p["early_exit"].items()]
        lines += [f"## Perplexity ({Path(p['file']).name}, {p['full']['tokens']} tokens, {p['windows']} windows of "
                  f"<= {p['window']})", "",
                  md_table(["model", "perplexity", "next-token accuracy", "ratio to full", "mean exit layer"], rows, 3), ""]
    if "multiple_choice" in report:
        mc = report["multiple_choice"]
        rows = []
        for task, r in mc["tasks"].items():
            f, e = r["full"], r["early_exit"]
            rows.append([task, r["items"], f"{f['accuracy']:.3f} [{f['ci95'][0]:.3f}, {f['ci95'][1]:.3f}]"
                         if f["accuracy"] is not None else "-",
                         f"{e['accuracy']:.3f} [{e['ci95'][0]:.3f}, {e['ci95'][1]:.3f}]"
                         if e["accuracy"] is not None else "-",
                         e["answers_changed"], f"{e['full_right_ee_wrong']} / {e['full_wrong_ee_right']}",
                         e["mcnemar_p"], e["mean_exit_layer"]])
        lines += [f"## Multiple choice ({mc['shots']}-shot, letter scoring; KV policy irrelevant here, ran {mc['kv_policy']})",
                  "",
                  md_table(["task", "items", "full acc [95% CI]", "early exit acc [95% CI]", "answers changed",
                            "right->wrong / wrong->right", "McNemar p", "mean exit layer"], rows, 3), ""]
    lines += ["## Environment", "", environment_md(report["environment"]), ""]
    return "\n".join(lines)
