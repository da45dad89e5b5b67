"""PNG figures for the benchmark reports (matplotlib, Agg canvas: no display, no pyplot state).

matplotlib is optional (`pip install 'specee[plots]'`) and imported only when a figure is drawn:
without it `draw_figures` draws nothing and says so once on stderr, and the reports are written
as usual."""
from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from importlib import import_module
from pathlib import Path
from typing import Any

from ..files import replacing

INSTALL_HINT = "pip install 'specee[plots]'"


def have_matplotlib() -> bool:
    try:
        import_module("matplotlib")
    except ImportError:
        return False
    return True


def draw_figures(report: dict[str, Any], out: str | Path,
                 figures: Mapping[str, Callable[[dict[str, Any], Path], Path | None]]) -> list[Path]:
    """Draw each figure (file name -> plot function) into `out`; the paths of those drawn. Without
    matplotlib: none, and one line on stderr naming the skipped figures and how to get them."""
    if not figures:
        return []
    if not have_matplotlib():
        print(f"specee bench: figures skipped ({', '.join(figures)}): matplotlib is not installed; "
              f"to draw them: {INSTALL_HINT}", file=sys.stderr)
        return []
    made = []
    for name, plot in figures.items():
        path = plot(report, Path(out) / name)
        if path is not None:
            made.append(path)
    return made


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: str | Path) -> Path:
    fig.tight_layout()
    with replacing(path) as tmp:
        fig.savefig(tmp, format="png")
    return Path(path)


def _title(report: dict[str, Any]) -> str:
    env = report.get("environment", {})
    target = Path((env.get("target") or {}).get("path", "?")).name
    drafter = (env.get("drafter") or {}).get("name") or ""
    return f"{target}" + (f" + {drafter}" if drafter else "") + f" ({env.get('device', '?')}, {env.get('dtype', '?')})"


