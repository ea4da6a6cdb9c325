"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`, and the status of each failure.

Requests to Anthropic's Messages API (paths under /v1/messages) get Anthropic's shape instead,
`{"type": "error", "error": {"type", "message"}}`, with the same status: its SDK reads that shape.

Why one place: every way a request can fail (validation, engine limits, auth, a dead engine, a bug) must
reach clients in the same shape and with the same status, whether it happens before the response starts
(an HTTP status) or inside a stream (a `data: {"error": ...}` frame).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.engine.async_engine import (
    EngineDeadError,
    EngineFaultError,
    QueueFullError,
    ServerShuttingDownError,
)
from kvserve.server.protocol import ErrorInfo, ErrorResponse
from kvserve.structured.compiler import GrammarBusy

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable_error",
}

# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors); 503 is its "overloaded".
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
ANTHROPIC_PATH_PREFIX = "/v1/messages"


def anthropic_path(path: str) -> bool:
    """Whether `path` is the Messages API's, whose errors take Anthropic's shape."""
    return path == ANTHROPIC_PATH_PREFIX or path.startswith(ANTHROPIC_PATH_PREFIX + "/")


# Fields named first in SamplingParams' ValueError messages ("temperature must be ..."), for `param`.
_PARAM_NAMES = frozenset(
    {
        "n",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "max_tokens",
        "min_tokens",
        "logprobs",
        "prompt_logprobs",
        "stop",
        "stop_token_ids",
    }
)


class APIError(Exception):
    """A failure with its HTTP status and OpenAI error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(
            message=self.message, type=_TYPES.get(self.status, "server_error"), param=self.param, code=self.code
        )
        return ErrorResponse(error=info).model_dump()

    def anthropic_body(self) -> dict[str, Any]:
        """Anthropic's shape; the field at fault, which it has no slot for, is named in the message."""
        message = self.message
        if self.param is not None and self.param not in message:
            message = f"{self.param}: {message}"
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(self.status, "api_error"), "message": message}}

    def response(self, headers: Mapping[str, str] | None = None, *, anthropic: bool = False) -> JSONResponse:
        body = self.anthropic_body() if anthropic else self.body()
        return JSONResponse(body, status_code=self.status, headers=headers)

    def response_for(self, path: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
        """The response in the shape the API at `path` speaks."""
        return self.response(headers, anthropic=anthropic_path(path))


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


async def send_error(scope: Scope, send: Send, error: APIError, close: bool) -> None:
    """Answer with `error` from ASGI middleware, before any route runs, in the shape of the API at the request's
    path; `close` ends the connection after it (when the request's body is left unread, or arrives too slowly to
    wait for)."""
    response = error.response_for(scope.get("path", ""), headers={"Connection": "close"} if close else None)
    await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})


def from_exception(exc: BaseException) -> APIError:
    """Map any exception to the error a client sees; 500 only for what is a bug (or a dead engine's fault)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValueError):
        first = str(exc).split(" ", 1)[0]
        return bad_request(str(exc), param=first if first in _PARAM_NAMES else None)
    if isinstance(exc, QueueFullError):
        return APIError(503, str(exc), code="queue_full")
    if isinstance(exc, GrammarBusy):
        return APIError(503, str(exc), code="grammar_queue_full")
    if isinstance(exc, ServerShuttingDownError):
        return APIError(503, str(exc), code="server_shutting_down")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_dead")
    if isinstance(exc, EngineFaultError):
        return APIError(500, str(exc), code="engine_fault")
    return APIError(500, f"internal server error: {type(exc).__name__}: {exc}")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    if errors[0].get("type") == "json_invalid":
        return _json_error_message(errors[0], exc.body), None
    parts, param = [], None
    for err in errors[:3]:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if param is None and loc:
            param = ".".join(loc)
        parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid')}")
    return "; ".join(parts), param


def _json_error_message(error: dict[str, Any], document: Any) -> str:
    """Where the JSON is invalid, in line and column (FastAPI reports the character offset as the error's
    location, which is no field a client could name as `param`)."""
    reason = (error.get("ctx") or {}).get("error", "invalid JSON")
    loc = error.get("loc", ())
    offset = loc[-1] if loc and isinstance(loc[-1], int) else None
    if offset is None or not isinstance(document, str):
        return f"The request body is not valid JSON: {reason}."
    line = document.count("\n", 0, offset) + 1
    column = offset - (document.rfind("\n", 0, offset) + 1) + 1
    return f"The request body is not valid JSON: {reason} at line {line}, column {column} (character {offset})."


def install_error_handlers(app: FastAPI) -> None:
    """Route every failure through APIError so that all bodies share OpenAI's shape."""

    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        return from_exception(exc).response_for(request.url.path)

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        message, param = _validation_message(exc)
        return bad_request(message, param).response_for(request.url.path)

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        return APIError(exc.status_code, str(exc.detail)).response_for(request.url.path, headers=exc.headers)

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error while serving a request")
        return from_exception(exc).response_for(request.url.path)

    for kind in (APIError, ValueError, QueueFullError, GrammarBusy, EngineDeadError, EngineFaultError):
        app.add_exception_handler(kind, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_middleware(UnexpectedErrorMiddleware)  # the innermost middleware: what a route raises unhandled
    app.add_exception_handler(Exception, on_unexpected)  # what the outer middlewares raise


class UnexpectedErrorMiddleware:
    """An exception no handler knows (a bug) answered with a 500 in OpenAI's shape, on a connection that lives on.

    Why not Starlette's handler for Exception alone: its ServerErrorMiddleware sends that handler's 500 and then
    raises the exception again, and uvicorn closes the connection after an application raised: a client's next
    request on its kept-alive connection was reset (measured: the request after a 500 failed with ECONNRESET).
    Caught here, the 500 is all that happens. A response already started (a stream) is ended instead; the stream
    itself sends its error frame where it has one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = finished = False

        async def tracked(message: Message) -> None:
            nonlocal started, finished
            if message["type"] == "http.response.start":
                started = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            logger.exception("unhandled error while serving a request")
            if not started:
                await from_exception(exc).response_for(scope.get("path", ""))(scope, receive, send)
            elif not finished:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
