"""The HTTP/1.1 transport under the app: uvicorn's h11 protocol with a header read timeout, no upgrades,
and the uvicorn configuration that uses it.

Why a protocol subclass: uvicorn bounds how long an idle keep-alive connection stays open
(`timeout_keep_alive`), but not how long a client may take to send a request's headers, so a client that
sends one header byte at a time (slowloris) holds its connection, and its slot, forever. The body's own
read timeout lives in the ASGI middleware (body_limit.py), where a late body can be answered with 408.

Why no upgrades: kvserve serves no WebSockets, and HTTP/2 clients that offer an h2c upgrade (Java's
HttpClient sends `Connection: Upgrade, HTTP2-Settings` and `Upgrade: h2c` on every request) are answered
over HTTP/1.1 anyway, as RFC 9110 allows; uvicorn answers them the same way but logs two misleading
warnings per request ("Unsupported upgrade request", "No supported WebSocket library detected").
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

DEFAULT_TIMEOUT_KEEP_ALIVE_S = 5  # uvicorn's and vLLM's default
DEFAULT_TIMEOUT_HEADER_READ_S = 30.0
DEFAULT_TIMEOUT_BODY_READ_S = 60.0


@dataclass(frozen=True, slots=True)
class TransportLimits:
    """How long a connection may wait on its client, per phase of a request."""

    timeout_keep_alive: int = DEFAULT_TIMEOUT_KEEP_ALIVE_S  # idle between requests (uvicorn's own)
    timeout_header_read: float = DEFAULT_TIMEOUT_HEADER_READ_S  # connect or last response -> complete headers
    timeout_body_read: float = DEFAULT_TIMEOUT_BODY_READ_S  # complete headers -> complete body

    def __post_init__(self) -> None:
        for name in ("timeout_keep_alive", "timeout_header_read", "timeout_body_read"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")


class ServerConfig(uvicorn.Config):
    """uvicorn.Config serving HTTP/1.1 through `TimedH11Protocol` with `limits`, without WebSockets."""

    def __init__(self, app: Any, limits: TransportLimits, **kwargs: Any) -> None:
        super().__init__(app, http=TimedH11Protocol, ws="none", timeout_keep_alive=limits.timeout_keep_alive,
                         **kwargs)
        self.limits = limits


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, plus: a connection whose client has not completed a request's headers within
    `timeout_header_read` of connecting (or of the previous response) is closed; so is one that, after its
    response was sent early (401, 413), has not finished sending the unread body within
    `timeout_body_read`. Upgrade offers are ignored: the request is served over HTTP/1.1, silently."""

    def __init__(self, config: uvicorn.Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        limits = config.limits if isinstance(config, ServerConfig) else TransportLimits()
        self._limits = limits
        self._read_timer: asyncio.TimerHandle | None = None

    # Typed as uvicorn types it (asyncio.Transport); asyncio's stub has BaseTransport, hence uvicorn's own ignore too
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_read_timer(self._limits.timeout_header_read)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_read_timer()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        # Armed before uvicorn starts the next cycle, which may parse pipelined headers at once.
        unread_body = self.conn.their_state is h11.SEND_BODY
        self._arm_read_timer(self._limits.timeout_body_read if unread_body else self._limits.timeout_header_read)
        super().on_response_complete()

    def _should_upgrade(self) -> bool:
        """Never: no WebSockets here, and an h2c offer is declined by answering over HTTP/1.1."""
        return False

    def _arm_read_timer(self, delay: float) -> None:
        self._cancel_read_timer()
        self._read_timer = self.loop.call_later(delay, self._on_read_timeout)

    def _cancel_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _on_read_timeout(self) -> None:
        """Close unless the client has since completed a request's headers that are still being answered
        (that request's body is the middleware's to time; its response re-arms the timer)."""
        self._read_timer = None
        serving = self.cycle is not None and not self.cycle.response_complete
        if serving or self.transport.is_closing():
            return
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY):
            self.logger.debug("closing a connection that sent no complete request in time")
            self.transport.close()
