"""What `LLM` checks and resolves around loading a model: the device and dtype a user named, the draft
models a config names (and their tokenizers, before any weights load), a model's end-of-sequence ids,
and loading with the cyclic collector paused."""
from __future__ import annotations

import functools
import gc
import json
from pathlib import Path

import torch

from ..drafters.base import check_same_tokenizer
from ..exit.config import EarlyExitConfig
from ..model.llama import Transformer
from ..model.resolve import resolve_model
from ..tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}




def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' is float32 on CPU (fastest there for small matmuls) and bfloat16 on accelerators."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


# tokens that end generation wherever a GGUF's vocabulary has them (from llama.cpp's list in llama-vocab.cpp,
# for the families specee loads): Qwen2.5's files name only <|im_end|> as eos, and raw text ran on past its
# <|endoftext|>. A checkpoint directory's generation_config.json says its own.
GGUF_END_TOKENS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>",
                   "_<EOT>")


def load_eos_ids(model_path: Path, model: Transformer, tokenizer: Tokenizer) -> frozenset[int]:
    """The config's eos ids (a GGUF's eos, eot and eom, and its end tokens as llama.cpp stops on them),
    generation_config.json's, and the tokenizer's eos."""
    ids = set(model.cfg.eos_token_ids)
    if not model_path.is_dir():
        ids.update(i for i in map(tokenizer.token_id, GGUF_END_TOKENS) if i is not None)
    gen = model_path / "generation_config.json"
    if model_path.is_dir() and gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else ([] if eos is None else [eos]))
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def check_device(device: str | torch.device) -> torch.device:
    """The torch device `device` names, refused in one line where specee cannot run (another kind, no CUDA)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(dev)!r}: CUDA is not available (torch {torch.__version__}); use device='cpu'")
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device {str(dev)!r}: there are {torch.cuda.device_count()} CUDA devices")
    return dev


def check_early_exit(config: EarlyExitConfig | None) -> None:
    """What an EarlyExitConfig must name before the model loads: a drafter, and a bank that exists."""
    if config is None:
        return
    if config.draft is None:
        raise ValueError("early_exit needs a drafter: EarlyExitConfig(draft=<a draft model> or 'ngram')")
    if config.bank is not None and not Path(config.bank).expanduser().is_dir():
        raise ValueError(f"early_exit: bank {config.bank!r} is not a directory (a bank from `specee calibrate`)")
    if config.bank is not None:  # its files too, as the CLI's --bank (cli/arg_types.py's bank_dir)
        from ..exit.bank import PredictorBank

        PredictorBank.check_files(Path(config.bank).expanduser())


def named_drafts(early_exit: EarlyExitConfig | None, speculative_config) -> list[str]:
    """The draft models the configs name (checking the speculative_config on the way)."""
    from ..speculative.config import SpeculativeConfig

    drafts = [] if early_exit is None or early_exit.draft in (None, "ngram") else [early_exit.draft]
    if speculative_config is not None:
        spec = SpeculativeConfig.parse(speculative_config)
        drafts += [spec.model] if spec.method == "draft_model" else []
    return list(dict.fromkeys(drafts))


def check_draft_tokenizers(tokenizer: Tokenizer, model_dir: Path, drafts: list[str]) -> None:
    """Refuse a draft model whose tokenizer differs from the target's before any weights load (loading
    a large pair first took minutes)."""
    for draft in drafts:
        draft_dir = resolve_model(draft, what="draft model")
        check_same_tokenizer(tokenizer, Tokenizer(draft_dir), model_dir, draft_dir)


def merged_config(config: EarlyExitConfig, speculative_config: dict) -> EarlyExitConfig:
    """The early-exit config that drafts `num_speculative_tokens` per pass with its own drafter
    (speculative/config.py says which speculative_configs exits can serve)."""
    from dataclasses import replace

    from ..speculative.config import SpeculativeConfig

    spec = SpeculativeConfig.parse(speculative_config)
    spec.check_serves_exits(config.draft)
    return replace(config, num_draft_tokens=spec.num_speculative_tokens)


def collector_paused(load):
    """Run `load` with Python's cyclic collector paused (and restored as it was, also on an error).
    Loading makes ~700k long-lived objects (a GGUF vocabulary's metadata: a memmap per entry), and
    the collections triggered while they pile up walk them all again: SmolLM2 Q4_1 loaded in 5.6 s
    instead of 7.3 s (AMD EPYC, 2 threads)."""
    @functools.wraps(load)
    def paused(*args, **kwargs):
        enabled = gc.isenabled()
        gc.disable()
        try:
            return load(*args, **kwargs)
        finally:
            if enabled:
                gc.enable()
    return paused
