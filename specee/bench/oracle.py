"""`specee bench oracle`: how much early exit could save at best, for a model + drafter.

For each prompt the full model's greedy continuation is generated (stopping at EOS). One
teacher-forced pass over prompt + continuation keeps every layer's hidden state; the logit
lens (final norm + LM head) of layer i gives that layer's argmax at each position.

* oracle exit layer (free) of a position = the first layer from which the argmax equals the
  final token and stays equal through the last layer (an exit there emits the final token and
  no later layer would change its mind); reported as layers run, 1..L.
* oracle exit layer (with the drafter) = the same, but L wherever the final token is not in
  the drafter's top-k for that position (`teacher_forced_top_k`): SpecEE only exits on a
  speculative token, so those positions must run every layer.
* bound = L / mean oracle layers: the speedup in layers run that a perfect predictor would
  get (decoder layers dominate decode time, so it also bounds the speedup in time, less the
  drafter's and the predictors' own costs).

The "final token" is the full-depth greedy token from the decode loop; if the teacher-forced
last layer disagrees with it (a rounding near-tie), the position counts as L and is reported
as `final_layer_mismatch`.

With `draft_tokens` N, the same bound for SpecEE inside speculative verification passes: the
drafter drafts N tokens per pass along the continuation (as the decode loop would, greedy),
the pass emits the accepted drafts and one more token, and it can stop no earlier than the
deepest oracle layer of its emitted rows (rows settle together). bound = L / mean layers per
pass: the most exits can add to speculation alone at those acceptances.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .common import fit_prompt, progress, resolve_chat
from .report import environment, environment_md, md_table
from .tasks import Prompt


@torch.inference_mode()
def oracle_exit_layers(llm, drafter, prompt_ids: list[int], continuation: list[int]) -> dict[str, torch.Tensor]:
    """Per continuation position: free and drafter-restricted oracle layers (1..L), top-k hit,
    and whether the teacher-forced last layer agrees with the given token."""
    model = llm.model
    L = model.cfg.num_layers
    P = len(prompt_ids)
    ids = list(prompt_ids) + list(continuation)
    hs = model.hidden_states(ids[:-1])  # [L+1, P+T-1, H]
    final = torch.tensor(continuation, device=hs.device)
    preds = torch.stack([model.logits(hs[i + 1, P - 1:]).argmax(dim=-1) for i in range(L)])  # [L, T]
    eq = preds == final[None, :]
    # stays[i, t]: layers i..L-1 all give the final token
    stays = torch.flip(torch.cumprod(torch.flip(eq.to(torch.int32), [0]), dim=0), [0]).bool()
    first = torch.where(stays.any(dim=0), stays.to(torch.int32).argmax(dim=0), torch.full_like(final, L - 1))
    free = first + 1
    top = drafter.teacher_forced_top_k(ids, P).to(final.device)  # [T, k]
    hit = (top == final[:, None]).any(dim=1)
    restricted = torch.where(hit, free, torch.full_like(free, L))
    return {"free": free.cpu(), "drafter": restricted.cpu(), "hit": hit.cpu(), "final_ok": eq[L - 1].cpu()}


@torch.inference_mode()
def pass_depths(drafter, prompt_ids: list[int], continuation: list[int], layers: torch.Tensor,
                draft_tokens: int) -> list[tuple[int, int]]:
    """(tokens emitted, oracle layers) of each verification pass along `continuation`, drafting
    `draft_tokens` per pass; layers: each position's drafter-restricted oracle layers."""
    from ..sampling import SamplingParams

    params, out, p, T = SamplingParams(), [], 0, len(continuation)
    drafter.reset(list(prompt_ids), T + draft_tokens)
    while p < T:
        draft = drafter.draft(min(draft_tokens, T - p - 1), params, None, 0).host_ids()
        accepted = 0
        while accepted < len(draft) and draft[accepted] == continuation[p + accepted]:
            accepted += 1
        emitted = continuation[p : p + accepted + 1]
        out.append((len(emitted), int(layers[p : p + len(emitted)].max())))
        if draft:
            drafter.commit(emitted, accepted)
        else:
            drafter.extend(emitted)
        p += len(emitted)
    return out


def _summary(layers: torch.Tensor, L: int) -> dict[str, Any]:
    n = int(layers.numel())
    if n == 0:
        return {"positions": 0, "mean_layers": None, "bound": None, "histogram": [0] * L}
    hist = torch.bincount(layers - 1, minlength=L).tolist()
    mean = float(layers.double().mean())
    return {"positions": n, "mean_layers": mean, "bound": L / mean, "histogram": hist,
            "share_after_layer_1": hist[0] / n, "share_full_depth": hist[L - 1] / n}


def _passes(passes: list[tuple[int, int]], L: int, draft_tokens: int) -> dict[str, Any] | None:
    if not passes:
        return None
    tokens, depth = sum(t for t, _ in passes), sum(d for _, d in passes)
    return {"num_draft_tokens": draft_tokens, "passes": len(passes), "tokens": tokens,
            "mean_accepted_length": tokens / len(passes), "mean_pass_layers": depth / len(passes),
            "bound": L * len(passes) / depth, "share_full_depth": sum(d == L for _, d in passes) / len(passes)}


