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
    raw text prompts ending in "Answer:"; the answer is a letter (items and prompts: tasks.py).
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

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..exit.config import KV_POLICIES
from ..exit.stats import mean_layers_run
from .common import (BenchError, fit_prompt, make_config, mcnemar, progress, resolve_chat, shared_file, use_config,
                     wilson)
from .report import environment, environment_md, md_table
from .tasks import (LETTERS, MC_TASKS, MCItem, Prompt, answer_separator, encode_mc, load_mc_task,
                    read_text_tokens)

PARTS = ("agreement", "ppl", "mc")
PPL_WINDOW = 512  # the default perplexity window, in tokens


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
def checked_ppl_window(window: int | None, context: int) -> int:
    """The perplexity window: `window`, or PPL_WINDOW (shortened to a shorter context) when None. A window
    past the context is refused, not shortened: the report would name one window and score another."""
    if window is None:
        return min(PPL_WINDOW, context)
    if not 3 <= window <= context:
        raise BenchError(f"--ppl-window {window}: a window holds 3 tokens or more, and at most the model's "
                         f"context of {context} tokens")
    return window


def perplexity_windows(llm, token_ids: Sequence[int], tokens: int, window: int) -> list[tuple[list[int], list[int]]]:
    """(context, scored continuation) windows of at most `window` tokens, `tokens` scored in all.

    Each window is [BOS] + a chunk of the text (no BOS if the tokenizer has none); its first two
    tokens are the unscored context (early exit prefills all but the last prompt token, and a
    draft-model drafter needs at least one token before that), the rest are scored."""
    window = checked_ppl_window(window, llm.model.cfg.context_limit)
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
def paired_accuracy(gold: Sequence[int], full: Sequence[int], early_exit: Sequence[int]) -> tuple[dict, dict]:
    """Accuracy with a 95% Wilson interval of the full model's and early exit's answers to the same
    items, and their paired comparison: answers changed, b = items the full model got right and
    early exit wrong, c = the reverse, and the exact McNemar p-value of b vs c."""
    n = len(gold)
    full_right = [f == g for f, g in zip(full, gold)]
    ee_right = [e == g for e, g in zip(early_exit, gold)]
    fc, ec = sum(full_right), sum(ee_right)
    b = sum(f and not e for f, e in zip(full_right, ee_right))
    c = sum(e and not f for f, e in zip(full_right, ee_right))
    return ({"accuracy": fc / n if n else None, "correct": fc, "ci95": list(wilson(fc, n))},
            {"accuracy": ec / n if n else None, "correct": ec, "ci95": list(wilson(ec, n)),
             "delta": (ec - fc) / n if n else None,
             "answers_changed": sum(f != e for f, e in zip(full, early_exit)),
             "full_right_ee_wrong": b, "full_wrong_ee_right": c, "mcnemar_p": mcnemar(b, c)})


@torch.inference_mode()
def score_mc(llm, items: Sequence[MCItem], show_progress: bool = False,
             desc: str = "multiple choice") -> dict[str, Any]:
    """Accuracy of the full model and of early exit on items; see the module doc."""
    L = llm.model.cfg.num_layers
    gold: list[int] = []
    full_preds: list[int] = []
    ee_preds: list[int] = []
    emitted = 0
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
        step = llm.teacher_forced(list(ids), [cands[it.answer]])[0]
        e = step.exit_layer
        hist[e] += 1
        layer_logits = llm.model.logits(hs[e + 1, -1:]).float()[0]
        e_pred = int(layer_logits[cand].argmax())
        deviation = max(deviation, abs(float(torch.log_softmax(layer_logits, -1)[cands[it.answer]]) - step.logprob))
        emitted += step.predicted == cands[e_pred]
        gold.append(it.answer)
        full_preds.append(f_pred)
        ee_preds.append(e_pred)
        per_item.append({"id": it.id, "gold": LETTERS[it.answer], "full": LETTERS[f_pred],
                         "early_exit": LETTERS[e_pred], "exit_layer": e + 1})
    n = len(gold)
    out: dict[str, Any] = {"items": n, "skipped_too_long": skipped, "skipped_tokenization": bad_tokens,
                           "answer_format": f"Answer:{sep}X",
                           "mean_shots": sum(shots_used) / len(shots_used) if shots_used else None}
    out["full"], paired = paired_accuracy(gold, full_preds, ee_preds)
    out["early_exit"] = {
        **paired,
        "mean_exit_layer": mean_layers_run(hist),
        "exit_histogram": hist,
        "emitted_is_answer": emitted / n if n else None,
        "max_logprob_deviation": deviation,
    }
    out["per_item"] = per_item
    return out


# ---- the whole benchmark ---------------------------------------------------------------------------
def run_quality(llm, prompts: Sequence[Prompt], *, draft: str, bank: str | None = None, k: int = 4,
                policies: Sequence[str] = KV_POLICIES, parts: Sequence[str] = PARTS, max_new_tokens: int = 128,
                chat: str | bool = "auto", ppl_tokens: int = 2048, ppl_window: int | None = None,
                ppl_file: str | Path | None = None, mc_tasks: Sequence[str] = MC_TASKS, mc_items: int = 100,
                shots: int = 3, mmlu_subjects: Sequence[str] | None = None, shared=None,
                ee_options: dict[str, Any] | None = None, show_progress: bool = True,
                argv: Sequence[str] | None = None) -> dict[str, Any]:
    bad = [p for p in parts if p not in PARTS]
    if bad:
        raise BenchError(f"--parts: unknown {bad}; choose from {', '.join(PARTS)}")
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
            ppl_window = checked_ppl_window(ppl_window, llm.model.cfg.context_limit)
            windows = perplexity_windows(llm, read_text_tokens(llm, path, ppl_tokens), ppl_tokens, ppl_window)
            ppl = {"file": str(path), "window": ppl_window, "windows": len(windows),
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
