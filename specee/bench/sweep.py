"""`specee bench sweep`: the speed/quality trade-off of the exit thresholds and the predictor
schedule, on a prompt set.

Points (one KV policy, lossy mode):
* threshold_scale values (EarlyExitConfig.threshold_scale: each threshold t becomes
  1 - (1 - t) * scale, so a scale above 1 lowers the thresholds = more exits, below 1 fewer);
* offline schedule sizes (offline_size: the bank's first n ranked layers; "bank" = the bank's
  own offline set) and online windows (online_window: how many recent exit layers seed the
  online level), each varied one at a time around the default, or as a full grid (--grid).

Per point: end-to-end and decode tokens/s (each prompt decodes exactly max_new_tokens with
EOS ignored; median of `repeats`), the speedup against full depth measured in the same run
(full depth is timed before and after the sweep, and the mean of the two is the baseline;
both are recorded so drift is visible), the mean exit layer, and the teacher-forced agreement
with the full model's greedy continuation (as in `bench quality`). A point is Pareto-optimal
if no other point has both a higher speedup and a higher agreement. The default point
(threshold_scale 1, the bank's schedule, the default online window) is marked.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from ..exit.stats import mean_layers_run
from .common import BenchError, fit_prompt, make_config, median, progress, ratio, resolve_chat, use_config
from .quality import agreement, full_depth_continuations
from .report import environment, environment_md, md_table
from .tasks import Prompt
from .timing import specee_run


def _time_config(llm, fitted: list[list[int]], max_new_tokens: int, repeats: int, warmup: int) -> dict[str, Any]:
    for _ in range(warmup):
        specee_run(llm, fitted[0], min(8, max_new_tokens))
    tokens = seconds = dtok = dsec = 0.0
    hist = None
    for ids in fitted:
        runs = [specee_run(llm, ids, max_new_tokens) for _ in range(repeats)]
        tokens += runs[0].tokens
        seconds += median(r.prefill_seconds + r.decode_seconds for r in runs)
        dtok += runs[0].decode_tokens
        dsec += median(r.decode_seconds for r in runs)
        ee = runs[0].early_exit
        if ee is not None:
            h = ee["exit_histogram"]
            hist = list(h) if hist is None else [a + b for a, b in zip(hist, h)]
    out = {"tokens_per_second": tokens / seconds if seconds else None,
           "decode_tokens_per_second": dtok / dsec if dsec else None}
    if hist is not None:
        out["mean_exit_layer"] = mean_layers_run(hist)
        out["exit_histogram"] = hist
    return out


def sweep_points(scales: Sequence[float], offline_sizes: Sequence[int | None], online_windows: Sequence[int],
                 default_window: int, grid: bool) -> list[dict[str, Any]]:
    """Each point: {threshold_scale, offline_size (None = the bank's), online_window}."""
    default = {"threshold_scale": 1.0, "offline_size": None, "online_window": default_window}
    if grid:
        combos = itertools.product(scales or [1.0], offline_sizes or [None], online_windows or [default_window])
        pts = [{"threshold_scale": s, "offline_size": o, "online_window": w} for s, o, w in combos]
    else:
        pts = [dict(default, threshold_scale=s) for s in scales]
        pts += [dict(default, offline_size=o) for o in offline_sizes]
        pts += [dict(default, online_window=w) for w in online_windows]
    pts.append(default)
    seen, out = set(), []
    for p in pts:
        key = (float(p["threshold_scale"]), p["offline_size"], p["online_window"])
        if key not in seen:
            seen.add(key)
            out.append(dict(p, default=(key == (1.0, None, default_window))))
    return out


def pareto(points: Sequence[dict[str, Any]], x: str = "agreement", y: str = "speedup_vs_full") -> list[bool]:
    ok = [p.get(x) is not None and p.get(y) is not None for p in points]
    flags = []
    for i, p in enumerate(points):
        if not ok[i]:
            flags.append(False)
            continue
        dominated = any(ok[j] and j != i and q[x] >= p[x] and q[y] >= p[y] and (q[x] > p[x] or q[y] > p[y])
                        for j, q in enumerate(points))
        flags.append(not dominated)
    return flags


def run_sweep(llm, prompts: Sequence[Prompt], *, draft: str, bank: str | None = None, k: int = 4,
              policy: str = "recompute", scales: Sequence[float] = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0),
              offline_sizes: Sequence[int | None] = (0, 2, 4, 8), online_windows: Sequence[int] = (0, 1, 2, 4, 8),
              grid: bool = False, max_new_tokens: int = 64, repeats: int = 1, warmup: int = 1,
              chat: str | bool = "auto", ee_options: dict[str, Any] | None = None, show_progress: bool = True,
              argv: Sequence[str] | None = None) -> dict[str, Any]:
    opts = dict(ee_options or {})
    for key in ("threshold_scale", "offline_size", "online_window"):
        opts.pop(key, None)
    base = make_config(draft, bank, k, kv_policy=policy, mode="lossy", **opts)
    points = sweep_points(scales, offline_sizes, online_windows, base.online_window, grid)
    use_chat = resolve_chat(llm, chat)
    fitted = [fit_prompt(llm, p.text, use_chat, max_new_tokens)[0] for p in prompts]
    cats = [p.category for p in prompts]
    conts = full_depth_continuations(llm, fitted, max_new_tokens, show_progress)
    try:
        use_config(llm, None)
        full_before = _time_config(llm, fitted, max_new_tokens, repeats, warmup)
        bar = progress(points, enabled=show_progress, desc="sweep")
        for pt in bar:
            cfg = replace(base, threshold_scale=float(pt["threshold_scale"]), offline_size=pt["offline_size"],
                          online_window=int(pt["online_window"]))
            try:
                use_config(llm, cfg)
            except (AttributeError, ValueError, TypeError) as e:  # e.g. an offline size the bank cannot give
                pt["error"] = f"{type(e).__name__}: {e}"
                continue
            pt["offline_layers"] = list(getattr(llm.early_exit, "offline_layers", []) or [])
            pt.update(_time_config(llm, fitted, max_new_tokens, repeats, 0))
            a = agreement(llm, fitted, conts, cats)
            pt["agreement"] = a["agreement"]
            pt["teacher_forced_mean_exit_layer"] = a["mean_exit_layer"]
        use_config(llm, None)
        full_after = _time_config(llm, fitted, max_new_tokens, repeats, 0)
    finally:
        use_config(llm, None)
    full = {m: (full_before[m] + full_after[m]) / 2 for m in ("tokens_per_second", "decode_tokens_per_second")}
    for pt in points:
        pt["speedup_vs_full"] = ratio(pt.get("tokens_per_second"), full["tokens_per_second"])
        pt["decode_speedup_vs_full"] = ratio(pt.get("decode_tokens_per_second"), full["decode_tokens_per_second"])
    for pt, flag in zip(points, pareto(points)):
        pt["pareto"] = flag
    if all("error" in p for p in points):
        raise BenchError("every sweep point failed: " + points[0]["error"])
    return {
        "benchmark": "sweep",
        "environment": environment(llm, draft=draft, bank=bank, argv=argv),
        "settings": {"kv_policy": policy, "k": k, "max_new_tokens": max_new_tokens, "repeats": repeats,
                     "warmup": warmup, "grid": grid, "prompts": len(prompts), "chat_template": use_chat,
                     "scales": list(scales), "offline_sizes": list(offline_sizes),
                     "online_windows": list(online_windows), "early_exit_options": opts},
        "full_depth": {"before": full_before, "after": full_after, "baseline": full},
        "points": points,
    }


def sweep_markdown(report: dict[str, Any]) -> str:
    s, full = report["settings"], report["full_depth"]
    rows = []
    for p in report["points"]:
        tag = ("default " if p.get("default") else "") + ("pareto" if p.get("pareto") else "")
        rows.append([p["threshold_scale"], "bank" if p["offline_size"] is None else p["offline_size"],
                     p["online_window"], p.get("tokens_per_second"), p.get("speedup_vs_full"),
                     p.get("decode_speedup_vs_full"), p.get("mean_exit_layer"), p.get("agreement"),
                     tag.strip() or p.get("error", "")])
    lines = ["# specee bench sweep", "",
             f"KV policy {s['kv_policy']}, {s['prompts']} prompts x {s['max_new_tokens']} tokens, median of "
             f"{s['repeats']} run(s). Full depth: {full['before']['tokens_per_second']:.2f} tokens/s before the sweep, "
             f"{full['after']['tokens_per_second']:.2f} after (baseline = mean).", "",
             md_table(["threshold scale", "offline size", "online window", "tokens/s", "speedup vs full",
                       "decode speedup", "mean exit layer", "agreement", "note"], rows, 3),
             "", "## Environment", "", environment_md(report["environment"]), ""]
    return "\n".join(lines)
