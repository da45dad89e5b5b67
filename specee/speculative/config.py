"""`speculative_config` as vLLM users write it, checked, and the decoder it builds.

    {"method": "eagle" | "draft_model" | "ngram", "model": PATH, "num_speculative_tokens": N,
     "tree": {"topk": K, "size": S}, "prompt_lookup_max": M, "prompt_lookup_min": m, "quantization": Q}

model: the EAGLE head directory (`specee train-draft`) or the draft model (a checkpoint
directory, a .gguf file or a hub id, as the target); tree: grow
EAGLE-2 trees of depth N, K children per expanded node, S nodes verified (eagle, draft_model);
prompt_lookup_max / prompt_lookup_min: the longest suffix n-gram matched, and the shortest a chain is
drafted from (ngram; by default 2: a 1-token match's drafts were accepted at 0.10 a row on SmolLM2,
below what a verified row costs; alone on an Intel Xeon, paired, SmolLM2 ran 1.14x full depth from
2 tokens against 1.01x from 1, BENCHMARKS session 36); quantization: the draft model's
weights (draft_model; "int4", "int8", "auto" or null). By default a quantized target's draft runs
int4 whatever its file holds: a draft only proposes, so its rounding moves acceptance, never the
output, and a GGUF's Q5_0/Q8_0 tensors (Qwen2.5-0.5B's rows of 896 take no K-quants) would
otherwise run int8, whose kernel made drafting cost more than speculation saved.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .tree import TreeShape

METHODS = ("eagle", "draft_model", "ngram")
KEYS = ("method", "model", "num_speculative_tokens", "tree", "prompt_lookup_max", "prompt_lookup_min", "quantization")
DEFAULT_PROMPT_LOOKUP_MIN = 2
DRAFT_QUANTIZATIONS = ("int4", "int8", "auto", None)
DEFAULT = "default"  # the draft's quantization when the config names none: see draft_quantization
MAX_SPECULATIVE_TOKENS = 64  # as the CLI's --k: a verification pass of more rows has never paid


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    model: str | None = None
    num_speculative_tokens: int = 4
    tree: TreeShape | None = None
    prompt_lookup_max: int = 3
    prompt_lookup_min: int | None = None  # None: DEFAULT_PROMPT_LOOKUP_MIN for speculative decoding
    quantization: str | None = DEFAULT

    def draft_quantization(self, target_quantization: str | None) -> str | None:
        """The drafter's weights (a draft model's or an EAGLE head's): the config's, else int4 under a
        quantized target, float under a float one. A drafter only proposes: its rounding moves
        acceptance, never the output."""
        if self.quantization is not DEFAULT:
            return self.quantization
        return None if target_quantization is None else "int4"

    @classmethod
    def parse(cls, raw: "SpeculativeConfig | dict[str, Any]") -> "SpeculativeConfig":
        """Check a user's dict; every error is one line naming the key."""
        if isinstance(raw, SpeculativeConfig):
            return raw
        if not isinstance(raw, dict):
            raise ValueError(f"speculative_config must be a dict (JSON object), got {type(raw).__name__}")
        unknown = sorted(set(raw) - set(KEYS))
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: {', '.join(KEYS)}")
        method = raw.get("method")
        if method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {', '.join(METHODS)}, got {method!r}")
        n = raw.get("num_speculative_tokens", 4)
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer from 1 to "
                             f"{MAX_SPECULATIVE_TOKENS}, got {n!r}")
        if method != "ngram" and "prompt_lookup_max" in raw:
            raise ValueError(f"speculative_config: 'prompt_lookup_max' is for method 'ngram', not {method!r}")
        model = raw.get("model")
        if method == "ngram":
            if model is not None:
                raise ValueError("speculative_config: method 'ngram' takes no model (it looks up the prompt)")
        elif model is None or not isinstance(model, str) or not model.strip():
            what = "an EAGLE head directory" if method == "eagle" else "a draft model directory, .gguf file or hub id"
            got = "" if model is None else f", got {model!r}"
            raise ValueError(f"speculative_config: method {method!r} needs 'model': {what}{got}")
        elif method == "eagle" and not Path(model).expanduser().is_dir():
            raise ValueError(f"speculative_config: model directory not found: {model}")
        elif method == "eagle":
            from ..drafters.eagle_head import check_head_dir

            try:
                check_head_dir(Path(model).expanduser())
            except ValueError as e:
                raise ValueError(f"speculative_config: model {e}") from None
        elif not Path(model).expanduser().exists() and (Path(model).is_absolute() or str(model).startswith((".", "~"))):
            raise ValueError(f"speculative_config: draft model not found: {model}")  # else: maybe a hub id
        lookup = raw.get("prompt_lookup_max", 3)
        if not isinstance(lookup, int) or isinstance(lookup, bool) or lookup < 1:
            raise ValueError(f"speculative_config: prompt_lookup_max must be an integer >= 1, got {lookup!r}")
        lookup_min = raw.get("prompt_lookup_min")
        if lookup_min is not None:
            if method != "ngram":
                raise ValueError(f"speculative_config: 'prompt_lookup_min' is for method 'ngram', not {method!r}")
            if not isinstance(lookup_min, int) or isinstance(lookup_min, bool) or not 1 <= lookup_min <= lookup:
                raise ValueError(f"speculative_config: prompt_lookup_min must be an integer from 1 to prompt_lookup_max "
                                 f"({lookup}), got {lookup_min!r}")
        tree = raw.get("tree")
        if tree is not None:
            if method == "ngram":
                raise ValueError("speculative_config: 'tree' needs a drafter that scores tokens (eagle, draft_model); "
                                 "ngram drafts a chain")
            if not isinstance(tree, dict) or set(tree) - {"topk", "size"}:
                raise ValueError(f"speculative_config: tree must be {{\"topk\": K, \"size\": S}}, got {tree!r}")
            topk, size = tree.get("topk", 4), tree.get("size", 16)
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in (topk, size)):
                raise ValueError(f"speculative_config: tree topk and size must be integers, got {tree!r}")
            try:
                tree = TreeShape(depth=n, topk=topk, size=size)
            except ValueError as e:
                raise ValueError(f"speculative_config: {e}") from None
        quantization = raw.get("quantization", DEFAULT)
        if quantization is not DEFAULT:
            if method != "draft_model":
                raise ValueError(f"speculative_config: 'quantization' sets the draft model's weights; method "
                                 f"{method!r} has none")
            if quantization not in DRAFT_QUANTIZATIONS:
                raise ValueError(f"speculative_config: quantization must be one of int4, int8, auto or null, "
                                 f"got {quantization!r}")
        return cls(method, model if model is None or not Path(model).expanduser().exists()
                   else str(Path(model).expanduser()), n, tree, lookup, lookup_min, quantization)

    def check_serves_exits(self, exit_draft: str | None) -> None:
        """Refuse, in one line, a config whose chains SpecEE's exits cannot verify: the passes are
        drafted by the early-exit drafter `exit_draft` ("ngram" or a draft model path)."""
        why = None
        if self.method == "eagle":
            why = ("the EAGLE head reads target layers an exited pass never computes; use method 'ngram' or "
                   "'draft_model' with exits")
        elif self.tree is not None:
            why = "exits verify chains; drop 'tree'"
        elif self.method == "ngram" and (exit_draft != "ngram" or self.prompt_lookup_max != 3
                                         or self.prompt_lookup_min not in (None, 1)):
            why = ("method 'ngram' needs the early-exit drafter 'ngram' (and prompt_lookup_max 3, prompt_lookup_min 1: "
                   "the bank's n-gram)")
        elif self.method == "draft_model" and (exit_draft is None or Path(exit_draft).expanduser().resolve()
                                               != Path(str(self.model)).expanduser().resolve()):
            why = f"method 'draft_model' drafts with the early-exit drafter; its model must be {exit_draft!r}"
        if why:
            raise ValueError(f"speculative_config with early exit: {why}")

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        if self.model is not None:
            d["model"] = self.model
        if self.tree is not None:
            d["tree"] = {"topk": self.tree.topk, "size": self.tree.size}
        if self.method == "ngram":
            d["prompt_lookup_max"] = self.prompt_lookup_max
            if self.prompt_lookup_min is not None:
                d["prompt_lookup_min"] = self.prompt_lookup_min
        if self.quantization != DEFAULT:
            d["quantization"] = self.quantization
        return d


