"""The API key: `Authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`) on every route but the probes,
checked before the body is read.

Why an ASGI middleware outside the body limit, not a FastAPI dependency: a dependency runs after FastAPI
has buffered, JSON-parsed and validated the body, so a client without the key could make the server do
all of that (seconds of event-loop time for a crafted 8 MiB body) before hearing 401. Here the 401 is
sent from the headers alone. The key is compared in constant time (hmac.compare_digest), so the time
taken does not reveal how much of a guess was right. The interactive docs (/docs, /redoc, /openapi.json)
are behind the key too: they describe the API to whoever may use it.

Two keys: the clients' (`--api-key`) and the operator's (`--admin-api-key`). Clients may be several tenants holding
the one client key, so what only whoever runs the server may see needs a key of its own: with an admin key set,
/metrics (whose miss reasons tell one tenant another salt's prompts exist) and the KV inspector's data (/v1/kv/*:
every tenant's prompt text) need the admin key, and the client key does not open them. The admin key opens every
client route too, so that one key serves the operator's tools (`kvserve doctor`). Without an admin key, /metrics is
open as vLLM's and the inspector's data needs the client key (kvserve.server.app: redacted by default then).
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve.server.errors import APIError, send_error

OPEN_PATHS = frozenset({"/health", "/version"})  # probes carry no key
METRICS_PATH = "/metrics"  # scrapers carry none, unless the operator gave it an admin key
# The KV inspector page and its static assets load without the key (the page asks for it); its data needs it.
UI_PATHS = frozenset({"/", "/ui"})
UI_ASSET_PREFIX = "/ui/assets/"
KV_DATA_PREFIX = "/v1/kv/"  # the inspector's data: the admin key's when there is one


def check_api_key(api_key: str) -> str:
    """The key to require; an empty or blank one would let anyone in, so it is refused (ValueError)."""
    if not api_key.strip():
        raise ValueError(
            "the API key is empty: that would serve without authentication. Give a non-empty key, "
            "or none at all to serve openly"
        )
    return api_key.strip()


def unauthorized(admin: bool = False) -> APIError:
    which = "the admin key (--admin-api-key)" if admin else "API key"
    return APIError(
        401,
        f"Invalid or missing {which}: send it as `Authorization: Bearer <key>` or `x-api-key: <key>`.",
        code="invalid_api_key",
    )


class APIKeyMiddleware:
    """401 for HTTP requests without the key their path needs (see the module docstring), as `Authorization: Bearer
    <key>` or `x-api-key: <key>` (the header Anthropic's SDK sends; either route accepts either header), body unread.
    `api_key`: the clients' (None: client routes are open); `admin_key`: the operator's (None: none).

    A refused body that is declared small enough to accept (Content-Length up to `max_body_bytes`) is left
    for the server to discard, so the client reads its 401 on a connection that stays usable; any other
    body (larger, or chunked of unknown length) closes the connection after the 401 rather than be drained.
    """

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int, admin_key: str | None = None) -> None:
        self.app = app
        self._key = check_api_key(api_key).encode() if api_key is not None else None
        self._admin_key = check_api_key(admin_key).encode() if admin_key is not None else None
        self._max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        admin = self._admin_key is not None and _is_admin(scope["path"])
        await send_error(scope, send, unauthorized(admin), close=not self._drainable(scope))

    def _allowed(self, scope: Scope) -> bool:
        path = scope["path"]
        if _is_open(path):
            return True
        if _is_admin(path):
            if self._admin_key is not None:
                return self._carries(scope, self._admin_key)
            if path == METRICS_PATH:
                return True
        if self._key is None:
            return True
        return self._carries(scope, self._key) or (
            self._admin_key is not None and self._carries(scope, self._admin_key)
        )

    @staticmethod
    def _carries(scope: Scope, key: bytes) -> bool:
        scheme, _, token = _header(scope, b"authorization").partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key):
            return True
        api_key = _header(scope, b"x-api-key")
        return bool(api_key) and hmac.compare_digest(api_key.strip(), key)

    def _drainable(self, scope: Scope) -> bool:
        if _header(scope, b"transfer-encoding"):
            return False
        length = _header(scope, b"content-length") or b"0"
        return length.isdigit() and int(length) <= self._max_body_bytes


def _is_admin(path: str) -> bool:
    return path == METRICS_PATH or path.startswith(KV_DATA_PREFIX)


def _is_open(path: str) -> bool:
    return path in OPEN_PATHS or path in UI_PATHS or path.startswith(UI_ASSET_PREFIX)


def _header(scope: Scope, name: bytes) -> bytes:
    """The first value of header `name` (lower case), or b"" when absent."""
    for key, value in scope.get("headers", ()):
        if key == name:
            return bytes(value)
    return b""
