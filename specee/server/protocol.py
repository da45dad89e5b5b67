"""Request bodies of the OpenAI-compatible routes, and what the engine can honour of them.

Unknown fields are refused (extra="forbid"); known fields the engine cannot honour (tools, a
response_format with a schema, logprobs, penalties, min_p, logit_bias, echo, suffix, best_of) are
accepted by the schema only to be refused by `refusals()` with a 400 that names them."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..sampling import SamplingParams
from .errors import APIError

MAX_N = 16  # choices per request: each is a row of the batch


class Strict(BaseModel):
    # NaN and infinities are refused as such ("temperature: Input should be a finite number"), not as out of range
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(Strict):
    include_usage: bool = False


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class GenerationRequest(Strict):
    """Fields both /v1/completions and /v1/chat/completions take."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="0 or -1: off")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # the caller's end-user id: carried by clients, used for nothing here
    ignore_eos: bool = False  # vLLM's extension: decode past end-of-sequence (benchmarks)

    def refusals(self) -> list[tuple[str, str]]:
        """(param, why) for each field set to something the engine cannot do."""
        out = []
        if self.min_p:
            out.append(("min_p", "min_p is not supported by specee's sampler; leave it at 0"))
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                out.append((name, f"{name} is not supported by specee's sampler; leave it at 0"))
        if self.logit_bias:
            out.append(("logit_bias", "logit_bias is not supported by specee's sampler"))
        if self.stream_options is not None and not self.stream:
            out.append(("stream_options", "stream_options is only allowed with stream: true"))
        return out

    def check(self) -> None:
        if bad := self.refusals():
            param, why = bad[0]
            raise APIError(400, why, param, "unsupported_parameter")

    def sampling_params(self, max_tokens: int, seed_offset: int = 0) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        seed = None if self.seed is None else (self.seed + seed_offset) % 2**63
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_k=max(self.top_k, 0),
                                  top_p=self.top_p, seed=seed, stop=tuple(stop), ignore_eos=self.ignore_eos)
        except ValueError as e:
            raise APIError(400, str(e), "stop" if "stop" in str(e) else None, "invalid_value") from None


class ChatCompletionRequest(GenerationRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    functions: list[dict[str, Any]] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None

    def refusals(self) -> list[tuple[str, str]]:
        out = super().refusals()
        for name in ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls"):
            if getattr(self, name) not in (None, [], "none"):
                out.append((name, f"{name}: tool calling is not supported by specee serve"))
        if self.logprobs or self.top_logprobs:
            out.append(("logprobs" if self.logprobs else "top_logprobs", "logprobs are not supported by specee serve"))
        if self.response_format and self.response_format.get("type", "text") != "text":
            out.append(("response_format", "response_format: only {\"type\": \"text\"} is supported "
                                           "(no JSON mode or schema-guided decoding)"))
        return out

    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    def refusals(self) -> list[tuple[str, str]]:
        out = super().refusals()
        if self.logprobs is not None:
            out.append(("logprobs", "logprobs are not supported by specee serve"))
        if self.echo:
            out.append(("echo", "echo is not supported by specee serve"))
        if self.suffix:
            out.append(("suffix", "suffix (insertion) is not supported by specee serve"))
        if self.best_of is not None and self.best_of != self.n:
            out.append(("best_of", "best_of is not supported by specee serve (n choices are all returned)"))
        return out

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise APIError(400, "prompt: at least one prompt is needed", "prompt", "invalid_value")
        return list(p)

    def token_budget(self) -> int | None:
        return self.max_tokens


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]
