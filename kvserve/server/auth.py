"""The API key: `Authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`) on every route but the probes,
checked before the body is read.

Why an ASGI middleware outside the body limit, not a FastAPI dependency: a dependency runs after FastAPI
has buffered, JSON-parsed and validated the body, so a client without the key could make the server do
all of that (seconds of event-loop time for a crafted 8 MiB body) before hearing 401. Here the 401 is
sent from the headers alone. The key is compared in constant time (hmac.compare_digest), so the time
taken does not reveal how much of a guess was right. The interactive docs (/docs, /redoc, /openapi.json)
are behind the key too: they describe the API to whoever may use it.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve.server.errors import APIError, send_error

OPEN_PATHS = frozenset({"/health", "/version", "/metrics"})  # probes and scrapers carry no key
# The KV inspector page and its static assets load without the key (the page asks for it); its data needs it.
UI_PATHS = frozenset({"/", "/ui"})
UI_ASSET_PREFIX = "/ui/assets/"


def check_api_key(api_key: str) -> str:
    """The key to require; an empty or blank one would let anyone in, so it is refused (ValueError)."""
    if not api_key.strip():
        raise ValueError(
            "the API key is empty: that would serve without authentication. Give a non-empty key, "
            "or none at all to serve openly"
        )
    return api_key.strip()


def unauthorized() -> APIError:
    return APIError(
        401,
        "Invalid or missing API key: send it as `Authorization: Bearer <key>` or `x-api-key: <key>`.",
        code="invalid_api_key",
    )


class APIKeyMiddleware:
    """401 for HTTP requests outside OPEN_PATHS without `Authorization: Bearer <api_key>` or `x-api-key: <api_key>`
    (the header Anthropic's SDK sends; either route accepts either header), body unread.

    A refused body that is declared small enough to accept (Content-Length up to `max_body_bytes`) is left
    for the server to discard, so the client reads its 401 on a connection that stays usable; any other
    body (larger, or chunked of unknown length) closes the connection after the 401 rather than be drained.
    """

    def __init__(self, app: ASGIApp, api_key: str, max_body_bytes: int) -> None:
        self.app = app
        self._key = check_api_key(api_key).encode()
        self._max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _is_open(scope["path"]) or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        await send_error(scope, send, unauthorized(), close=not self._drainable(scope))

    def _authorized(self, scope: Scope) -> bool:
        scheme, _, token = _header(scope, b"authorization").partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key):
            return True
        api_key = _header(scope, b"x-api-key")
        return bool(api_key) and hmac.compare_digest(api_key.strip(), self._key)

    def _drainable(self, scope: Scope) -> bool:
        if _header(scope, b"transfer-encoding"):
            return False
        length = _header(scope, b"content-length") or b"0"
        return length.isdigit() and int(length) <= self._max_body_bytes


def _is_open(path: str) -> bool:
    return path in OPEN_PATHS or path in UI_PATHS or path.startswith(UI_ASSET_PREFIX)


def _header(scope: Scope, name: bytes) -> bytes:
    """The first value of header `name` (lower case), or b"" when absent."""
    for key, value in scope.get("headers", ()):
        if key == name:
            return bytes(value)
    return b""
