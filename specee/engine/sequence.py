"""One request in flight: its tokens, its text as streamed, when it stops, and its stats."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from numbers import Integral
from typing import Any

from ..sampling import NONFINITE_TOKEN, SamplingParams
from ..tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache, not this request's prefill
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_tokens: int = 0  # tokens of the decode steps: all but what the forward ending the prefill emitted
    threads: int = 0  # CPU threads the request ran with (torch's setting)
    thread_probe_ms: dict[int, float] | None = None  # chosen automatically: a decode step's median per count tried
    early_exit: dict[str, Any] | None = None  # filled by the early-exit and lossless loops
    speculative: dict[str, Any] | None = None  # filled by speculative decoding (specee.speculative)
    # the request's life on the wall clock (time.monotonic()): a server's queue time and latencies
    arrival_time: float = 0.0
    scheduled_time: float | None = None  # admitted to the running batch
    first_token_time: float | None = None
    finish_time: float | None = None

    def ran_on(self, choice) -> None:
        """The thread count the request decodes with (a `ThreadChoice`), and its probe's timings if measured."""
        self.threads, self.thread_probe_ms = choice.threads, dict(choice.step_ms) or None

    @property
    def queue_seconds(self) -> float | None:
        return None if self.scheduled_time is None else self.scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = {
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "prefill_seconds": round(self.prefill_seconds, 6),
            "decode_seconds": round(self.decode_seconds, 6),
            "tokens_per_second": round(self.tokens_per_second, 3),
            "decode_tokens_per_second": round(self.decode_tokens_per_second, 3),
            "threads": self.threads,
        }
        if self.cached_tokens:
            d["cached_tokens"] = self.cached_tokens
        if self.thread_probe_ms:
            d["thread_probe_ms"] = {n: round(ms, 3) for n, ms in self.thread_probe_ms.items()}
        if self.early_exit is not None:
            d["early_exit"] = self.early_exit
        if self.speculative is not None:
            d["speculative"] = self.speculative
        if self.time_to_first_token is not None:
            d["time_to_first_token"] = round(self.time_to_first_token, 6)
        if self.queue_seconds is not None:
            d["queue_seconds"] = round(self.queue_seconds, 6)
        return d


@dataclass
class RequestOutput:
    prompt: str | list[int]
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string), "length", "abort" (aborted while it ran) or "error"
    stats: RequestStats
    request_id: str = ""
    error: str | None = None  # why a request ended with finish_reason "error" (it produced nothing more)


_request_ids = itertools.count()


def next_request_id() -> str:
    return f"req-{next(_request_ids)}"


def token_ids(ids) -> list[int]:
    """Prompt token ids as ints (numpy integers too), or a TypeError: a float id passed the range check
    and failed the embedding inside the step of every request beside it."""
    other = sorted({type(t).__name__ for t in ids if not isinstance(t, Integral) or isinstance(t, bool)})
    if other:
        raise TypeError(f"prompt token ids must be integers, got {', '.join(other)}")
    return [int(t) for t in ids]


@dataclass
class Sequence:
    prompt: str | list[int]
    prompt_ids: list[int]
    params: SamplingParams
    tokenizer: Tokenizer
    eos_ids: frozenset[int]
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    request_id: str = field(default_factory=next_request_id)
    error: str | None = None  # set with finish_reason "error": the request could not run, or went wrong
    _streamed: int = 0

    def __post_init__(self) -> None:
        self.prompt_ids = token_ids(self.prompt_ids)  # whoever built it: the engine takes no float id
        self.detok = IncrementalDetokenizer(self.tokenizer, self.prompt_ids)
        self.stats.prompt_tokens = len(self.prompt_ids)
        self.stats.arrival_time = time.monotonic()
        self._hold = max((len(s) for s in self.params.stop), default=1) - 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def fail(self, message: str) -> None:
        """End the request with an error: it is finished, and nothing else sees it."""
        self.error = message
        self.finish_reason = "error"
        self.stats.finish_time = time.monotonic()

    def abort(self) -> None:
        """End the request as aborted (a closed stream, a client gone), unless it has ended already."""
        if not self.finished:
            self.finish_reason = "abort"
            self.stats.finish_time = time.monotonic()

    def append(self, token: int) -> None:
        """Accept one generated token and decide whether the request is done. NONFINITE_TOKEN (the
        logits were NaN or Inf) ends it as an error; the text before it stays."""
        if token == NONFINITE_TOKEN:
            self.text += self.detok.flush()
            self.fail(f"the model's logits are NaN or infinite at output token {len(self.output_ids) + 1}, so "
                      "decoding stopped (its weights or activations overflow; float32 may help)")
            return
        if not self.output_ids:
            self.stats.first_token_time = time.monotonic()
        self.output_ids.append(token)
        self.stats.generated_tokens = len(self.output_ids)
        eos = token in self.eos_ids and not self.params.ignore_eos
        last = eos or len(self.output_ids) >= self.params.max_tokens
        before = len(self.text)
        if not eos:
            self.text += self.detok.add(token)
        if last:  # nothing follows: release a held partial character too
            self.text += self.detok.flush()
        # the earliest stop string in the text, whatever their order in the list (one token can complete several)
        cuts = [cut for stop in self.params.stop if (cut := self.text.find(stop, max(0, before - len(stop) + 1))) >= 0]
        if cuts:
            self.text = self.text[:min(cuts)]
            self.finish_reason = "stop"
            self.stats.finish_time = time.monotonic()
            return
        if last:
            self.finish_reason = "stop" if eos else "length"
        if self.finish_reason is not None:
            self.stats.finish_time = time.monotonic()

    def take_stream_delta(self) -> str:
        """Text not yet streamed, holding back a tail that could still become a stop string."""
        end = len(self.text) if self.finished else max(self._streamed, len(self.text) - self._hold)
        delta = self.text[self._streamed : end]
        self._streamed = end
        return delta

    def output(self) -> RequestOutput:
        return RequestOutput(self.prompt, self.prompt_ids, self.text, list(self.output_ids),
                             self.finish_reason or "length", self.stats, self.request_id, self.error)
