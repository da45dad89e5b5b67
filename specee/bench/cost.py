"""Where a decode token's time goes, and what early exit could reach with this drafter.

The oracle bound counts decoder layers; time also has parts that early exit does not shrink
(embedding, LM head, sampling, bookkeeping) and parts it adds (drafter, predictors,
verification heads). This module measures one decoder layer's cost on the decode path, splits
each configuration's time per decode token into those parts, and from them derives:

* ceiling(m) = full / (m * layer + other_full + drafter): the speedup of early exit that runs m
  layers per token with predictors that cost nothing and never miss, paying only for the
  drafter as measured (at the measured depth, and at the oracle's depth when given);
* layers_needed(S) = (full / S - other_full - drafter) / layer: the mean depth a speedup S
  requires (below 0: unreachable whatever the depth).

`other` of full depth stands in for early exit's non-layer, non-drafter time in both; the
split of each early-exit run shows how close that is. A configuration with exits inside
speculative verification runs its layers once per pass, not per token: its layers per token are
the mean exit layer x passes per token. A predictor check's cost is also given in layers.
"""
from __future__ import annotations

import statistics
from typing import Any

import torch

from ..clock import device_time
from .report import md_table

SPEEDUPS = (1.0, 1.2, 1.5)


@torch.inference_mode()
def layer_ms(model, prompt_ids: list[int], steps: int = 128) -> float:
    """Milliseconds one decoder layer takes in a batch-1 decode step, on the engine's path: the median
    over decode steps of their layers' time (the one layer-range call the engine makes) over the
    number of layers. (Steps through all layers against half of them, one call a layer, counted each
    call's overhead and the half model's luck in the CPU's caches: on an Intel Xeon, SmolLM2's 30
    layers came to 5.05 ms of a 4.49 ms token, leaving "other" at -0.55 ms.)"""
    from ..engine.full_depth import prefill
    from ..engine.runner import Segment, ragged_inputs

    L = model.cfg.num_layers
    prompt_ids = prompt_ids[-32:]
    steps = max(1, min(steps, model.cfg.max_position_embeddings - len(prompt_ids) - 1))
    cache = model.new_cache(1, len(prompt_ids) + steps + 1)
    token = model.logits(prefill(model, cache, [prompt_ids])).argmax(-1)  # [1]
    seconds = []
    for n in range(len(prompt_ids), len(prompt_ids) + steps):
        step = model.range_inputs(n, 1)
        batch = ragged_inputs([Segment(token, cache, step)], [step], [1])
        h = model.embed(token[None])
        t0 = device_time(model.device)
        h = model.ragged_layers(0, L, h, batch)
        seconds.append(device_time(model.device) - t0)
        token = model.logits(h[:, -1]).argmax(-1)
    return statistics.median(seconds) / L * 1e3


def cost_breakdown(configs: dict[str, dict[str, Any]], layer: float, num_layers: int,
                   oracle_layers: float | None = None) -> dict[str, Any]:
    """Per configuration (speed-report entries with decode_tokens_per_second, and for early exit
    mean_exit_layer and time_share): ms per decode token split into layers / drafter /
    predictors / verification / other, plus the ceilings of the module docstring."""
    out: dict[str, Any] = {"layer_ms": layer, "num_layers": num_layers, "oracle_layers": oracle_layers,
                           "configs": {}}
    full = configs.get("full")
    if full is None or not full.get("decode_tokens_per_second"):
        return out
    full_ms = 1e3 / full["decode_tokens_per_second"]
    other_full = full_ms - num_layers * layer
    out["configs"]["full"] = {"total_ms": full_ms, "layers_ms": num_layers * layer, "other_ms": other_full}
    for name, c in configs.items():
        if c.get("kind") != "early_exit" or not c.get("decode_tokens_per_second"):
            continue
        total = 1e3 / c["decode_tokens_per_second"]
        share = c.get("time_share", {})
        parts = {f"{p}_ms": share.get(p, 0.0) * total for p in ("drafter", "predictors", "verification")}
        depth = c.get("mean_exit_layer", num_layers)
        spec, steps = c.get("speculative"), c.get("decode_steps") or 0
        passes_per_token = spec["target_passes"] / steps if spec and steps else 1.0
        layers_ms = depth * layer * passes_per_token
        calls = c.get("predictor_calls") or 0
        check_ms = parts["predictors_ms"] * steps / calls if calls else None
        drafter = parts["drafter_ms"]

        def ceiling(m: float) -> float:
            return full_ms / (m * layer + other_full + drafter)

        needed = {f"{s:g}": (full_ms / s - other_full - drafter) / layer if layer > 0 else None for s in SPEEDUPS}
        out["configs"][name] = {
            "total_ms": total, "layers_ms": layers_ms, **parts,
            "other_ms": total - layers_ms - sum(parts.values()),
            "passes_per_token": passes_per_token,
            "check_ms": check_ms, "check_layers": check_ms / layer if check_ms is not None and layer > 0 else None,
            "ceiling_at_this_depth": ceiling(depth),
            "ceiling_at_oracle_depth": ceiling(oracle_layers) if oracle_layers is not None else None,
            "ceiling_without_drafter_at_oracle_depth":
                full_ms / (oracle_layers * layer + other_full) if oracle_layers is not None else None,
            "layers_needed": needed,
        }
    return out


def cost_markdown(cost: dict[str, Any], labels: dict[str, str]) -> str:
    cfgs = cost["configs"]
    if "full" not in cfgs:
        return ""
    L, layer, oracle = cost["num_layers"], cost["layer_ms"], cost.get("oracle_layers")
    rows = []
    for name, c in cfgs.items():
        rows.append([labels.get(name, name), c["total_ms"], c["layers_ms"], c.get("drafter_ms"), c.get("predictors_ms"),
                     c.get("verification_ms"), c["other_ms"], c.get("check_ms"), c.get("check_layers")])
    lines = ["## Where the time goes (ms per decode token)", "",
             f"One decoder layer costs {layer:.3f} ms on the decode path (measured: a batch-1 decode step's {L} "
             f"layers in the engine's one call, median over steps, over {L}). Layers = mean layers run x that "
             "(x passes per token with speculation); other = "
             "embedding, LM head, sampling, bookkeeping (and, for recompute, the carried rows). One check: a "
             "predictor call's cost, in ms and in layers.", "",
             md_table(["configuration", "total", "layers", "drafter", "predictors", "verification", "other",
                       "one check (ms)", "one check (layers)"], rows, digits=2), ""]
    ee = [n for n in cfgs if n != "full"]
    if ee:
        head = ["configuration", "ceiling at its depth"]
        if oracle is not None:
            head += [f"ceiling at oracle depth {oracle:.2f}", "same, drafter free"]
        head += [f"layers needed for {s:g}x" for s in SPEEDUPS]
        rows = []
        for n in ee:
            c = cfgs[n]
            row = [labels.get(n, n), c["ceiling_at_this_depth"]]
            if oracle is not None:
                row += [c["ceiling_at_oracle_depth"], c["ceiling_without_drafter_at_oracle_depth"]]
            row += [c["layers_needed"][f"{s:g}"] for s in SPEEDUPS]
            rows.append(row)
        lines += ["Ceilings: the speedup over full depth of early exit with predictors that cost nothing and never "
                  "miss, paying the drafter as measured; layers needed: the mean depth a speedup requires (below 0: "
                  "unreachable with this drafter at any depth).", "",
                  md_table(head, rows, digits=2), ""]
    return "\n".join(lines)