def run_oracle(llm, prompts: Sequence[Prompt], *, draft: str, k: int = 4, max_new_tokens: int = 128,
               chat: str | bool = "auto", show_progress: bool = True, argv: Sequence[str] | None = None,
               draft_tokens: int = 0) -> dict[str, Any]:
    from .quality import full_depth_continuations

    drafter = llm.make_drafter(draft, k)
    L = llm.model.cfg.num_layers
    use_chat = resolve_chat(llm, chat)
    rows: list[dict[str, torch.Tensor]] = []
    cats: list[str] = []
    for p in progress(prompts, enabled=show_progress, desc="oracle"):
        ids, _ = fit_prompt(llm, p.text, use_chat, max_new_tokens)
        cont = full_depth_continuations(llm, [ids], max_new_tokens)[0]
        if not cont:
            continue
        rows.append(oracle_exit_layers(llm, drafter, ids, cont))
        if draft_tokens:
            rows[-1]["passes"] = pass_depths(drafter, ids, cont, rows[-1]["drafter"], draft_tokens)
        cats.append(p.category)

    def summarise(sel: list[int]) -> dict[str, Any]:
        if not sel:
            return {"free": _summary(torch.empty(0, dtype=torch.long), L),
                    "drafter": _summary(torch.empty(0, dtype=torch.long), L), "topk_hit_rate": None}
        free = torch.cat([rows[i]["free"] for i in sel])
        restricted = torch.cat([rows[i]["drafter"] for i in sel])
        hit = torch.cat([rows[i]["hit"] for i in sel])
        ok = torch.cat([rows[i]["final_ok"] for i in sel])
        return {"free": _summary(free, L), "drafter": _summary(restricted, L),
                "topk_hit_rate": float(hit.float().mean()), "final_layer_mismatch": int((~ok).sum()),
                "passes": _passes([x for i in sel for x in rows[i].get("passes", [])], L, draft_tokens)}

    overall = summarise(list(range(len(rows))))
    per_cat = {c: summarise([i for i, x in enumerate(cats) if x == c]) for c in dict.fromkeys(cats)}
    return {
        "benchmark": "oracle",
        "environment": environment(llm, draft=draft, drafter=drafter, argv=argv),
        "settings": {"max_new_tokens": max_new_tokens, "k": k, "chat_template": use_chat, "prompts": len(prompts),
                     "draft_tokens": draft_tokens},
        "num_layers": L,
        "overall": overall,
        "per_category": per_cat,
    }


def oracle_markdown(report: dict[str, Any]) -> str:
    o, L = report["overall"], report["num_layers"]
    d, f = o["drafter"], o["free"]
    env = report["environment"]
    hit = "-" if o["topk_hit_rate"] is None else f"{o['topk_hit_rate']:.3f}"
    hit_line = (f"Drafter top-{report['settings']['k']} hit rate (final token among the drafter's proposals): {hit}; "
                f"positions where the teacher-forced last layer disagrees with the decoded token: "
                f"{o.get('final_layer_mismatch', 0)}.")
    lines = ["# specee bench oracle", "",
             f"{d['positions']} positions of full-depth greedy continuations, {L} layers, drafter "
             f"{(env.get('drafter') or {}).get('name')} (k={report['settings']['k']}).", "",
             md_table(["oracle", "mean layers run", "bound (L / mean)", "exit after layer 1", "needs all layers"],
                      [["with drafter top-k (SpecEE)", d["mean_layers"], d["bound"], d.get("share_after_layer_1"),
                        d.get("share_full_depth")],
                       ["without drafter restriction", f["mean_layers"], f["bound"], f.get("share_after_layer_1"),
                        f.get("share_full_depth")]], 3),
             "",
             hit_line, "",
             *passes_lines(o.get("passes"), L),
             "## Per category", "",
             md_table(["category", "positions", "top-k hit rate", "mean layers (drafter)", "bound (drafter)",
                       "mean layers (free)", "bound (free)"],
                      [[c, r["drafter"]["positions"], r["topk_hit_rate"], r["drafter"]["mean_layers"], r["drafter"]["bound"],
                        r["free"]["mean_layers"], r["free"]["bound"]] for c, r in report["per_category"].items()], 3),
             "",
             "## Oracle exit distribution (positions per layers run)", "",
             md_table(["layers run", "with drafter", "without drafter"],
                      [[i + 1, d["histogram"][i], f["histogram"][i]] for i in range(L)]),
             "", "## Environment", "", environment_md(env), ""]
    return "\n".join(lines)


def passes_lines(passes: dict[str, Any] | None, L: int) -> list[str]:
    if not passes:
        return []
    return [f"Inside speculative verification ({passes['num_draft_tokens']} draft tokens per pass, the drafter's own "
            f"greedy chains): {passes['passes']} passes emit {passes['tokens']} tokens (mean accepted length "
            f"{passes['mean_accepted_length']:.2f}); a pass stops no earlier than its deepest emitted row, "
            f"{passes['mean_pass_layers']:.2f} of {L} layers on average ({passes['share_full_depth']:.0%} need all): "
            f"bound {passes['bound']:.3f}x over speculation alone.", ""]
