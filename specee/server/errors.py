"""Errors in the OpenAI shape, `{"error": {"message", "type", "param", "code"}}`, for every failure:
request validation, refused fields, HTTP routing, and whatever else escapes a handler."""
from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

log = logging.getLogger("specee.server")

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}


UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "function-after"})


class APIError(Exception):
    """A request the server refuses or cannot serve, answered with `status` in the OpenAI shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": TYPES.get(status, "server_error" if status >= 500 else
                                                             "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def is_union_tag(part: object) -> bool:
    """A union's branch appears in an error's location as its type ("str", "list[TextPart]"), not a field."""
    return isinstance(part, str) and (part in UNION_TAGS or "[" in part)


def validation_message(err: dict[str, Any]) -> tuple[str, str | None, str]:
    """One line naming the field, the field and an error code, from a pydantic error."""
    loc = [str(p) for p in err.get("loc", ()) if p != "body" and not is_union_tag(p)]
    param = ".".join(loc) or None
    kind = err.get("type", "")
    if kind == "json_invalid":
        return f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}", None, "invalid_json"
    if kind == "extra_forbidden":
        return f"unrecognized request argument: {param}", param, "unrecognized_argument"
    if param is None:
        return "the body must be a JSON object sent with Content-Type: application/json", None, "invalid_json"
    return f"{param}: {err.get('msg', 'invalid value')}", param, "invalid_value"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()  # of a union's branches, the one that got furthest names the field
        return error_response(400, *validation_message(max(errors, key=lambda err: len(err.get("loc", ())))))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException) -> JSONResponse:
        return error_response(e.status_code, str(e.detail), headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(_: Request, e: Exception) -> JSONResponse:
        log.exception("specee serve: unexpected error")
        return error_response(500, f"internal error: {type(e).__name__}: {e}")
