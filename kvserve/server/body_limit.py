"""A bound on request bodies: larger ones get 413 with OpenAI's error body, before any route sees them.

Why an ASGI middleware that buffers up to the limit: a declared Content-Length over the limit is refused
without reading a byte, and a chunked body (no Content-Length) is counted as it arrives and refused as
soon as it crosses the limit, so one client can never make the server hold more than the limit in memory
for its body. A body within the limit is replayed to the app unchanged; after it, the app's `receive`
goes to the connection again (the disconnect watch of non-streaming requests relies on that).
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.server.errors import APIError

DEFAULT_MAX_REQUEST_BODY_BYTES = 8 << 20  # 8 MiB: ~100 bytes per token of a 64k-token prompt


def too_large(limit: int, size: int | None = None) -> APIError:
    got = f"{size} bytes" if size is not None else "more than that"
    return APIError(413, f"The request body is too large: the limit is {limit} bytes "
                         f"(--max-request-body-bytes), got {got}.", code="request_too_large")


class BodyLimitMiddleware:
    """Refuse HTTP request bodies over `max_bytes` with 413."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await _send_error(send, too_large(self.max_bytes, declared))
            return
        buffered: list[Message] = []
        size = 0
        while True:
            message = await receive()
            buffered.append(message)
            if message["type"] != "http.request":
                break  # a disconnect: the app will see it
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await _send_error(send, too_large(self.max_bytes))
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return buffered.pop(0) if buffered else await receive()

        await self.app(scope, replay, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _send_error(send: Send, error: APIError) -> None:
    response = error.response(headers={"Connection": "close"})
    await send({"type": "http.response.start", "status": response.status_code,
                "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})
