"""What a request body must satisfy before any route sees it: a size limit (413), a read deadline (408) and,
for JSON, a bounded shape (400), each answered with OpenAI's error body.

Why an ASGI middleware that buffers up to the limit: a declared Content-Length over the limit is refused
without reading a byte, and a chunked body (no Content-Length) is counted as it arrives and refused as
soon as it crosses the limit, so one client can never make the server hold more than the limit in memory
for its body. The whole body must arrive within the read timeout, so a client that trickles it cannot hold
a connection and its buffer open forever. A JSON body's shape is measured before FastAPI parses it
(json_limits.py): parsing cost grows with the number of values, not bytes; large bodies are measured in a
worker thread (numpy releases the GIL), so the event loop keeps serving meanwhile. A body that passes is
replayed to the app unchanged; after it, the app's `receive` goes to the connection again (the disconnect
watch of non-streaming requests relies on that).
"""

from __future__ import annotations

import asyncio
import email.message

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.server.errors import APIError, send_error
from kvserve.server.json_limits import JSONLimits

DEFAULT_MAX_REQUEST_BODY_BYTES = 8 << 20  # 8 MiB: ~100 bytes per token of a 64k-token prompt
_INLINE_SCAN_BYTES = 256 << 10  # smaller bodies are measured on the loop: a thread hop would cost more


def too_large(limit: int, size: int | None = None) -> APIError:
    got = f"{size} bytes" if size is not None else "more than that"
    return APIError(
        413,
        f"The request body is too large: the limit is {limit} bytes (--max-request-body-bytes), got {got}.",
        code="request_too_large",
    )


def too_slow(timeout_s: float) -> APIError:
    return APIError(
        408, f"The request body did not arrive within {timeout_s:g} s (--timeout-body-read).", code="request_timeout"
    )


class _TooLarge(Exception):
    pass


class BodyLimitMiddleware:
    """Refuse HTTP request bodies over `max_bytes` (413), not complete within `read_timeout_s` (408), or, when
    JSON, shaped beyond `json_limits` (400)."""

    def __init__(
        self, app: ASGIApp, max_bytes: int, read_timeout_s: float, json_limits: JSONLimits | None = None
    ) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        if not read_timeout_s > 0:
            raise ValueError(f"read_timeout_s must be > 0, got {read_timeout_s}")
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout_s = read_timeout_s
        self.json_limits = json_limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await send_error(scope, send, too_large(self.max_bytes, declared), close=True)
            return
        try:
            buffered = await asyncio.wait_for(self._read(receive), self.read_timeout_s)
        except _TooLarge:
            await send_error(scope, send, too_large(self.max_bytes), close=True)
            return
        except asyncio.TimeoutError:
            await send_error(scope, send, too_slow(self.read_timeout_s), close=True)
            return
        if self.json_limits is not None and _is_json(scope):
            try:
                await self._check_shape(b"".join(m.get("body", b"") for m in buffered))
            except APIError as error:
                await send_error(scope, send, error, close=False)  # the body was read whole: keep the connection
                return

        async def replay() -> Message:
            return buffered.pop(0) if buffered else await receive()

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive) -> list[Message]:
        """The body's messages up to its end (or a disconnect, which the app will see)."""
        buffered: list[Message] = []
        size = 0
        while True:
            message = await receive()
            buffered.append(message)
            if message["type"] != "http.request":
                return buffered
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                raise _TooLarge
            if not message.get("more_body", False):
                return buffered

    async def _check_shape(self, body: bytes) -> None:
        assert self.json_limits is not None
        if len(body) <= _INLINE_SCAN_BYTES:
            self.json_limits.check(body)
        else:
            await asyncio.to_thread(self.json_limits.check, body)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _is_json(scope: Scope) -> bool:
    """Whether FastAPI would parse this body as JSON: no Content-Type, application/json or */*+json."""
    for name, value in scope.get("headers", ()):
        if name == b"content-type":
            message = email.message.Message()
            message["content-type"] = value.decode("latin-1")
            subtype = message.get_content_subtype()
            return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))
    return True
