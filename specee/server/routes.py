"""The HTTP routes: OpenAI's /v1 API, vLLM's /tokenize and /detokenize, /health, /metrics, the chat page."""
from __future__ import annotations

import asyncio
import time
from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from .errors import APIError
from .generation import chat_ids, generate
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .state import ServerState

router = APIRouter()
STARTED = int(time.time())


def state_of(request: Request) -> ServerState:
    return request.app.state.specee


@router.get("/health", summary="200 when the model is loaded, 503 while it loads")
async def health(request: Request) -> JSONResponse:
    state = state_of(request)
    if state.ready.is_set():
        return JSONResponse({"status": "ok"})
    status = f"error: {state.load_error}" if state.load_error else "loading"
    return JSONResponse({"status": status}, status_code=503)


@router.get("/v1/models")
async def models(request: Request) -> dict:
    state = state_of(request)
    state.require_ready()
    return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": STARTED,
                                        "owned_by": "specee", "max_model_len": state.llm.model.cfg.context_limit}]}


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    return await generate(request, state_of(request), body)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    return await generate(request, state_of(request), body)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    state = state_of(request)
    state.require_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", "prompt", "invalid_value")
    if body.prompt is not None:
        ids = await asyncio.to_thread(encode_prompt, state, body.prompt, body.add_special_tokens)
    else:
        ids = (await asyncio.to_thread(chat_ids, state, body.messages))[1]
    return {"tokens": ids, "count": len(ids), "max_model_len": state.llm.model.cfg.context_limit}


def encode_prompt(state: ServerState, prompt: str, add_special_tokens: bool) -> list[int]:
    try:
        return state.llm.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    except ValueError as e:  # not valid UTF-8 (a lone surrogate)
        raise APIError(400, f"prompt: {e}", "prompt", "invalid_value") from None


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    state = state_of(request)
    state.require_model(body.model)
    vocab = state.llm.model.cfg.vocab_size
    if bad := [t for t in body.tokens if not 0 <= t < vocab]:
        raise APIError(400, f"tokens: ids out of range [0, {vocab}): {bad[:5]}", "tokens", "invalid_value")
    return {"prompt": await asyncio.to_thread(state.llm.tokenizer.decode, body.tokens)}


@router.get("/metrics", summary="Prometheus metrics")
async def metrics(request: Request) -> Response:
    state = state_of(request)
    state.require_ready()
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/", include_in_schema=False)
async def chat_page() -> HTMLResponse:
    return HTMLResponse(resources.files("specee.server").joinpath("static/index.html").read_text())
