"""The ASGI app: `create_app(...)` wires the state, the routes, the error shape and the guard
(body size limit, bearer key) around them; the same app runs under uvicorn or Ray Serve."""
from __future__ import annotations

import hmac
import json
from collections.abc import Callable

from fastapi import FastAPI

from ..engine.scheduling import DEFAULT_MAX_QUEUE
from .errors import error_body, install_error_handlers
from .routes import router
from .state import ServerState

MAX_BODY_BYTES = 4 * 2**20  # far above any prompt that fits a context; a bound on what one client can make us hold
OPEN_PATHS = frozenset({"/health", "/"})  # a liveness probe and the static chat page carry no data


class Guard:
    """Pure ASGI middleware: refuses bodies over `max_body` (413, read before the app sees them)
    and, with an API key, requests without `Authorization: Bearer KEY` (401, compared in constant time)."""

    def __init__(self, app, max_body: int, api_key: str | None):
        self.app, self.max_body = app, max_body
        self.key = None if api_key is None else api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.key is not None and scope["path"] not in OPEN_PATHS:
            auth = headers.get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                return await reply(send, 401, "invalid or missing API key (Authorization: Bearer KEY)",
                                   code="invalid_api_key", extra=[(b"www-authenticate", b"Bearer")])
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            return await reply(send, 413, f"request body over {self.max_body} bytes", code="body_too_large")
        body, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return
            body.append(message.get("body", b""))
            more = message.get("more_body", False)
            if sum(map(len, body)) > self.max_body:
                return await reply(send, 413, f"request body over {self.max_body} bytes", code="body_too_large")
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # what follows the body: the client's disconnect
            replayed = True
            return {"type": "http.request", "body": b"".join(body), "more_body": False}

        await self.app(scope, replay, send)


async def reply(send, status: int, message: str, code: str, extra: list | None = None) -> None:
    payload = json.dumps(error_body(status, message, code=code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            *(extra or [])]})
    await send({"type": "http.response.body", "body": payload})


def create_app(llm=None, *, load: Callable[[], object] | None = None, model_name: str = "specee",
               api_key: str | None = None, max_queue: int = DEFAULT_MAX_QUEUE,
               max_body_bytes: int = MAX_BODY_BYTES, on_load_error: Callable[[str], None] | None = None) -> FastAPI:
    """An app serving `llm`, or the LLM `load()` returns (called in a background thread at startup;
    /health answers 503 until it is there)."""
    from contextlib import asynccontextmanager

    from .. import __version__

    state = ServerState(model_name, max_queue)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        if llm is None and load is not None:
            state.load_in_background(load, on_load_error)
        yield

    app = FastAPI(title="specee", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible completions on specee's engine")
    app.state.specee = state
    if llm is not None:
        state.attach(llm)
    install_error_handlers(app)
    app.include_router(router)
    app.add_middleware(Guard, max_body=max_body_bytes, api_key=api_key)
    return app
