"""The user-facing API, shaped like vLLM's: `LLM(model).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from ..drafters.base import Drafter
from ..drafters.draft_model import DraftModelDrafter
from ..drafters.ngram import NGramDrafter
from ..exit.bank import PredictorBank
from ..model.llama import Transformer
from ..model.quant import FloatLinear
from ..model.resolve import resolve_model
from ..model.weights import fingerprint_weights
from ..sampling import SamplingParams
from ..tokenizer import Tokenizer
from ..exit.config import EarlyExitConfig
from .early_exit import EarlyExitDecoder
from .engine import Engine
from .full_depth import decode_full_depth
from .sequence import RequestOutput, Sequence
from .teacher import TeacherForcedStep
from .threads import ThreadPolicy, check_threads

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


QUANTIZATIONS = (None, "int4", "int8", "auto")
BANK_RECIPE = "r3"  # r2: the draft model's LM head restricted to a frequency shortlist; r3: exit features in float32


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' is float32 on CPU (fastest there for small matmuls) and bfloat16 on accelerators."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_eos_ids(model_path: Path, model: Transformer, tokenizer: Tokenizer) -> frozenset[int]:
    """The config's eos ids (a GGUF's eos and eot), generation_config.json's, and the tokenizer's eos."""
    ids = set(model.cfg.eos_token_ids)
    gen = model_path / "generation_config.json"
    if model_path.is_dir() and gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else ([] if eos is None else [eos]))
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def default_cache_dir() -> Path:
    root = os.environ.get("SPECEE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "specee")
    return Path(root)


def merged_config(config: EarlyExitConfig, speculative_config: dict) -> EarlyExitConfig:
    """The early-exit config that drafts `num_speculative_tokens` per pass with its own drafter
    (spec/config.py says which speculative_configs exits can serve)."""
    from dataclasses import replace

    from ..spec.config import SpeculativeConfig

    spec = SpeculativeConfig.parse(speculative_config)
    spec.check_serves_exits(config.draft)
    return replace(config, num_draft_tokens=spec.num_speculative_tokens)


class LLM:
    """A loaded target model; with `early_exit`, decoding uses SpecEE early exiting.

    model: a checkpoint directory, a .gguf file (or a directory holding one), or a Hugging Face hub
    id (`revision` picks a branch, tag or commit). quantization: None (float), "int4", "int8" or
    "auto" (a GGUF's own precision: Q4 -> int4, Q5/Q6/Q8 -> int8, float -> float). early_exit: an EarlyExitConfig. Its bank is
    loaded (and checked against this target and drafter); without one, a bank is calibrated once
    and cached under ~/.cache/specee/banks, keyed by the target's and drafter's fingerprints and the dtype.
    speculative_config: draft-and-verify speculative decoding, as in vLLM:
    {"method": "eagle" | "draft_model" | "ngram", "model": DIR, "num_speculative_tokens": N}.
    Both together: SpecEE's exits inside the verification passes (the early-exit drafter drafts
    the chains: method "ngram" with draft "ngram", or "draft_model" with the same model).
    threads: CPU threads (torch's setting, process-wide); None: the fastest of a few counts, timed on
    one decode step at load and rechecked between requests (engine/threads.py: it keeps the speed
    when another process is busy).
    """

    def __init__(self, model: str | Path, device: str = "cpu", dtype: str | torch.dtype = "auto",
                 early_exit: EarlyExitConfig | None = None, progress: bool = True, revision: str | None = None,
                 quantization: str | None = None, speculative_config: dict | None = None,
                 threads: int | None = None):
        threads = check_threads(threads)
        self.model_dir = resolve_model(model, revision)  # a checkpoint directory or a .gguf file
        dev = torch.device(device)
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"unknown quantization {quantization!r}; choose {', '.join(map(str, QUANTIZATIONS))}")
        self.quantization = quantization  # weight-only int4/int8 linears (model/quant.py); auto: a GGUF's own
        self.model = Transformer.load(self.model_dir, dev, resolve_dtype(dtype, dev), quantization)
        self.tokenizer = Tokenizer(self.model_dir)
        if self.tokenizer.vocab_size > self.model.cfg.vocab_size:
            raise ValueError(f"{self.model_dir}: tokenizer has {self.tokenizer.vocab_size} tokens but the model "
                             f"only {self.model.cfg.vocab_size} embedding rows")
        self.eos_ids = load_eos_ids(self.model_dir, self.model, self.tokenizer)
        self.threads = ThreadPolicy(self.model, threads)  # .choice: the count (and timings if measured)
        self.fingerprint = fingerprint_weights(self.model_dir)
        self.progress = progress
        self.engine = Engine(self._decode, batched=self._batches)
        self.early_exit: EarlyExitDecoder | None = None
        self.speculative = None
        if early_exit is not None:
            self.enable_early_exit(early_exit, speculative_config)
        elif speculative_config is not None:
            self.enable_speculative(speculative_config)

    # ---- speculative decoding (specee.spec) -----------------------------------------------
    def enable_speculative(self, config: dict | None) -> None:
        """Draft-and-verify decoding with a vLLM-style speculative_config (see spec/config.py); None = off.
        With early exit on, its exits move into the verification passes."""
        if config is not None and self.early_exit is not None:
            self.enable_early_exit(self.early_exit.config, config)
            return
        from ..spec.config import make_decoder

        self.speculative = None if config is None else make_decoder(self, config)

    # ---- early exit ---------------------------------------------------------------------
    def make_drafter(self, draft: str | None, k: int) -> Drafter:
        if draft is None:
            raise ValueError("early exit needs a drafter: a draft model directory, or 'ngram'")
        if draft == "ngram":
            return NGramDrafter(k, self.model.cfg.vocab_size, self.model.device)
        return DraftModelDrafter(draft, self.tokenizer, k, self.model.device, self.model.dtype,
                                 target_dir=self.model_dir, quantization=self.quantization)  # cache grows per request

    def enable_early_exit(self, config: EarlyExitConfig, speculative_config: dict | None = None) -> None:
        """SpecEE early exit; with a speculative_config, inside draft-and-verify passes."""
        if speculative_config is not None:
            config = merged_config(config, speculative_config)
        drafter = self.make_drafter(config.draft, config.k)
        if config.bank is not None:
            bank = PredictorBank.load(config.bank, expect_target=self.fingerprint,
                                      expect_drafter=drafter.fingerprint, num_layers=self.model.cfg.num_layers)
        else:
            bank = self.cached_bank(drafter, config.k)
        drafter.restrict_vocab(bank.draft_vocab)  # the shortlist the predictors were calibrated with
        self.early_exit = EarlyExitDecoder(self.model, drafter, bank, config)

    def bank_cache_path(self, drafter: Drafter, k: int) -> Path:
        """Where the bank for this target + drafter + k + dtype is cached; the suffix names the
        calibration recipe, so banks cached by an older recipe are not reused."""
        dtype = str(self.model.dtype).removeprefix("torch.")
        quantized = not all(isinstance(w.qkv, FloatLinear) for w in self.model.layers)  # "auto" on float weights is float
        quant = f"-{self.quantization}" if quantized else ""  # quantized weights move the features
        return default_cache_dir() / "banks" / f"{self.fingerprint}-{drafter.fingerprint}-k{k}-{dtype}{quant}-{BANK_RECIPE}"

    def cached_bank(self, drafter: Drafter, k: int) -> PredictorBank:
        """The bank for this target + drafter from the user's cache, calibrating it on first use."""
        path = self.bank_cache_path(drafter, k)
        if (path / "manifest.json").exists():
            return PredictorBank.load(path, expect_target=self.fingerprint, expect_drafter=drafter.fingerprint,
                                      num_layers=self.model.cfg.num_layers)
        # imported here, not at module level: only this first-use path calibrates (the engine never needs it otherwise)
        from ..calibration import calibrate, load_calibration_prompts

        if self.progress:
            print(f"specee: no predictor bank for this model + drafter yet; calibrating once "
                  f"(cached at {path})", file=sys.stderr)
        bank = calibrate(self.model, self.tokenizer, drafter, load_calibration_prompts(), k=k,
                         target_dir=self.model_dir, target_fingerprint=self.fingerprint, eos_ids=self.eos_ids,
                         progress=self.progress)
        bank.save(path)
        return bank

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
        seqs = [Sequence(p, self.encode(p, chat), sp, self.tokenizer, self.eos_ids) for p, sp in zip(prompts, plist)]
        threads = self.threads.refresh()
        for s in seqs:
            s.stats.threads, s.stats.thread_probe_ms = threads.threads, dict(threads.step_ms) or None
        return seqs

    def generate(self, prompts: str | list[int] | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 chat: bool = False) -> list[RequestOutput]:
        """Generate for one prompt or a batch (one SamplingParams, or one per prompt). At full depth
        and with lossy early exit the prompts are decoded as one batch, each request with its own
        parameters and generator; speculation and lossless early exit take them in turn."""
        seqs = self._sequences(prompts, sampling_params, chat)
        for s in seqs:
            self.engine.add_request(s)
        while self.engine.has_unfinished():
            self.engine.step()
        return [s.output() for s in seqs]

    def stream(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
               chat: bool = False) -> Iterator[str]:
        """Yield text as it is produced, in the caller's thread (the decoders are step generators);
        the finished RequestOutput is `self.last_output`. Closing the iterator stops decoding."""
        (seq,) = self._sequences(prompt, sampling_params, chat)
        self.engine.add_request(seq)
        try:
            while not seq.finished and self.engine.has_unfinished():  # other requests may run on
                self.engine.step()
                if delta := seq.take_stream_delta():
                    yield delta
        finally:
            self.engine.abort(seq)  # a closed stream stops decoding
        self.last_output = seq.output()

    def teacher_forced(self, prompt_ids: list[int], continuation: list[int]) -> list[TeacherForcedStep]:
        """What early exit would emit at each position of a fixed continuation (see EarlyExitDecoder)."""
        if self.early_exit is None:
            raise ValueError("teacher_forced needs early exit enabled (LLM(..., early_exit=EarlyExitConfig(...)))")
        params = SamplingParams(max_tokens=len(continuation), ignore_eos=True)
        seq = Sequence(prompt_ids, list(prompt_ids), params, self.tokenizer, self.eos_ids)
        return self.early_exit.teacher_forced(seq, continuation)

    def _batches(self) -> bool:
        """Whether requests share passes: at full depth, and with lossy one-token early exit."""
        return self.speculative is None and (self.early_exit is None or self.early_exit.batches)

    def _decode(self, seqs: list[Sequence]) -> Iterator[None]:
        """The decoder this LLM is configured with, stepped over `seqs`: at full depth a batch that
        later requests join (engine/full_depth.py); with lossy one-token early exit one batch of
        them; else (speculation, lossless mode) a generator over one request at a time."""
        if self.early_exit is None and self.speculative is None:
            return decode_full_depth(self.model, seqs)
        if self.speculative is None and self.early_exit.batches:
            return self.early_exit.steps(seqs)

        def one_at_a_time() -> Iterator[None]:
            for seq in seqs:  # `yield from`: closing this closes the request's steps
                yield from (self.speculative.steps(seq) if self.speculative else self.early_exit.steps([seq]))
        return one_at_a_time()
