"""The HTTP/1.1 transport under the app: uvicorn's h11 protocol with a header read timeout, no upgrades,
and the uvicorn configuration that uses it.

Why a protocol subclass: uvicorn bounds how long an idle keep-alive connection stays open
(`timeout_keep_alive`), but not how long a client may take to send a request's headers, so a client that
sends one header byte at a time (slowloris) holds its connection, and its slot, forever. The body's own
read timeout lives in the ASGI middleware (body_limit.py), where a late body can be answered with 408.

Why a lingering close: when the server answers before reading the whole body (401, 413, 408) and ends the
connection, closing the socket at once while the client's body is still arriving makes the kernel reset the
connection (RST), and a reset can destroy the response in flight: the client sees "peer closed connection"
instead of its 413 (httpx did, 1 time in 6 on a loaded machine). So, as nginx and Apache do, the server first
shuts down its sending side (FIN after the response), then reads and discards what the client still sends until
the client closes, goes quiet for `LINGER_IDLE_S`, or `timeout_body_read` has passed; then it closes.

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
LINGER_IDLE_S = 5.0  # nginx's lingering_timeout: a lingering client that sends nothing for this long is cut off


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
        super().__init__(app, http=TimedH11Protocol, ws="none", timeout_keep_alive=limits.timeout_keep_alive, **kwargs)
        self.limits = limits


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, plus: a connection whose client has not completed a request's headers within
    `timeout_header_read` of connecting (or of the previous response) is closed; so is one that, after its
    response was sent early (401, 413), has not finished sending the unread body within
    `timeout_body_read`. A close while the client is still sending a body lingers (see the module's
    docstring). Upgrade offers are ignored: the request is served over HTTP/1.1, silently."""

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        limits = config.limits if isinstance(config, ServerConfig) else TransportLimits()
        self._limits = limits
        self._read_timer: asyncio.TimerHandle | None = None
        self._socket: asyncio.Transport | None = None  # the real transport; self.transport is a _LingeringView
        self._linger_deadline: float | None = None  # set while lingering: when the close happens at the latest
        self._shutting_down = False

    # Typed as uvicorn types it (asyncio.Transport); asyncio's stub has BaseTransport, hence uvicorn's own ignore too
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._socket = transport
        self.transport = _LingeringView(transport, self)  # what uvicorn's request cycles write to and close
        self._arm_read_timer(self._limits.timeout_header_read)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_read_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._linger_deadline is not None:  # the rest of a refused body: discarded unparsed
            self._arm_read_timer(min(LINGER_IDLE_S, self._linger_deadline - self.loop.time()))
            return
        super().data_received(data)

    def shutdown(self) -> None:
        """A server shutdown closes at once: lingering would only delay it."""
        self._shutting_down = True
        if self._linger_deadline is not None and self._socket is not None:
            self._socket.close()
        super().shutdown()

    def on_response_complete(self) -> None:
        # Armed before uvicorn starts the next cycle, which may parse pipelined headers at once.
        if not self.transport.is_closing():
            unread_body = self.conn.their_state is h11.SEND_BODY
            self._arm_read_timer(self._limits.timeout_body_read if unread_body else self._limits.timeout_header_read)
        super().on_response_complete()

    def _should_upgrade(self) -> bool:
        """Never: no WebSockets here, and an h2c offer is declined by answering over HTTP/1.1."""
        return False

    def close_connection(self) -> None:
        """Close, lingering first if the client is still sending a body the server will not read."""
        socket = self._socket
        if socket is None or socket.is_closing() or self._linger_deadline is not None:
            return
        if self.conn.their_state is not h11.SEND_BODY or self._shutting_down or not socket.can_write_eof():
            socket.close()
            return
        self._linger_deadline = self.loop.time() + self._limits.timeout_body_read
        socket.write_eof()  # FIN once the response is flushed; reading goes on
        socket.resume_reading()  # uvicorn's flow control may have paused it under a large body
        self._arm_read_timer(min(LINGER_IDLE_S, self._limits.timeout_body_read))

    @property
    def lingering(self) -> bool:
        return self._linger_deadline is not None

    def _arm_read_timer(self, delay: float) -> None:
        self._cancel_read_timer()
        self._read_timer = self.loop.call_later(max(delay, 0.0), self._on_read_timeout)

    def _cancel_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _on_read_timeout(self) -> None:
        """Close unless the client has since completed a request's headers that are still being answered
        (that request's body is the middleware's to time; its response re-arms the timer). A lingering
        connection closes now, whatever its client still sends."""
        self._read_timer = None
        if self._socket is None or self._socket.is_closing():
            return
        if self._linger_deadline is not None:
            self._socket.close()
            return
        serving = self.cycle is not None and not self.cycle.response_complete
        if serving:
            return
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY):
            self.logger.debug("closing a connection that sent no complete request in time")
            self._socket.close()


class _LingeringView(asyncio.Transport):
    """The connection's transport as uvicorn sees it: everything goes to the socket's transport, except that
    `close()` asks the protocol (which may linger) and a lingering connection already counts as closing, so
    uvicorn writes nothing more to it and starts no keep-alive timer."""

    def __init__(self, socket: asyncio.Transport, protocol: TimedH11Protocol) -> None:
        super().__init__()
        self._socket = socket
        self._protocol = protocol

    def close(self) -> None:
        self._protocol.close_connection()

    def is_closing(self) -> bool:
        return self._protocol.lingering or self._socket.is_closing()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._socket.write(data)

    def writelines(self, list_of_data: Any) -> None:
        self._socket.writelines(list_of_data)

    def write_eof(self) -> None:
        self._socket.write_eof()

    def can_write_eof(self) -> bool:
        return self._socket.can_write_eof()

    def abort(self) -> None:
        self._socket.abort()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._socket.get_extra_info(name, default)

    def is_reading(self) -> bool:
        return self._socket.is_reading()

    def pause_reading(self) -> None:
        self._socket.pause_reading()

    def resume_reading(self) -> None:
        self._socket.resume_reading()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._socket.set_write_buffer_limits(high, low)

    def get_write_buffer_size(self) -> int:
        return self._socket.get_write_buffer_size()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._socket.get_write_buffer_limits()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._socket.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._socket.get_protocol()
