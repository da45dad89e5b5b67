"""`specee bench speed`: decoding speed of full depth, early exit (per KV policy), lossless
mode and transformers' own `generate`, batch 1, greedy, every configuration decoding exactly
`max_new_tokens` tokens (EOS ignored).

Measurement: every configuration first gets `warmup` untimed runs (on the first prompt).
Then, per prompt, `repeats` rounds in which every configuration runs once, the order
alternating forward/backward between rounds, so drift of a shared machine hits all
configurations alike. A prompt's time is the median over its repeats (end-to-end and decode
separately); aggregates are total tokens / total median seconds, over all prompts and per
category.

* end-to-end tokens/s = generated tokens / (prefill + decode seconds)
* decode tokens/s = tokens produced by the decode loop / decode seconds. At full depth (specee
  and transformers) the first token comes out of the prefill, so that is N - 1 tokens; in
  early-exit mode only prompt[:-1] is prefilled and every one of the N tokens (the first one
  included) is a decode step.

For transformers the prefill/decode split is taken from a streamer's timestamp of the first
generated token (the streamer copies each token to the host, which synchronises the device).
One timed run of each kind is in timing.py.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..exit.config import KV_POLICIES as POLICIES
from ..exit.stats import mean_layers_run
from .common import BenchError, fit_prompt, make_config, median, progress, ratio, resolve_chat, use_config
from .report import environment, environment_md, md_table
from .tasks import Prompt
from .timing import ConfigSpec, Run, hf_run, in_turns, load_hf_model, specee_run


# ---- the benchmark -------------------------------------------------------------------------
def config_specs(draft: str, bank: str | None, k: int, policies: Sequence[str], lossless: bool, hf: bool,
                 ee_options: dict[str, Any] | None = None) -> list[ConfigSpec]:
    opts = dict(ee_options or {})
    specs = []
    if hf:
        specs.append(ConfigSpec("transformers", "transformers generate", "hf"))
    specs.append(ConfigSpec("full", "specee full depth", "full"))
    for policy in policies:
        specs.append(ConfigSpec(f"ee-{policy}", f"early exit ({policy})", "early_exit",
                                make_config(draft, bank, k, kv_policy=policy, mode="lossy", **opts)))
    if lossless:
        specs.append(ConfigSpec("lossless", "lossless (recompute)", "early_exit",
                                make_config(draft, bank, k, kv_policy="recompute", mode="lossless", **opts)))
    return specs


def merged_specs(speculative: list[dict[str, Any]], draft: str, bank: str | None, k: int, policies: Sequence[str],
                 lossless: bool, ee_options: dict[str, Any] | None = None) -> list[ConfigSpec]:
    """Each speculative config the early-exit drafter can draft for, with SpecEE's exits inside its
    verification passes: lossy per KV policy, and lossless."""
    from ..engine.loading import merged_config
    from ..speculative.config import SpeculativeConfig

    opts = {key: v for key, v in (ee_options or {}).items() if key != "num_draft_tokens"}
    modes = [(p, "lossy") for p in policies] + ([("recompute", "lossless")] if lossless else [])
    specs = []
    for raw in speculative:
        c = SpeculativeConfig.parse(raw)
        for policy, mode in modes:
            try:
                config = merged_config(make_config(draft, bank, k, kv_policy=policy, mode=mode, **opts), raw)
            except ValueError:  # a drafter the early-exit drafter is not (eagle, another model)
                break
            what = policy if mode == "lossy" else "lossless"
            specs.append(ConfigSpec(f"spec-{c.method}-n{c.num_speculative_tokens}+ee-{what}",
                                    f"speculative {c.method}, {c.num_speculative_tokens} tokens + SpecEE ({what})",
                                    "early_exit", config))
    return specs


def _aggregate(runs: list[Run], per_run: list[list[Run]]) -> dict[str, Any]:
    """runs: one representative (median) record per prompt."""
    tokens = sum(r.tokens for r in runs)
    seconds = sum(r.prefill_seconds + r.decode_seconds for r in runs)
    dtok = sum(r.decode_tokens for r in runs)
    dsec = sum(r.decode_seconds for r in runs)
    out: dict[str, Any] = {
        "prompts": len(runs),
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": tokens / seconds if seconds > 0 else None,
        "decode_tokens_per_second": dtok / dsec if dsec > 0 else None,
    }
    ees = [rs[0].early_exit for rs in per_run if rs and rs[0].early_exit is not None]
    if ees:
        L = ees[0]["num_layers"]
        hist = [0] * L
        for e in ees:
            for i, c in enumerate(e["exit_histogram"]):
                hist[i] += c
        steps = sum(hist)
        out["exit_histogram"] = hist
        out["decode_steps"] = steps
        out["num_layers"] = L
        out["mean_exit_layer"] = mean_layers_run(hist) if steps else float(L)
        for key in ("predictor_calls", "exits_accepted", "exits_rejected", "forced_full_depth"):
            out[key] = sum(e.get(key, 0) for e in ees)
        weights = [rs[0].decode_seconds for rs in per_run if rs and rs[0].early_exit is not None]
        wsum = sum(weights) or 1.0
        out["time_share"] = {part: sum(w * e.get("time_share", {}).get(part, 0.0) for w, e in zip(weights, ees)) / wsum
                             for part in ("drafter", "predictors", "verification")}
        ll = [e["lossless"] for e in ees if e.get("lossless")]
        if ll or any(e.get("mode") == "lossless" for e in ees):
            agg = {key: sum(x.get(key, 0) for x in ll) for key in
                   ("deep_passes", "verified_positions", "rollbacks", "discarded_tokens")}
            agg["verified_per_deep_pass"] = (agg["verified_positions"] / agg["deep_passes"]
                                             if agg["deep_passes"] else None)
            out["lossless"] = agg
    sps = [rs[0].speculative for rs in per_run if rs and rs[0].speculative is not None]
    if sps:
        from .speculative import aggregate_speculative

        out["speculative"] = aggregate_speculative(sps)
    return out


def _median_run(runs: list[Run]) -> Run:
    first = runs[0]
    return Run(first.tokens, median(r.prefill_seconds for r in runs), median(r.decode_seconds for r in runs),
               first.decode_tokens, first.token_ids, first.early_exit, first.speculative)


def identity(ref: list[int], other: list[int]) -> dict[str, Any]:
    n = min(len(ref), len(other))
    first = next((i for i in range(n) if ref[i] != other[i]), None)
    if first is None and len(ref) != len(other):
        first = n
    return {"identical": first is None, "first_mismatch": first,
            "matching_prefix": n if first is None else first, "tokens": len(ref),
            "same_token_rate": (sum(a == b for a, b in zip(ref, other)) / len(ref)) if ref else 1.0}


def run_speed(llm, prompts: Sequence[Prompt], *, draft: str, bank: str | None = None, k: int = 4,
              max_new_tokens: int = 128, repeats: int = 3, warmup: int = 1,
              policies: Sequence[str] = POLICIES, lossless: bool = True, hf: bool = True,
              chat: str | bool = "auto", ee_options: dict[str, Any] | None = None, show_progress: bool = True,
              argv: Sequence[str] | None = None, oracle_layers: float | None = None,
              speculative: Sequence[dict[str, Any]] = (), hf_prompt_lookup: int | None = None,
              hf_assistant: str | None = None, measure_row_costs: bool = False,
              llama_cpp: bool = False, llama_cpp_lookup: int = 0) -> dict[str, Any]:
    """Measure every configuration on `prompts`; returns the report dict (see module doc).
    oracle_layers: the oracle's mean layers run (`specee bench oracle`), for the cost ceilings.
    speculative: speculative_config dicts to run; hf_prompt_lookup / hf_assistant: transformers'
    assisted generation peers; measure_row_costs: the target's cost per verified row (bench/speculative.py);
    llama_cpp: llama.cpp on the same GGUF as a peer (bench/llama_cpp.py); llama_cpp_lookup: also
    llama.cpp with its prompt-lookup speculation, that many tokens per step (0: not run)."""
    from .speculative import SPEC_KINDS, SpeculativeRunner, row_costs, speculative_specs

    if repeats < 1 or warmup < 0:
        raise BenchError("--repeats must be >= 1 and --warmup >= 0")
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        raise BenchError(f"unknown KV policies {bad}; choose from {', '.join(POLICIES)}")
    use_chat = resolve_chat(llm, chat)
    fitted = [fit_prompt(llm, p.text, use_chat, max_new_tokens) for p in prompts]
    specs = config_specs(draft, bank, k, policies, lossless, hf, ee_options)
    specs += speculative_specs(list(speculative), hf_prompt_lookup, hf_assistant)
    specs += merged_specs(list(speculative), draft, bank, k, policies, lossless, ee_options)
    peers = [("llama.cpp", "llama.cpp (same GGUF, native kernels)", 0)] if llama_cpp else []
    if llama_cpp_lookup:
        peers.append((f"llama.cpp-lookup{llama_cpp_lookup}",
                      f"llama.cpp, prompt-lookup speculation ({llama_cpp_lookup} tokens)", llama_cpp_lookup))
    llama_peers = {}
    if peers:
        import torch

        from .llama_cpp import LlamaCppPeer

        context = max(len(ids) for ids, _ in fitted) + max_new_tokens + llama_cpp_lookup + 1
        for name, what, lookup in peers:
            peer = llama_peers[name] = LlamaCppPeer(llm.model_dir, torch.get_num_threads(), context, lookup)
            specs.append(ConfigSpec(name, f"{what}, {peer.notes}" if peer.notes else what, "llama_cpp"))
    hf_model = None
    if hf or any(s.kind == "hf_assisted" for s in specs):
        if not show_progress:
            try:
                from transformers.utils import logging as hf_logging

                hf_logging.disable_progress_bar()
            except ImportError:
                pass
        hf_model = load_hf_model(llm.model_dir, llm.model.device, llm.model.dtype)
    spec_runner = SpeculativeRunner(llm, hf_model)

    def run_one(spec: ConfigSpec, ids: list[int], n: int) -> Run:
        if spec.kind in SPEC_KINDS:
            return spec_runner.run(spec, ids, n)
        if spec.kind == "hf":
            return hf_run(hf_model, ids, n, sorted(llm.eos_ids))
        if spec.kind == "llama_cpp":
            return llama_peers[spec.name].run(ids, n)
        use_config(llm, spec.config if spec.kind == "early_exit" else None)
        return specee_run(llm, ids, n)

    # Runs are interleaved: per prompt and repeat every configuration runs once (in_turns).
    runs: dict[str, list[list[Run]]] = {spec.name: [[] for _ in fitted] for spec in specs}
    bar = progress(total=len(specs) * (warmup + len(fitted) * repeats), enabled=show_progress, desc="speed",
                   unit="run")
    try:
        for spec in specs:  # warm-up (also loads the drafter / calibrates a bank on first use)
            bar.set_description(f"speed: warm-up {spec.name}")
            for _ in range(warmup):
                run_one(spec, fitted[0][0], min(max_new_tokens, 8))
                bar.update(1)
        for turn, spec in in_turns(specs, len(fitted) * repeats):
            i = turn // repeats
            bar.set_description(f"speed: prompt {i + 1}/{len(fitted)}")
            runs[spec.name][i].append(run_one(spec, fitted[i][0], max_new_tokens))
            bar.update(1)
    finally:
        bar.close()
        use_config(llm, None)
        for peer in llama_peers.values():
            peer.close()

    results: dict[str, dict[str, Any]] = {}
    tokens_by_config: dict[str, list[list[int]]] = {}
    cats: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        cats.setdefault(p.category, []).append(i)
    for spec in specs:
        per_prompt_runs = runs[spec.name]
        med = [_median_run(rs) for rs in per_prompt_runs]
        res = _aggregate(med, per_prompt_runs)
        res.update(label=spec.label, kind=spec.kind)
        if spec.kind == "early_exit":
            res.update(kv_policy=spec.config.kv_policy, mode=spec.config.mode)
            res["offline_layers"] = (per_prompt_runs[0][0].early_exit or {}).get("offline_layers")
        res["per_category"] = {c: _aggregate([med[i] for i in idx], [per_prompt_runs[i] for i in idx])
                               for c, idx in cats.items()}
        res["per_prompt"] = [{
            "id": p.id, "category": p.category, "tokens": m.tokens,
            "seconds": m.prefill_seconds + m.decode_seconds, "prefill_seconds": m.prefill_seconds,
            "decode_seconds": m.decode_seconds,
            "mean_exit_layer": None if m.early_exit is None else m.early_exit.get("mean_exit_layer"),
            "repeat_seconds": [r.prefill_seconds + r.decode_seconds for r in rs],
        } for p, m, rs in zip(prompts, med, per_prompt_runs)]
        results[spec.name] = res
        tokens_by_config[spec.name] = [rs[0].token_ids for rs in per_prompt_runs]

    # speedups against both baselines, overall and per category
    def attach(res: dict[str, Any], full: dict[str, Any] | None, base_hf: dict[str, Any] | None) -> None:
        for key, metric in (("speedup", "tokens_per_second"), ("decode_speedup", "decode_tokens_per_second")):
            res[f"{key}_vs_full"] = ratio(res.get(metric), full.get(metric) if full else None)
            res[f"{key}_vs_hf"] = ratio(res.get(metric), base_hf.get(metric) if base_hf else None)

    full, base_hf = results.get("full"), results.get("transformers")
    for res in results.values():
        attach(res, full, base_hf)
        for c, cres in res["per_category"].items():
            attach(cres, full["per_category"][c] if full else None,
                   base_hf["per_category"][c] if base_hf else None)

    ident: dict[str, Any] = {}
    ref = tokens_by_config["full"]
    for name in tokens_by_config:
        if name == "full":
            continue
        rows = [dict(id=p.id, category=p.category, **identity(r, o))
                for p, r, o in zip(prompts, ref, tokens_by_config[name])]
        ident[name] = {"identical_prompts": sum(r["identical"] for r in rows), "prompts": len(rows),
                       "all_identical": all(r["identical"] for r in rows),
                       "same_token_rate": sum(r["same_token_rate"] for r in rows) / len(rows),
                       "per_prompt": rows}

    cost = None
    if "full" in results:
        from .cost import cost_breakdown, layer_ms

        cost = cost_breakdown(results, layer_ms(llm.model, fitted[0][0]), llm.model.cfg.num_layers, oracle_layers)
    return {
        "benchmark": "speed",
        "environment": environment(llm, draft=draft, bank=bank, argv=argv),
        "weights": {"quantization": llm.quantization, "resident_bytes": llm.model.weight_bytes()},
        "settings": {"max_new_tokens": max_new_tokens, "repeats": repeats, "warmup": warmup, "batch_size": 1,
                     "greedy": True, "ignore_eos": True, "chat_template": use_chat, "k": k,
                     "policies": list(policies), "lossless": lossless, "transformers_baseline": hf,
                     "early_exit_options": dict(ee_options or {})},
        "prompts": [{"id": p.id, "category": p.category, "prompt_tokens": len(ids), "truncated": tr}
                    for p, (ids, tr) in zip(prompts, fitted)],
        "order": list(results),
        "configs": results,
        "identity": ident,
        "cost": cost,
        "speculative": [dict(c) if isinstance(c, dict) else c.as_dict() for c in speculative],
        "row_costs": row_costs(llm.model_dir, llm.model.device) if measure_row_costs else None,
    }


# ---- rendering --------------------------------------------------------------------------------
def speed_markdown(report: dict[str, Any]) -> str:
    cfgs, order = report["configs"], report["order"]
    s = report["settings"]
    L = report["environment"].get("target", {}).get("layers")
    lines = ["# specee bench speed",
             "",
             f"{len(report['prompts'])} prompts, {s['max_new_tokens']} new tokens each (EOS ignored), batch 1, greedy, "
             f"median of {s['repeats']} runs after {s['warmup']} warm-up run(s).",
             f"Weights: {report['weights']['quantization'] or 'float'}, "
             f"{report['weights']['resident_bytes'] / 2**20:.1f} MiB resident.",
             "",
             md_table(["configuration", "tokens/s", "decode tokens/s", f"mean exit layer (of {L})",
                       "speedup vs full", "speedup vs transformers", "decode speedup vs full"],
                      [[cfgs[n]["label"], cfgs[n]["tokens_per_second"], cfgs[n]["decode_tokens_per_second"],
                        cfgs[n].get("mean_exit_layer"), cfgs[n]["speedup_vs_full"], cfgs[n]["speedup_vs_hf"],
                        cfgs[n]["decode_speedup_vs_full"]] for n in order]),
             ""]
    ee = [n for n in order if cfgs[n]["kind"] == "early_exit"]
    if ee:
        lines += ["## Early-exit details", "",
                  md_table(["configuration", "exits accepted", "exits rejected", "predictor calls", "forced full depth",
                            "time drafter", "time predictors", "time verification"],
                           [[cfgs[n]["label"], cfgs[n].get("exits_accepted"), cfgs[n].get("exits_rejected"),
                             cfgs[n].get("predictor_calls"), cfgs[n].get("forced_full_depth"),
                             cfgs[n]["time_share"]["drafter"], cfgs[n]["time_share"]["predictors"],
                             cfgs[n]["time_share"]["verification"]] for n in ee], digits=3), ""]
        if "lossless" in cfgs and cfgs["lossless"].get("lossless"):
            x = cfgs["lossless"]["lossless"]
            lines += [f"Lossless: {x['deep_passes']} deep passes verified {x['verified_positions']} positions "
                      f"({fmt_num(x['verified_per_deep_pass'])} per pass), {x['rollbacks']} rollbacks, "
                      f"{x['discarded_tokens']} tokens discarded.", ""]
    if report.get("cost"):
        from .cost import cost_markdown

        lines += [cost_markdown(report["cost"], {n: cfgs[n]["label"] for n in order})]
    cats = list(cfgs[order[0]]["per_category"])
    lines += ["## Per category (tokens/s, speedup vs full depth in parentheses, mean exit layer in brackets)", ""]
    rows = []
    for c in cats:
        row: list[Any] = [c, cfgs[order[0]]["per_category"][c]["prompts"]]
        for n in order:
            r = cfgs[n]["per_category"][c]
            cell = fmt_num(r["tokens_per_second"], 1)
            if n != "full" and r.get("speedup_vs_full") is not None:
                cell += f" ({r['speedup_vs_full']:.2f}x)"
            if r.get("mean_exit_layer") is not None:
                cell += f" [{r['mean_exit_layer']:.1f}]"
            row.append(cell)
        rows.append(row)
    lines += [md_table(["category", "prompts"] + [cfgs[n]["label"] for n in order], rows), ""]
    ident = report.get("identity", {})
    if "lossless" in ident:
        x = ident["lossless"]
        verdict = "IDENTICAL" if x["all_identical"] else "DIFFERENT"
        lines += [f"## Token identity: lossless vs full depth: {verdict} "
                  f"({x['identical_prompts']}/{x['prompts']} prompts identical)", "",
                  md_table(["prompt", "category", "identical", "first mismatch", "matching prefix"],
                           [[r["id"], r["category"], r["identical"], r["first_mismatch"],
                             f"{r['matching_prefix']}/{r['tokens']}"] for r in x["per_prompt"]]), ""]
    others = [n for n in ident if n != "lossless"]
    if others:
        lines += ["Greedy tokens equal to specee full depth (lossy early exit drifts by design; transformers may "
                  "differ by rounding):", "",
                  md_table(["configuration", "identical prompts", "same-token rate"],
                           [[cfgs[n]["label"], f"{ident[n]['identical_prompts']}/{ident[n]['prompts']}",
                             ident[n]["same_token_rate"]] for n in others], digits=3), ""]
    from .speculative import speculative_markdown

    lines += [speculative_markdown(report)]
    lines += ["## Environment", "", environment_md(report["environment"]), ""]
    return "\n".join(lines)


def fmt_num(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"
