"""What each `specee bench` benchmark does once its flags are parsed: `cmd_<name>(args) -> int`, and the
steps they share (models from --model/--draft, the prompt set, the report). Errors are raised as
`BenchError` (a ValueError), before any model loads where the flags alone can tell."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..cli.args import quantization_mode
from .common import DEFAULT_DRAFT, DEFAULT_TARGET, BenchError, find_shared, parse_list
from .plots import draw_figures
from .report import write_json, write_text
from .tasks import MC_TASKS, load_prompts


def ee_options(args: argparse.Namespace) -> dict[str, Any]:
    return {"threshold_scale": args.threshold_scale, "offline_size": args.offline_size,
            "online_window": args.online_window, "online_radius": args.online_radius,
            "max_pending": args.max_pending, "num_draft_tokens": args.draft_tokens, "check_cost": args.check_cost}


def resolve_models(args: argparse.Namespace) -> tuple[Path, str]:
    """(target checkpoint directory or .gguf file, drafter) from --model/--draft, defaulting to the
    reference pair in ../shared."""
    from ..model.resolve import resolve_model

    shared = find_shared(args.shared)
    if args.model is None:
        if shared is None:
            raise BenchError("no --model given and the shared folder (../shared) was not found; pass --model DIR "
                             "--draft DIR|ngram (or --shared DIR)")
        model = shared.joinpath(*DEFAULT_TARGET)
        draft = args.draft or str(shared.joinpath(*DEFAULT_DRAFT))
    else:
        model = args.model
        if args.draft is None:
            raise BenchError("--draft is required with --model: a draft model directory sharing the target's "
                             "tokenizer, or 'ngram'")
        draft = args.draft
    model = resolve_model(model)
    if draft != "ngram":
        draft = str(resolve_model(draft, what="draft model"))
    return model, draft


def load_target(args: argparse.Namespace, model: Path):
    import torch

    from ..engine.llm import LLM

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise BenchError(f"--device {args.device}: CUDA is not available (torch {torch.__version__})")
    llm = LLM(model, device=args.device, dtype=args.dtype, progress=not args.no_progress,
              quantization=quantization_mode(args), threads=args.threads)
    llm.threads.hold()  # measured once at load: every configuration then runs with that count
    return llm


def prompts_from(args: argparse.Namespace):
    return load_prompts(args.prompts, parse_list(args.categories), args.count, args.total, args.shared)


def argv_of(args: argparse.Namespace) -> list[str]:
    return getattr(args, "_argv", None) or ["specee", *sys.argv[1:]]


def finish(args: argparse.Namespace, report: dict[str, Any], markdown: str, figures: dict[str, Any]) -> int:
    """Print the Markdown summary; with --out write report.json, report.md and the figures (skipped,
    with a note on stderr, where matplotlib is not installed)."""
    sys.stdout.write(markdown if markdown.endswith("\n") else markdown + "\n")
    sys.stdout.flush()
    if args.out:
        out = Path(args.out)
        written = [write_json(out / "report.json", report)]
        made = draw_figures(report, out, figures)
        if made:
            markdown += "\n## Figures\n\n" + "\n".join(f"![{p.stem}]({p.name})" for p in made) + "\n"
        written.append(write_text(out / "report.md", markdown))
        written += made
        print(f"specee bench: wrote {', '.join(str(p) for p in written)}", file=sys.stderr)
    return 0


# ---- the benchmarks ---------------------------------------------------------------------------
def flag_list(args: argparse.Namespace, flag: str, kind=str) -> list:
    """The comma-separated values of `flag`, parsed before any model loads; an error names the flag."""
    try:
        return parse_list(getattr(args, flag[2:].replace("-", "_")), kind) or []
    except BenchError as e:
        raise BenchError(f"{flag}: {e}") from None


def checked_policies(args: argparse.Namespace) -> list[str]:
    from .speed import POLICIES

    policies = flag_list(args, "--policies")
    if bad := [p for p in policies if p not in POLICIES]:
        raise BenchError(f"--policies: unknown {bad}; choose from {', '.join(POLICIES)}")
    return policies


def cmd_speed(args: argparse.Namespace) -> int:
    from . import plots
    from .speed import run_speed, speed_markdown

    policies = checked_policies(args)
    model, draft = resolve_models(args)
    if args.oracle_layers is not None:  # a mean past the model's depth gave ceilings below 1x, unremarked
        from ..model.llama import model_config

        layers = model_config(model).num_layers
        if not 1 <= args.oracle_layers <= layers:
            raise BenchError(f"--oracle-layers {args.oracle_layers:g}: the oracle's mean layers run lies between 1 "
                             f"and the model's {layers} layers")
    if args.llama_cpp or args.llama_cpp_lookup:
        from .llama_cpp import check_target

        check_target(model, "--llama-cpp" if args.llama_cpp else "--llama-cpp-lookup")
    if args.hf_assistant:  # a wrong one failed after the target loaded and calibrated, naming no flag
        from ..model.resolve import resolve_model

        try:
            args.hf_assistant = str(resolve_model(args.hf_assistant, what="assistant model"))
        except (OSError, ValueError) as e:
            raise BenchError(f"--hf-assistant: {e}") from None
    prompts = prompts_from(args)
    llm = load_target(args, model)
    report = run_speed(llm, prompts, draft=draft, bank=args.bank, k=args.k, max_new_tokens=args.max_new_tokens,
                       repeats=args.repeats, warmup=args.warmup, policies=policies, lossless=not args.no_lossless,
                       hf=not args.no_hf, chat=args.chat, ee_options=ee_options(args),
                       show_progress=not args.no_progress, argv=argv_of(args), oracle_layers=args.oracle_layers,
                       speculative=args.speculative_config, hf_prompt_lookup=args.hf_prompt_lookup,
                       hf_assistant=args.hf_assistant, measure_row_costs=args.row_costs,
                       llama_cpp=args.llama_cpp, llama_cpp_lookup=args.llama_cpp_lookup)
    return finish(args, report, speed_markdown(report),
                  {"exit_histogram.png": plots.plot_exit_histograms, "throughput.png": plots.plot_throughput})


def cmd_quality(args: argparse.Namespace) -> int:
    from ..model.llama import model_config
    from . import plots
    from .quality import PARTS, checked_ppl_window, quality_markdown, run_quality

    parts, tasks = flag_list(args, "--parts"), flag_list(args, "--mc-tasks")
    for flag, values, known in (("--parts", parts, PARTS), ("--mc-tasks", tasks, MC_TASKS)):
        if bad := [v for v in values if v not in known]:  # an unknown part failed after the model loaded
            raise BenchError(f"{flag}: unknown {bad}; choose from {', '.join(known)}")
    policies = checked_policies(args)  # an unknown one failed after the model loaded
    model, draft = resolve_models(args)
    if "ppl" in parts:  # a window past the context was silently shortened to it
        args.ppl_window = checked_ppl_window(args.ppl_window, model_config(model).context_limit)
    prompts = prompts_from(args) if "agreement" in parts else []
    llm = load_target(args, model)
    report = run_quality(llm, prompts, draft=draft, bank=args.bank, k=args.k, policies=policies,
                         parts=parts, max_new_tokens=args.max_new_tokens, chat=args.chat, ppl_tokens=args.ppl_tokens,
                         ppl_window=args.ppl_window, ppl_file=args.ppl_file, mc_tasks=tasks, mc_items=args.mc_items,
                         shots=args.shots, mmlu_subjects=parse_list(args.mmlu_subjects), shared=args.shared,
                         ee_options=ee_options(args), show_progress=not args.no_progress, argv=argv_of(args))
    return finish(args, report, quality_markdown(report), {"quality.png": plots.plot_quality})


def cmd_oracle(args: argparse.Namespace) -> int:
    from . import plots
    from .oracle import oracle_markdown, run_oracle

    model, draft = resolve_models(args)
    prompts = prompts_from(args)
    llm = load_target(args, model)
    report = run_oracle(llm, prompts, draft=draft, k=args.k, max_new_tokens=args.max_new_tokens, chat=args.chat,
                        show_progress=not args.no_progress, argv=argv_of(args), draft_tokens=args.draft_tokens)
    return finish(args, report, oracle_markdown(report), {"oracle_exit_layers.png": plots.plot_oracle})


def _offline_sizes(value: str) -> list[int | None]:
    out: list[int | None] = []
    for v in (value or "").split(","):
        v = v.strip()
        if not v:
            continue
        if v == "bank":
            out.append(None)
            continue
        try:
            out.append(int(v))
        except ValueError:
            raise BenchError(f"--offline-sizes: expected integers or 'bank', got {v!r}") from None
    return out


def cmd_sweep(args: argparse.Namespace) -> int:
    from . import plots
    from .speed import POLICIES
    from .sweep import run_sweep, sweep_markdown

    if args.policy not in POLICIES:
        raise BenchError(f"--policy must be one of {', '.join(POLICIES)}")
    scales = flag_list(args, "--scales", float)
    if any(not 0 < s < float("inf") for s in scales):
        raise BenchError(f"--scales must be finite and > 0, got {args.scales!r}")
    online_windows = flag_list(args, "--online-windows", int)
    if any(w < 0 for w in online_windows):
        raise BenchError(f"--online-windows must be >= 0, got {args.online_windows!r}")
    offline_sizes = _offline_sizes(args.offline_sizes)
    if any(n is not None and n < 0 for n in offline_sizes):
        raise BenchError(f"--offline-sizes must be >= 0 or 'bank', got {args.offline_sizes!r}")
    model, draft = resolve_models(args)
    prompts = prompts_from(args)
    llm = load_target(args, model)
    opts = ee_options(args)
    report = run_sweep(llm, prompts, draft=draft, bank=args.bank, k=args.k, policy=args.policy, scales=scales,
                       offline_sizes=offline_sizes, online_windows=online_windows, grid=args.grid,
                       max_new_tokens=args.max_new_tokens, repeats=args.repeats, warmup=args.warmup, chat=args.chat,
                       ee_options=opts, show_progress=not args.no_progress, argv=argv_of(args))
    return finish(args, report, sweep_markdown(report), {"pareto.png": plots.plot_pareto})


def cmd_serve_bench(args: argparse.Namespace) -> int:
    from .serve import plot_serve, run_serve_bench, serve_markdown

    servers = dict(server_arg(v) for v in args.server or ["specee=http://127.0.0.1:8000"])
    prompts = load_prompts(args.prompts, parse_list(args.categories), None, args.total, args.shared)
    report = run_serve_bench(servers, prompts, concurrency=args.concurrency, model=args.served_model,
                             max_tokens=args.max_new_tokens, requests=args.requests, api_key=args.api_key,
                             ignore_eos=not args.no_ignore_eos,
                             eos_fields=dict.fromkeys(args.min_tokens_for, "min_tokens"))
    if all(r["errors"] == r["requests"] for r in report["rows"]):  # nothing to report, nor to plot
        first = report["rows"][0]
        raise BenchError(f"every request failed (the first, to {first['server']}: {first['first_error']})")
    return finish(args, report, serve_markdown(report), {"serve.png": plot_serve})


def server_arg(value: str) -> tuple[str, str]:
    name, sep, url = value.partition("=")
    if not sep or not url.startswith(("http://", "https://")):
        raise BenchError(f"--server {value!r}: expected NAME=URL, e.g. specee=http://127.0.0.1:8000")
    return name, url