def plot_exit_histograms(report: dict[str, Any], path: str | Path) -> Path | None:
    """Speed report: share of decode steps per exit layer (layers run), one panel per early-exit config."""
    cfgs = [(n, report["configs"][n]) for n in report["order"] if report["configs"][n].get("exit_histogram")]
    if not cfgs:
        return None
    fig = _figure(8, 1.9 * len(cfgs) + 0.8)
    axes = fig.subplots(len(cfgs), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (name, c) in zip(axes, cfgs):
        hist = c["exit_histogram"]
        total = sum(hist) or 1
        ax.bar(range(1, len(hist) + 1), [h / total for h in hist], color="tab:blue")
        ax.axvline(c["mean_exit_layer"], color="tab:red", linestyle="--", label=f"mean {c['mean_exit_layer']:.2f}")
        ax.set_ylabel("share")
        ax.set_title(c["label"], fontsize=9)
        ax.legend(fontsize=8, loc="upper left")
    axes[-1].set_xlabel("layers run (exit layer; last = full depth)")
    fig.suptitle("Exit-layer distribution: " + _title(report), fontsize=10)
    return _save(fig, path)


def plot_throughput(report: dict[str, Any], path: str | Path) -> Path:
    """Speed report: tokens/s (end-to-end and decode) per configuration, speedup vs full annotated."""
    names = report["order"]
    cfgs = report["configs"]
    fig = _figure(8, 0.55 * len(names) + 1.6)
    ax = fig.subplots()
    y = list(range(len(names)))
    e2e = [cfgs[n]["tokens_per_second"] or 0 for n in names]
    dec = [cfgs[n]["decode_tokens_per_second"] or 0 for n in names]
    ax.barh([v + 0.2 for v in y], e2e, height=0.4, label="end-to-end tokens/s", color="tab:blue")
    ax.barh([v - 0.2 for v in y], dec, height=0.4, label="decode tokens/s", color="tab:orange")
    for v, n in zip(y, names):
        sp = cfgs[n].get("speedup_vs_full")
        if sp is not None:
            ax.text(max(e2e[v], dec[v]) * 1.01, v, f"{sp:.2f}x", va="center", fontsize=8)
    ax.set_yticks(y, [cfgs[n]["label"] for n in names])
    ax.invert_yaxis()
    ax.set_xlabel("tokens/s (batch 1, greedy)")
    ax.set_xlim(0, max(e2e + dec + [1e-9]) * 1.18)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("Decoding speed: " + _title(report), fontsize=10)
    return _save(fig, path)


def plot_oracle(report: dict[str, Any], path: str | Path) -> Path:
    o, L = report["overall"], report["num_layers"]
    fig = _figure(8, 3.6)
    ax = fig.subplots()
    xs = list(range(1, L + 1))
    for key, label, shift, color in (("drafter", "with drafter top-k", -0.2, "tab:blue"),
                                     ("free", "without drafter", 0.2, "tab:green")):
        s = o[key]
        total = s["positions"] or 1
        ax.bar([x + shift for x in xs], [h / total for h in s["histogram"]], width=0.4, color=color,
               label=f"{label}: mean {s['mean_layers'] or 0:.2f}, bound {s['bound'] or 0:.2f}x")
    ax.set_xlabel("oracle layers run")
    ax.set_ylabel("share of positions")
    ax.legend(fontsize=8)
    ax.set_title("Oracle exit layers: " + _title(report), fontsize=10)
    return _save(fig, path)


def plot_pareto(report: dict[str, Any], path: str | Path) -> Path:
    pts = [p for p in report["points"] if p.get("agreement") is not None and p.get("speedup_vs_full") is not None]
    fig = _figure(7, 4.8)
    ax = fig.subplots()
    groups = {}
    for p in pts:
        groups.setdefault("pareto" if p.get("pareto") else "other", []).append(p)
    for key, color in (("other", "tab:gray"), ("pareto", "tab:blue")):
        g = groups.get(key, [])
        ax.scatter([p["agreement"] for p in g], [p["speedup_vs_full"] for p in g], color=color,
                   label="Pareto-optimal" if key == "pareto" else "dominated", zorder=3)
    front = sorted((p for p in pts if p.get("pareto")), key=lambda p: p["agreement"])
    if len(front) > 1:
        ax.plot([p["agreement"] for p in front], [p["speedup_vs_full"] for p in front], color="tab:blue", alpha=0.5)
    for p in pts:
        off = "bank" if p["offline_size"] is None else p["offline_size"]
        ax.annotate(f"s={p['threshold_scale']:g} o={off} w={p['online_window']}", (p["agreement"], p["speedup_vs_full"]),
                    fontsize=6, xytext=(3, 3), textcoords="offset points")
    default = [p for p in pts if p.get("default")]
    if default:
        ax.scatter([default[0]["agreement"]], [default[0]["speedup_vs_full"]], marker="*", s=260, color="tab:red",
                   label="default (scale 1, bank schedule)", zorder=4)
    ax.axhline(1.0, color="black", linewidth=0.7, linestyle=":")
    ax.set_xlabel("teacher-forced agreement with full-depth greedy")
    ax.set_ylabel("speedup vs full depth (tokens/s)")
    ax.legend(fontsize=8)
    ax.set_title("Threshold / schedule sweep: " + _title(report), fontsize=10)
    return _save(fig, path)


def plot_quality(report: dict[str, Any], path: str | Path) -> Path | None:
    panels = [k for k in ("agreement", "multiple_choice") if k in report]
    if not panels:
        return None
    fig = _figure(4.2 * len(panels), 3.8)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, kind in zip(axes, panels):
        if kind == "agreement":
            pols = list(report["agreement"]["policies"])
            vals = [report["agreement"]["policies"][p]["agreement"] or 0 for p in pols]
            ax.bar(pols, vals, color="tab:blue")
            ax.set_ylim(0, 1.05)
            ax.set_ylabel("agreement with full-depth greedy")
            ax.set_title("teacher-forced agreement", fontsize=9)
        else:
            tasks = list(report["multiple_choice"]["tasks"])
            for j, (who, color) in enumerate((("full", "tab:gray"), ("early_exit", "tab:blue"))):
                accs, lo, hi = [], [], []
                for t in tasks:
                    r = report["multiple_choice"]["tasks"][t][who]
                    a = r["accuracy"] or 0
                    accs.append(a)
                    lo.append(a - r["ci95"][0])
                    hi.append(r["ci95"][1] - a)
                ax.bar([i + (j - 0.5) * 0.4 for i in range(len(tasks))], accs, width=0.4, yerr=[lo, hi], capsize=3,
                       color=color, label="full" if who == "full" else "early exit")
            ax.set_xticks(range(len(tasks)), tasks)
            ax.set_ylim(0, 1.05)
            ax.set_ylabel("accuracy (95% Wilson CI)")
            ax.legend(fontsize=8)
            ax.set_title("multiple choice", fontsize=9)
    fig.suptitle("Quality: " + _title(report), fontsize=10)
    return _save(fig, path)
