"""Completions and chat completions: prompts to sequences on the engine thread, and their deltas
back as one OpenAI response or as server-sent chunks. A client that disconnects aborts its
sequences, which leave the engine at its next step."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..engine.sequence import RequestOutput, Sequence
from ..engine.worker import Delta, loop_sink
from .errors import APIError, error_body
from .protocol import ChatCompletionRequest, CompletionRequest, GenerationRequest
from .state import ServerState


class Job:
    """One API request's sequences in flight. Deltas are counted (metrics, the waiting count) as
    they arrive on the event loop, whether or not anyone still reads them."""

    def __init__(self, state: ServerState, seqs: list[Sequence]):
        loop = asyncio.get_running_loop()
        self.state, self.queue = state, asyncio.Queue()
        self.outputs: list[RequestOutput | None] = [None] * len(seqs)
        self.last_token_at: list[float | None] = [None] * len(seqs)
        state.inflight += len(seqs)
        self.handles = state.worker.submit_all(seqs, loop_sink(loop, self._arrive), list(range(len(seqs))))

    def _arrive(self, d: Delta) -> None:
        now, i = time.monotonic(), d.tag
        if d.token_ids:
            if self.last_token_at[i] is not None:
                self.state.metrics.token_gap(now - self.last_token_at[i], len(d.token_ids))
            self.last_token_at[i] = now
        if d.finished:
            self.outputs[i] = d.output
            self.state.inflight -= 1
            self.state.metrics.finished(d.output)
        self.queue.put_nowait(d)

    async def deltas(self) -> AsyncIterator[Delta]:
        left = len(self.handles)
        while left:
            d = await self.queue.get()
            left -= d.finished
            yield d

    def abort(self) -> None:
        for h, out in zip(self.handles, self.outputs):
            if out is None:
                self.state.worker.abort(h.request_id)


@contextlib.asynccontextmanager
async def abort_on_disconnect(request: Request, job: Job):
    """Abort the job when the client goes away, and whenever the body exits without finishing."""
    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        job.abort()

    task = asyncio.create_task(watch())
    try:
        yield
    finally:
        task.cancel()
        job.abort()


# ---- requests to sequences --------------------------------------------------------------------
def chat_ids(state: ServerState, body_messages: list) -> tuple[list[dict[str, str]], list[int]]:
    """A request's chat messages as the template reads them ("developer" is "system") and their token ids,
    as /v1/chat/completions encodes them and /tokenize counts them."""
    if state.llm.tokenizer.chat_template is None:
        raise APIError(400, f"model {state.model_name} has no chat template; use /v1/completions",
                       "messages", "no_chat_template")
    messages = [{"role": m.role if m.role != "developer" else "system", "content": m.text()} for m in body_messages]
    try:
        return messages, state.llm.tokenizer.encode_chat(messages)
    except ValueError as e:
        raise APIError(400, f"messages: {e}", "messages", "invalid_value") from None


def prompt_ids(state: ServerState, body: GenerationRequest) -> list[tuple[str | list[int], list[int]]]:
    llm = state.llm
    if isinstance(body, ChatCompletionRequest):
        messages, ids = chat_ids(state, body.messages)
        return [(messages[-1]["content"], ids)]
    out = []
    for p in body.prompts():
        try:
            out.append((p, llm.encode(p)))
        except ValueError as e:
            raise APIError(400, f"prompt: {e}", "prompt", "invalid_value") from None
    return out


def sequences(state: ServerState, body: GenerationRequest) -> list[Sequence]:
    """n sequences per prompt (seeded ones with seed, seed + 1, ...), each checked against the context and
    the KV cache."""
    llm, limit = state.llm, state.llm.model.cfg.context_limit
    field = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
    budget_field = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
    seqs = []
    for prompt, ids in prompt_ids(state, body):
        if not ids:
            raise APIError(400, f"{field}: empty prompt, at least one token is needed", field, "invalid_value")
        if len(ids) >= limit:
            raise APIError(400, f"{field}: the prompt has {len(ids)} tokens, the model's context is {limit}",
                           field, "context_length_exceeded")
        budget = body.token_budget()
        if budget is None:  # the rest of the context, as far as the KV cache holds it (a bound; runs grow as needed)
            budget = llm.engine.room(len(ids))
            if budget < 1:
                raise APIError(400, f"{field}: the prompt's {len(ids)} tokens leave no room for a completion in the "
                                    "KV cache (--kv-cache-memory)", field, "context_length_exceeded")
        if len(ids) + budget > limit:
            raise APIError(400, f"{budget_field}: prompt ({len(ids)} tokens) + {budget_field} ({budget}) exceeds "
                                f"the model's context of {limit} tokens", budget_field, "context_length_exceeded")
        batch = [Sequence(prompt, ids, body.sampling_params(budget, j), llm.tokenizer, llm.eos_ids) for j in range(body.n)]
        try:  # the cache's size (--kv-cache-memory), before the engine thread would refuse it as a 500
            llm.engine.check(batch[0])
        except ValueError as e:
            raise APIError(400, f"{budget_field}: {e}", budget_field, "invalid_value") from None
        seqs += batch
    return seqs


# ---- responses --------------------------------------------------------------------------------
class Shape:
    """The OpenAI object names and choice layout of one endpoint."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def envelope(self, obj: str, choices: list[dict], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def choice(self, index: int, text: str, finish: str | None, first: bool = False) -> dict[str, Any]:
        if not self.chat:
            return {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
        return {"index": index, "logprobs": None, "finish_reason": finish,
                "delta": ({"role": "assistant", "content": text} if first else {"content": text} if text else {})}

    def full_choice(self, index: int, out: RequestOutput) -> dict[str, Any]:
        if not self.chat:
            return self.choice(index, out.text, out.finish_reason)
        return {"index": index, "message": {"role": "assistant", "content": out.text}, "logprobs": None,
                "finish_reason": out.finish_reason}

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"


def usage(seqs: list[Sequence], outputs: list[RequestOutput], n: int) -> dict[str, int]:
    prompt = sum(len(s.prompt_ids) for s in seqs[::n])  # a prompt counts once for its n choices
    completion = sum(len(o.token_ids) for o in outputs)
    cached = sum(s.stats.cached_tokens for s in seqs[::n])  # prompt tokens the prefix cache held (OpenAI's field)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def failure(outputs: list[RequestOutput | None]) -> str | None:
    return next((o.error or "the request failed" for o in outputs if o and o.finish_reason == "error"), None)


async def generate(request: Request, state: ServerState, body: ChatCompletionRequest | CompletionRequest):
    state.require_model(body.model)
    body.check()
    # tokenizing off the event loop: a 4 MB prompt held every stream up for 5 s
    seqs = await asyncio.to_thread(sequences, state, body)
    state.admit(len(seqs), "n" if body.n > 1 else "messages" if isinstance(body, ChatCompletionRequest) else "prompt")
    shape = Shape(isinstance(body, ChatCompletionRequest), state.model_name)
    job = Job(state, seqs)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(stream(request, job, shape, seqs, body.n, include_usage),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    async with abort_on_disconnect(request, job):
        async for _ in job.deltas():
            pass
    if message := failure(job.outputs):
        raise APIError(500, f"generation failed: {message}", code="generation_error")
    outputs = job.outputs
    return JSONResponse(shape.envelope(
        "chat.completion" if shape.chat else "text_completion",
        [shape.full_choice(i, o) for i, o in enumerate(outputs)], usage=usage(seqs, outputs, body.n),
        specee={"choices": [o.stats.as_dict() for o in outputs]}))


async def stream(request: Request, job: Job, shape: Shape, seqs: list[Sequence], n: int,
                 include_usage: bool) -> AsyncIterator[str]:
    extra = {"usage": None} if include_usage else {}
    async with abort_on_disconnect(request, job):
        if shape.chat:
            for i in range(len(seqs)):
                yield sse(shape.envelope(shape.chunk_object, [shape.choice(i, "", None, first=True)], **extra))
        async for d in job.deltas():
            if d.text:
                yield sse(shape.envelope(shape.chunk_object, [shape.choice(d.tag, d.text, None)], **extra))
            if d.finished:
                out = d.output
                if out.finish_reason == "error":
                    yield sse(error_body(500, f"generation failed: {out.error}", code="generation_error"))
                    continue
                last = shape.choice(d.tag, "", out.finish_reason)
                yield sse(shape.envelope(shape.chunk_object, [last], specee=out.stats.as_dict(), **extra))
        if include_usage:
            yield sse(shape.envelope(shape.chunk_object, [], usage=usage(seqs, job.outputs, n)))
        yield "data: [DONE]\n\n"
