"""The user-facing API, shaped like vLLM's: `LLM(model).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from ..model.llama import Transformer
from ..sampling import SamplingParams
from ..tokenizer import Tokenizer
from .full_depth import generate_full_depth
from .sequence import RequestOutput, Sequence

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


def load_eos_ids(model_dir: Path, model: Transformer, tokenizer: Tokenizer) -> frozenset[int]:
    ids = set(model.cfg.eos_token_ids)
    gen = model_dir / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else ([] if eos is None else [eos]))
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


class LLM:
    def __init__(self, model: str | Path, device: str = "cpu", dtype: str | torch.dtype = "auto"):
        self.model_dir = Path(model)
        dev = torch.device(device)
        self.model = Transformer.load(self.model_dir, dev, resolve_dtype(dtype, dev))
        self.tokenizer = Tokenizer(self.model_dir)
        if self.tokenizer.vocab_size > self.model.cfg.vocab_size:
            raise ValueError(f"{self.model_dir}: tokenizer has {self.tokenizer.vocab_size} tokens but the model "
                             f"only {self.model.cfg.vocab_size} embedding rows")
        self.eos_ids = load_eos_ids(self.model_dir, self.model, self.tokenizer)

    # ---- requests -----------------------------------------------------------------------
    def encode(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        if isinstance(prompt, list):
            bad = [t for t in prompt if not 0 <= t < self.model.cfg.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids out of range [0, {self.model.cfg.vocab_size}): {bad[:5]}")
            return list(prompt)
        if chat:
            return self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def _sequences(self, prompts, params: SamplingParams | list[SamplingParams] | None, chat: bool) -> list[Sequence]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise ValueError("no prompts given")
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} SamplingParams for {len(prompts)} prompts")
        return [Sequence(p, self.encode(p, chat), sp, self.tokenizer, self.eos_ids) for p, sp in zip(prompts, plist)]

    def generate(self, prompts: str | list[int] | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 chat: bool = False) -> list[RequestOutput]:
        """Generate for one prompt or a batch; prompts sharing SamplingParams are decoded together."""
        seqs = self._sequences(prompts, sampling_params, chat)
        groups: dict[SamplingParams, list[Sequence]] = {}
        for s in seqs:
            groups.setdefault(s.params, []).append(s)
        for group in groups.values():
            self._run(group, None)
        return [s.output() for s in seqs]

    def stream(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
               chat: bool = False) -> Iterator[str]:
        """Yield text as it is produced; the finished RequestOutput is `self.last_output`."""
        import queue
        import threading

        (seq,) = self._sequences(prompt, sampling_params, chat)
        deltas: queue.Queue[str | None | BaseException] = queue.Queue()

        def work() -> None:
            try:
                self._run([seq], lambda _i, text: text and deltas.put(text))
                deltas.put(None)
            except BaseException as e:  # re-raised in the caller's thread
                deltas.put(e)

        threading.Thread(target=work, daemon=True).start()
        while (item := deltas.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item
        self.last_output = seq.output()

    def _run(self, seqs: list[Sequence], on_text) -> None:
        generate_full_depth(self.model, seqs, on_text)
