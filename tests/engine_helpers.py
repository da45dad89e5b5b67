"""What the engine tests share: the fixture checkpoints, every mode of the engine core on one LLM each,
requests as Sequences, decoding one alone, and stepping an engine through arrivals and aborts."""
from __future__ import annotations

import torch
from checkpoints import Variant
from ee_helpers import EXIT_MODES, exit_decoding

from specee import LLM
from specee.engine.sequence import Sequence

SMALL = Variant("engine3", "llama", dict(num_hidden_layers=3, num_key_value_heads=2), vocab_padding=8)  # int4: 320 rows
DRAFT = Variant("engine-draft", "llama", dict(num_hidden_layers=1, num_key_value_heads=2), vocab_padding=8)


# every mode of the engine core, on the float path and the default quantized (int4, C++) path
MODES = {
    "full": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 3},
    "draft_tree": {"method": "draft_model", "num_speculative_tokens": 2, "tree": {"topk": 2, "size": 4}},
    "eagle": "a random EAGLE head (features of layers 0 and 2), chains",
    "eagle_tree": "a random EAGLE head (features of layers 0 and 2), trees",
}
LOSSLESS = {"full", *MODES, "exit_lossless", "exit_lossless_verification"}


def eagle_decoding(llm, quantization, tree: bool):
    """Speculation with a random EAGLE head on `llm`'s target (int4 on a quantized target, as the config
    would make it): it reads the target's features, so it must follow every request's own rows. Every
    step drafts (no gate): chains then draft every request of a step together (`draft_all`)."""
    from specee.drafters.eagle import EagleDrafter
    from specee.drafters.eagle_head import EagleHead, EagleHeadConfig
    from specee.speculative import SpeculativeDecoding, TreeShape

    model = llm.model
    cfg = EagleHeadConfig.for_target(model.cfg, (0, 2), model.cfg.vocab_size // 2)
    shortlist = torch.randperm(model.cfg.vocab_size, generator=torch.Generator().manual_seed(0))
    head = EagleHead.init_random(model, cfg, shortlist[: cfg.shortlist_size].sort().values, seed=0)
    if quantization is not None:
        head = EagleHead(model, cfg, head.shortlist, head.params, quantization=quantization)
    return SpeculativeDecoding(model, EagleDrafter(head), 3, TreeShape(3, 2, 5) if tree else None, "eagle", gated=False)


def mode_llms_for(target, draft, quantization: str | None) -> dict[str, LLM]:
    """mode -> LLM for that mode (MODES and EXIT_MODES), all on one precision."""
    base = LLM(target, dtype="float32", quantization=quantization)
    if quantization == "int4":
        assert base.model.fast_layers is not None, "the int4 model runs the C++ layer"
    out = {}
    for name, config in {**MODES, **EXIT_MODES}.items():
        llm = LLM(target, dtype="float32", quantization=quantization)
        if name in EXIT_MODES:
            llm.early_exit = exit_decoding(llm, config)
        elif isinstance(config, str):
            llm.speculative = eagle_decoding(llm, quantization, tree=name == "eagle_tree")
        else:
            if config is not None and config["method"] == "draft_model":
                config = {**config, "model": str(draft)}
            llm.enable_speculative(config)
        out[name] = llm
    return out


def sequence(llm, prompt: str, params: SamplingParams) -> Sequence:
    return Sequence(prompt, llm.encode(prompt), params, llm.tokenizer, llm.eos_ids)


def solo(llm, seq: Sequence) -> tuple[list[int], str, str | None]:
    """What `seq`'s request gives decoded alone: tokens, text, finish reason."""
    alone = Sequence(seq.prompt, seq.prompt_ids, seq.params, llm.tokenizer, seq.eos_ids)
    llm.engine.add_request(alone)
    while llm.engine.has_unfinished():
        llm.engine.step()
    return alone.output_ids, alone.text, alone.finish_reason


def drive(llm, arrivals: dict[int, list[Sequence]], aborts: dict[int, list[Sequence]] | None = None
          ) -> list[list[Sequence]]:
    """Step the engine, adding arrivals[i] (and aborting aborts[i]) just before step i, until it is
    idle; returns what finished at each step. A newcomer joins the running batch in the step after
    its arrival: its first token comes out of that step."""
    engine, finished, i, aborts = llm.engine, [], 0, aborts or {}
    while i <= max(arrivals) or engine.has_unfinished():
        for s in aborts.get(i, []):
            engine.abort(s)
        new = arrivals.get(i, [])
        for s in new:
            engine.add_request(s)
        finished.append(engine.step())
        assert all(len(s.output_ids) >= 1 for s in new)
        i += 1
    return finished


# PROMPTS[1] is over 32 tokens: on a CPU with AMX its prefill runs on tiles (model/kernels/amx_prompt.cpp),
# so every mode meets a prompt on that path beside rows on the int8 kernels
PROMPTS = ["one", "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat by the door, "
           "and the old bird sings", "Tom and his friend went", "two", "def add(a, b): return a + b; add(add("]