def make_decoder(llm, config: SpeculativeConfig | dict[str, Any]):
    """The SpeculativeDecoding (an engine decoding) for `llm` (an engine.llm.LLM) and this config."""
    from ..drafters.draft_model import DraftModelDrafter
    from ..drafters.ngram import NGramDrafter
    from .speculative import SpeculativeDecoding

    config = SpeculativeConfig.parse(config)
    model = llm.model
    drafts_quantized = config.draft_quantization(llm.weights_quantization)
    if config.method == "ngram":
        drafter = NGramDrafter(1, model.cfg.vocab_size, model.device, max_ngram=config.prompt_lookup_max,
                               min_ngram=min(config.prompt_lookup_min or DEFAULT_PROMPT_LOOKUP_MIN, config.prompt_lookup_max))
    elif config.method == "draft_model":
        drafter = DraftModelDrafter(config.model, llm.tokenizer, 1, model.device, model.dtype,
                                    target_dir=llm.model_dir, vocab_size=model.cfg.vocab_size,
                                    quantization=drafts_quantized)
    else:
        from ..drafters.eagle import EagleDrafter
        from ..drafters.eagle_head import EagleHead

        head = EagleHead.load(config.model, model, llm.fingerprint, drafts_quantized)
        drafter = EagleDrafter(head)
    return SpeculativeDecoding(model, drafter, config.num_speculative_tokens, config.tree, config.method)
