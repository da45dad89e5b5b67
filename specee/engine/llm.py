"""The user-facing API, shaped like vLLM's: `LLM(model).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import os
import sys
import threading
import weakref
from collections.abc import Iterator
from numbers import Integral
from pathlib import Path

import torch

from ..cache_dir import default_cache_dir
from ..drafters.base import Drafter
from ..drafters.draft_model import DraftModelDrafter
from ..drafters.ngram import NGramDrafter
from ..exit.bank import PredictorBank
from ..files import writable_destination
from ..model.kv_cache import check_kv_cache_dtype
from ..model.llama import Transformer
from ..model.resolve import resolve_model
from ..model.weights import fingerprint_weights
from ..sampling import SamplingParams
from ..tokenizer import Tokenizer, utf8_text
from ..exit.config import EarlyExitConfig
from .early_exit import EarlyExitDecoding
from .engine import Engine
from .kv_manager import check_kv_budget
from .loading import (check_device, check_draft_tokenizers, check_early_exit, collector_paused, load_eos_ids,
                      merged_config, named_drafts, resolve_dtype)
from .scheduling import (DEFAULT_MAX_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, DEFAULT_PREFILL_CHUNK, DEFAULT_SWAP_SPACE,
                         check_scheduling, swap_space_bytes)
from .sequence import RequestOutput, Sequence, token_ids
from .teacher import TeacherForcedStep
from .threads import ThreadPolicy, check_threads, oversubscribed, prefetch_setting
from .worker import IN_FLIGHT, EngineThread

_WORKER_LOCK = threading.Lock()
QUANTIZATIONS = (None, "int4", "int8", "auto")
BANK_RECIPE = "r3"  # r2: the draft model's LM head restricted to a frequency shortlist; r3: exit features in float32


class LLM:
    """A loaded target model; with `early_exit`, decoding uses SpecEE early exiting.

    model: a checkpoint directory, a .gguf file (or a directory holding one), or a Hugging Face hub
    id (`revision` picks a branch, tag or commit). quantization: "auto" (the default, as on the
    command line: the fastest measured; on CPU a GGUF's own precision, Q4_K/Q6_K/Q5_0/Q8_0 as
    stored, Q4_0/Q4_1 -> int4, other Q5/Q8 -> int8, float -> float; on CUDA, where nothing is
    measured yet, float),
    "int4", "int8" or None (float weights). early_exit: an EarlyExitConfig. Its bank is
    loaded (and checked against this target and drafter); without one, a bank is calibrated once
    and cached under ~/.cache/specee/banks, keyed by the target's and drafter's fingerprints and the dtype.
    speculative_config: draft-and-verify speculative decoding, as in vLLM:
    {"method": "eagle" | "draft_model" | "ngram", "model": DIR, "num_speculative_tokens": N}.
    Both together: SpecEE's exits inside the verification passes (the early-exit drafter drafts
    the chains: method "ngram" with draft "ngram", or "draft_model" with the same model).
    threads: CPU threads (torch's setting, process-wide); None: the fastest of a few counts, timed on
    one decode step at load and rechecked between requests (engine/threads.py: it keeps the speed
    when another process is busy). kv_cache_dtype: "auto" (float16 where specee's AVX-512 attention
    reads the cache, else the compute dtype), "float16" or "float32". max_num_seqs,
    max_num_batched_tokens, prefill_chunk: the engine's scheduling (engine/scheduling.py; prefill_chunk:
    a longer prompt prefills this many tokens a step, so running requests keep decoding; 0: whole).
    swap_space: GiB of host memory for requests parked out of a full KV cache (vLLM's; one whose
    parking would pass it ends with an error). enable_prefix_caching: a prompt that starts as an earlier
    one did starts its prefill after that one's cached rows (vLLM's automatic prefix caching; the same
    tokens, as a chunked prefill gives).
    """

    @collector_paused
    def __init__(self, model: str | Path, device: str = "cpu", dtype: str | torch.dtype = "auto",
                 early_exit: EarlyExitConfig | None = None, progress: bool = True, revision: str | None = None,
                 quantization: str | None = "auto", speculative_config: dict | None = None,
                 kv_cache_memory: int | str | None = None, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                 threads: int | None = None, kv_cache_dtype: str = "auto",
                 max_num_batched_tokens: int = DEFAULT_MAX_BATCHED_TOKENS, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 swap_space: float = DEFAULT_SWAP_SPACE, enable_prefix_caching: bool = True):
        if not isinstance(model, (str, os.PathLike)):
            raise TypeError(f"model must be a path or a Hugging Face hub id (str or Path), got {model!r}")
        if isinstance(early_exit, dict):  # as speculative_config is given
            early_exit = EarlyExitConfig(**early_exit)
        elif not isinstance(early_exit, (EarlyExitConfig, type(None))):
            raise TypeError(f"early_exit must be an EarlyExitConfig, a dict of its fields or None, got {early_exit!r}")
        threads = check_threads(threads)
        check_scheduling(max_num_seqs, max_num_batched_tokens, prefill_chunk)
        prefetch_setting()  # a bad SPECEE_INT4_PREFETCH fails here, before any loading
        dev = check_device(device)
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"unknown quantization {quantization!r}; choose {', '.join(map(str, QUANTIZATIONS))}")
        if quantization == "auto" and dev.type != "cpu":
            quantization = None  # nothing measured off the CPU yet: float weights
        check_early_exit(early_exit)
        check_kv_budget(kv_cache_memory)
        swap_space_bytes(swap_space)
        if not isinstance(enable_prefix_caching, bool):
            raise TypeError(f"enable_prefix_caching must be True or False, got {enable_prefix_caching!r}")
        check_kv_cache_dtype(kv_cache_dtype)
        self.model_dir = resolve_model(model, revision)  # a checkpoint directory or a .gguf file
        if drafts := named_drafts(early_exit, speculative_config):
            check_draft_tokenizers(Tokenizer(self.model_dir), self.model_dir, drafts)
        self.quantization = quantization  # weight-only int4/int8 linears (model/quant.py); auto: a GGUF's own
        self.model = Transformer.load(self.model_dir, dev, resolve_dtype(dtype, dev), quantization, kv_cache_dtype)
        self.tokenizer = Tokenizer(self.model_dir)
        if self.tokenizer.vocab_size > self.model.cfg.vocab_size:
            raise ValueError(f"{self.model_dir}: tokenizer has {self.tokenizer.vocab_size} tokens but the model "
                             f"only {self.model.cfg.vocab_size} embedding rows")
        self.eos_ids = load_eos_ids(self.model_dir, self.model, self.tokenizer)
        self.threads = ThreadPolicy(self.model, threads)  # .choice: the count (and timings if measured)
        if progress and (note := oversubscribed(threads)):
            print(f"specee: note: {note}", file=sys.stderr)
        self.fingerprint = fingerprint_weights(self.model_dir)
        self.progress = progress
        self._streams = threading.local()  # .output: this thread's last stream's RequestOutput (last_output)
        self._calibrating = threading.Lock()  # two threads' first requests calibrate once
        self.kv_cache_memory, self.swap_space = kv_cache_memory, swap_space
        self.enable_prefix_caching = enable_prefix_caching
        self.scheduling = {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
                           "prefill_chunk": prefill_chunk}
        self._early_exit: EarlyExitDecoding | None = None
        self._speculative = None  # a SpeculativeDecoding (speculative/speculative.py), the engine's decoding
        self._uncalibrated: tuple[EarlyExitConfig, Drafter] | None = None  # early exit waiting for its bank
        if early_exit is not None:
            self.enable_early_exit(early_exit, speculative_config)
        else:
            self.enable_speculative(speculative_config)

    @property
    def early_exit(self) -> EarlyExitDecoding | None:
        return self._early_exit

    @early_exit.setter
    def early_exit(self, decoder: EarlyExitDecoding | None) -> None:
        """Switch early exit (benchmarks and tests switch modes on one loaded model): a new engine."""
        self._reconfigure(_early_exit=decoder)

    @property
    def speculative(self):
        return self._speculative

    @speculative.setter
    def speculative(self, decoding) -> None:
        self._reconfigure(_speculative=decoding)

    def set_scheduling(self, **settings: int) -> None:
        """Change the engine's scheduling (max_num_seqs, max_num_batched_tokens, prefill_chunk) between
        requests: a new engine."""
        self._require_idle()
        if unknown := set(settings) - set(self.scheduling):
            raise TypeError(f"unknown scheduling setting(s) {sorted(unknown)}; choose {sorted(self.scheduling)}")
        merged = {**self.scheduling, **settings}
        check_scheduling(**merged)
        self._reconfigure(scheduling=merged)

    def fit_kv_cache(self, tokens: int) -> None:
        """Size the KV pool for one request of `tokens` (prompt + max_tokens; the decoding's extra rows
        are added) in place of the default 1 GiB, for a command that serves one request: its pool is laid
        out [layers, 1, kv heads, slots, D], so a first request in a large pool faults in one 2 MB page
        per layer, kv head and K/V (180 on SmolLM2, 360 MB: 0.5 s in a fresh process on the Intel Xeon
        VM), in a pool this size the few pages its rows take."""
        self._require_idle()
        self._reconfigure(kv_cache_memory=tokens + self.engine.decoding.extra_rows)

    def warm_up(self) -> None:
        """Write the whole KV pool and decode one token, for a process that serves later (`serve`), before it
        says it is ready, as vLLM and llama.cpp reserve their caches: pages fault in as runs first reach them
        (SmolLM2's first request 0.52 s, the next 0.01 s; with prefix caching ~50 ms an admission for the first
        hundred). Refused while requests are in flight (it writes the blocks their runs come from)."""
        self.worker.while_idle(self.engine.kv.touch)  # no request takes a run while it writes
        self.generate([[0]], SamplingParams(max_tokens=1, ignore_eos=True))

    def _require_idle(self) -> None:
        """Refuse to change the engine while requests are in flight (the engine thread would drop them
        with the old engine), before anything changes."""
        if getattr(self, "_worker", None) is not None and self._worker.busy:
            raise RuntimeError(IN_FLIGHT)

    def _reconfigure(self, **settings) -> None:
        """Set these attributes and decode with a new engine for them (on the last engine's KV pool where it
        fits: its pages are in already). All or nothing, under the lock that starts the engine thread:
        refused (IN_FLIGHT) while requests are in flight, and then nothing changed."""
        with _WORKER_LOCK:
            self._require_idle()
            new = {name: settings.get(name, getattr(self, name))
                   for name in ("_early_exit", "_speculative", "kv_cache_memory", "scheduling")}
            last = getattr(self, "engine", None)
            engine = Engine(self.model, new["_early_exit"] or new["_speculative"], new["kv_cache_memory"],
                            kv=last.kv if last is not None else None, swap_space=self.swap_space,
                            enable_prefix_caching=self.enable_prefix_caching, **new["scheduling"])
            if getattr(self, "_worker", None) is not None:
                self._worker.swap_engine(engine)  # refused, under the worker's lock, if a request came meanwhile
            self.__dict__.update(settings)
            self.engine = engine

    # ---- speculative decoding (specee.speculative) -----------------------------------------------
    def enable_speculative(self, config: dict | None) -> None:
        """Draft-and-verify decoding with a vLLM-style speculative_config (see speculative/config.py); None = off.
        With early exit on, its exits move into the verification passes."""
        self._require_idle()
        if config is not None and self.early_exit is not None:
            self.enable_early_exit(self.early_exit.config, config)
            return
        from ..speculative.config import make_decoder

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
        self._require_idle()
        if speculative_config is not None:
            config = merged_config(config, speculative_config)
        drafter = self.make_drafter(config.draft, config.k)
        path = config.bank or self.bank_cache_path(drafter.fingerprint, config.k)
        self._speculative, self._uncalibrated = None, None
        if config.bank is None and not (path / "manifest.json").exists():
            self._uncalibrated = (config, drafter)  # `calibrate()`, or the first request, makes the bank
            self.early_exit = None  # full depth meanwhile
            return
        bank = PredictorBank.load(path, expect_target=self.fingerprint, expect_drafter=drafter.fingerprint,
                                  num_layers=self.model.cfg.num_layers)
        self._use_bank(config, drafter, bank)

    def _use_bank(self, config: EarlyExitConfig, drafter: Drafter, bank: PredictorBank) -> None:
        drafter.restrict_vocab(bank.draft_vocab)  # the shortlist the predictors were calibrated with
        self.early_exit = EarlyExitDecoding(self.model, drafter, bank, config)

    def drafter_fingerprint(self, draft: str) -> str:
        """What `make_drafter(draft, k).fingerprint` is, without loading a draft model."""
        if draft == "ngram":
            return NGramDrafter(1, self.model.cfg.vocab_size, self.model.device).fingerprint
        return fingerprint_weights(resolve_model(draft, what="draft model"))

    @property
    def weights_quantization(self) -> str | None:
        """The quantization asked for where the weights hold it; None where they are float ("auto" keeps a
        float checkpoint float)."""
        return self.quantization if self.model.quantized else None

    def bank_cache_path(self, drafter_fingerprint: str, k: int) -> Path:
        """Where the bank for this target + drafter (its fingerprint) + k + dtype is cached; the suffix
        names the calibration recipe, so banks cached by an older recipe are not reused."""
        dtype = str(self.model.dtype).removeprefix("torch.")
        quant = f"-{self.weights_quantization}" if self.weights_quantization else ""  # they move the features
        return default_cache_dir() / "banks" / f"{self.fingerprint}-{drafter_fingerprint}-k{k}-{dtype}{quant}-{BANK_RECIPE}"

    def calibrate(self) -> Path | None:
        """Calibrate the predictor bank that early exit waits for, once (cached for later runs, keyed
        by `bank_cache_path`); returns its path, or None when nothing waits. The CLI calls it with its
        progress bars before the first request; `generate` and `stream` call it on first use."""
        with self._calibrating:
            return self._calibrate() if self._uncalibrated is not None else None

    def _calibrate(self) -> Path:
        config, drafter = self._uncalibrated
        path = self.bank_cache_path(drafter.fingerprint, config.k)
        # imported here, not at module level: only this path calibrates (the engine never needs it otherwise)
        from ..calibration import calibrate, load_calibration_prompts

        try:  # before minutes of calibration, not after
            writable_destination(path, directory=True)
        except ValueError as e:
            raise ValueError(f"the predictor bank's cache ($SPECEE_CACHE): {e}; set $SPECEE_CACHE to a writable "
                             f"directory, or pass a calibrated bank (--bank)") from None
        if self.progress:
            print(f"specee: no predictor bank for this model + drafter yet; calibrating once "
                  f"(cached at {path})", file=sys.stderr)
        bank = calibrate(self.model, self.tokenizer, drafter, load_calibration_prompts(), k=config.k,
                         target_dir=self.model_dir, target_fingerprint=self.fingerprint, eos_ids=self.eos_ids,
                         progress=self.progress)
        bank.save(path)
        self._use_bank(config, drafter, bank)
        self._uncalibrated = None  # after: a refused engine change leaves early exit waiting for its bank
        return path

    # ---- requests -----------------------------------------------------------------------
    def encode(self, prompt: str | bytes | list[int], chat: bool = False) -> list[int]:
        """Token ids of a prompt: text (a str, or UTF-8 bytes; invalid UTF-8 is refused) or token ids."""
        if isinstance(prompt, list):
            ids = token_ids(prompt)
            bad = [t for t in ids if not 0 <= t < self.model.cfg.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids out of range [0, {self.model.cfg.vocab_size}): {bad[:5]}")
            return ids
        prompt = utf8_text(prompt)
        if chat:
            return self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def _sequences(self, prompts, params: SamplingParams | list[SamplingParams] | None, chat: bool) -> list[Sequence]:
        if isinstance(prompts, (str, bytes)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], Integral)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a str, a list of token ids or a list of these, got {type(prompts).__name__}")
        if not prompts:
            raise ValueError("no prompts given")
        params = SamplingParams() if params is None else params
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if not all(isinstance(p, SamplingParams) for p in plist):
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got {params!r}")
        if len(plist) != len(prompts):
            raise ValueError(f"sampling_params: {len(plist)} SamplingParams for {len(prompts)} prompts")
        seqs = [Sequence(p, self.encode(p, chat), sp, self.tokenizer, self.eos_ids) for p, sp in zip(prompts, plist)]
        for s in seqs:  # the synchronous API refuses, before any work, a request that cannot run
            self.engine.check(s)
        return seqs

    def generate(self, prompts: str | list[int] | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 chat: bool = False) -> list[RequestOutput]:
        """Generate for one prompt or a batch (one SamplingParams, or one per prompt), on the engine
        thread beside whatever else runs there. A request that cannot run, or whose step raises, raises
        its error here; one whose logits turn NaN or Inf returns with finish_reason "error" and `error` set."""
        self.calibrate()
        seqs = self._sequences(prompts, sampling_params, chat)
        worker = self.worker
        handles = worker.submit_all(seqs)
        try:
            outputs = [h.result() for h in handles]
        except BaseException:  # interrupted: the requests stop too
            for h in handles:
                worker.abort(h.request_id)
            raise
        for h in handles:
            if h.exception is not None:
                raise h.exception
        return outputs

    def stream(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
               chat: bool = False) -> Iterator[str]:
        """Yield text as the engine thread produces it (streams may be consumed in any order, from any
        thread); its RequestOutput is then `self.last_output` in this thread. Closing the iterator stops
        decoding (finish_reason "abort")."""
        self.calibrate()
        seqs = self._sequences(prompt, sampling_params, chat)
        if len(seqs) != 1:
            raise TypeError("prompt: stream takes one prompt (a str or a list of token ids); generate takes several")
        (seq,) = seqs
        worker = self.worker
        handle = worker.submit(seq)
        try:
            for delta in handle:  # the last delta carries the last text too
                if delta.text:
                    yield delta.text
        finally:
            if not handle.done.is_set():  # a closed stream stops decoding, before close() returns
                worker.abort(handle.request_id)
                # unless the garbage collector closes it on the engine thread itself, which would wait for itself
                if threading.current_thread() is not worker.thread:
                    handle.done.wait()
            self._streams.output = seq.output()
        if handle.exception is not None:
            raise handle.exception

    @property
    def last_output(self) -> RequestOutput | None:
        """The RequestOutput of the last stream this thread ran to its end or closed: per thread, so that
        a stream in another thread never takes its place."""
        return getattr(self._streams, "output", None)

    @property
    def worker(self) -> EngineThread:
        """The engine thread that owns `self.engine.step()` (started on first use); it decodes with
        this LLM's thread count (`self.threads`)."""
        with _WORKER_LOCK:
            if getattr(self, "_worker", None) is None:
                self._worker = EngineThread(self.engine)
                # the thread holds the engine, never the LLM: an LLM nobody holds stops its thread and
                # frees the weights and the KV pool (a leaked pool also made every later fork fail)
                self._stop_worker = weakref.finalize(self, self._worker.stop)
        self._worker.threads = self.threads
        return self._worker

    def close(self) -> None:
        """Stop the engine thread (aborting what is in flight); a later request starts a new one."""
        with _WORKER_LOCK:
            if getattr(self, "_worker", None) is not None:
                self._stop_worker()
                self._worker = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def teacher_forced(self, prompt_ids: list[int], continuation: list[int]) -> list[TeacherForcedStep]:
        """What early exit would emit at each position of a fixed continuation (see EarlyExitDecoding)."""
        self.calibrate()
        if self.early_exit is None:
            raise ValueError("teacher_forced needs early exit enabled (LLM(..., early_exit=EarlyExitConfig(...)))")
        params = SamplingParams(max_tokens=len(continuation), ignore_eos=True)
        seq = Sequence(prompt_ids, list(prompt_ids), params, self.tokenizer, self.eos_ids)
        return self.early_exit.teacher_forced(seq, continuation)
