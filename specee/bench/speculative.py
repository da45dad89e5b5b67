"""The speculative-decoding part of `specee bench speed`: specee's speculative configurations,
transformers' assisted generation as peers (prompt lookup; an assistant model), and what
limits the gain: the target's cost per extra verified row.

Every configuration here runs in the same interleaved rounds as the others in speed.py, so
their ratios to full depth and to transformers come from one run.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..clock import device_time
from .common import median
from .report import md_table
from .timing import ConfigSpec, hf_run, in_turns, load_hf_model, specee_run

SPEC_KINDS = ("speculative", "hf_assisted")


def speculative_specs(configs: list[dict[str, Any]], prompt_lookup: int | None, assistant: str | None) -> list:
    """ConfigSpecs for specee's speculative configs and transformers' assisted-generation peers."""
    from ..speculative.config import SpeculativeConfig

    specs = []
    for raw in configs:
        c = SpeculativeConfig.parse(raw)
        tree = "" if c.tree is None else f"-tree{c.tree.topk}x{c.tree.size}"
        name = f"spec-{c.method}-n{c.num_speculative_tokens}{tree}"
        label = f"speculative {c.method}, {c.num_speculative_tokens} tokens" + (
            "" if c.tree is None else f", tree top-{c.tree.topk} / {c.tree.size} nodes")
        specs.append(ConfigSpec(name, label, "speculative", c))
    if prompt_lookup:
        specs.append(ConfigSpec("hf-prompt-lookup", f"transformers assisted (prompt lookup {prompt_lookup})",
                                "hf_assisted", {"prompt_lookup_num_tokens": prompt_lookup}))
    if assistant:
        specs.append(ConfigSpec("hf-assistant", "transformers assisted (assistant model)", "hf_assisted",
                                {"assistant_model": assistant}))
    return specs


class SpeculativeRunner:
    """Runs the speculative kinds; decoders and assistant models are built once per configuration."""

    def __init__(self, llm, hf_model=None):
        self.llm, self.hf_model = llm, hf_model
        self.decoders: dict[str, Any] = {}
        self.assistants: dict[str, Any] = {}

    def run(self, spec, ids: list[int], max_new_tokens: int):
        llm = self.llm
        if spec.kind == "speculative":
            if spec.name not in self.decoders:
                from ..speculative.config import make_decoder

                self.decoders[spec.name] = make_decoder(llm, spec.config)
            llm.early_exit, llm.speculative = None, self.decoders[spec.name]
            try:
                return specee_run(llm, ids, max_new_tokens)
            finally:
                llm.speculative = None
        extra = dict(spec.config)
        if "assistant_model" in extra:
            path = extra["assistant_model"]
            if path not in self.assistants:
                self.assistants[path] = load_hf_model(path, llm.model.device, llm.model.dtype)
            extra["assistant_model"] = self.assistants[path]
        return hf_run(self.hf_model, ids, max_new_tokens, sorted(llm.eos_ids), extra)


def aggregate_speculative(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """Sum the per-prompt speculative stats into one record (vLLM's metrics)."""
    drafts = sum(s["drafts"] for s in stats)
    draft_tokens = sum(s["draft_tokens"] for s in stats)
    accepted = sum(s["accepted_tokens"] for s in stats)
    positions = max(len(s["acceptance_rate_per_position"]) for s in stats)
    per_pos = [sum(s["acceptance_rate_per_position"][j] * s["drafts"] for s in stats
                   if j < len(s["acceptance_rate_per_position"])) / max(drafts, 1) for j in range(positions)]
    return {"drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
            "target_passes": sum(s["target_passes"] for s in stats),
            "mean_accepted_length": 1 + accepted / max(drafts, 1),
            "acceptance_rate": accepted / max(draft_tokens, 1), "acceptance_rate_per_position": per_pos,
            "draft_time_share": sum(s["draft_time_share"] for s in stats) / len(stats)}


# ---- what limits the gain: the target's cost per verified row --------------------------------------
WEIGHT_FORMATS = (("float32", "float32", None), ("bfloat16", "bfloat16", None), ("int8", "float32", "int8"),
                  ("int4", "float32", "int4"))  # (label, dtype, quantization); integer kernels run in bfloat16
AS_STORED = ("gguf as stored", "float32", "auto")  # a GGUF file's own blocks: the default path


def row_costs(model_dir, device, rows: tuple[int, ...] = (1, 2, 4, 8),
              formats: tuple[tuple[str, str, str | None], ...] | None = None,
              context: int = 128, repeats: int = 9) -> dict[str, Any]:
    """Milliseconds of one target pass (all layers + LM head) over `rows` rows after `context`
    committed tokens, per weight format: the price of verifying rows - 1 draft tokens. A GGUF
    file is measured first as stored (`--quantization auto`, what decoding runs by default), then
    requantized to each of WEIGHT_FORMATS."""
    import torch

    from ..engine.loading import DTYPES
    from ..model.llama import Transformer
    from ..model.resolve import is_gguf

    if formats is None:
        formats = ((AS_STORED,) if is_gguf(Path(model_dir)) else ()) + WEIGHT_FORMATS
    out: dict[str, Any] = {"context": context, "rows": list(rows), "ms": {}, "unsupported": {}}
    for name, dtype, quantization in formats:
        try:
            model = Transformer.load(model_dir, device, DTYPES[dtype], quantization)
        except ValueError as e:  # e.g. int4 on a matrix whose width is not a multiple of its group
            out["unsupported"][name] = str(e)
            continue
        cache = model.new_cache(1, context + max(rows))
        with torch.inference_mode():
            model.forward(torch.zeros(1, context, dtype=torch.long, device=model.device),
                          model.range_inputs(0, context), cache)
            passes = {S: (torch.zeros(1, S, dtype=torch.long, device=model.device), model.range_inputs(context, S))
                      for S in rows}
            samples: dict[int, list[float]] = {S: [] for S in rows}
            for _, S in in_turns(rows, repeats + 1):  # the first pass warms up
                tokens, step = passes[S]
                t = device_time(model.device)
                model.logits(model.forward(tokens, step, cache))
                samples[S].append(device_time(model.device) - t)
        out["ms"][name] = [1000 * median(samples[S][1:]) for S in rows]
        del model, cache
    return out


def speculative_markdown(report: dict[str, Any]) -> str:
    cfgs = report["configs"]
    spec = [n for n in report["order"] if cfgs[n]["kind"] == "speculative"]
    lines: list[str] = []
    if spec:
        peer = cfgs.get("hf-prompt-lookup", {}).get("tokens_per_second")
        lines += ["## Speculative decoding", "",
                  md_table(["configuration", "speedup vs full", "speedup vs transformers prompt lookup",
                            "mean accepted length", "acceptance rate", "per draft position", "draft time share"],
                           [[cfgs[n]["label"], cfgs[n]["speedup_vs_full"],
                             cfgs[n]["tokens_per_second"] / peer if peer and cfgs[n]["tokens_per_second"] else None,
                             cfgs[n]["speculative"]["mean_accepted_length"], cfgs[n]["speculative"]["acceptance_rate"],
                             " ".join(f"{r:.2f}" for r in cfgs[n]["speculative"]["acceptance_rate_per_position"]),
                             cfgs[n]["speculative"]["draft_time_share"]] for n in spec], digits=3), ""]
    costs = report.get("row_costs")
    if costs:
        head = ["weights"] + [f"{r} row{'s' if r > 1 else ''} (ms)" for r in costs["rows"]] + \
               [f"{r} rows / 1 row" for r in costs["rows"][1:]]
        body = [[d] + ms + [m / ms[0] for m in ms[1:]] for d, ms in costs["ms"].items()]
        lines += [f"### Target pass cost per verified rows (after {costs['context']} tokens)", "",
                  md_table(head, body, digits=2), ""]
        lines += [f"- {name}: not measured ({why})" for name, why in costs.get("unsupported", {}).items()]
    return "\n".join(lines)
