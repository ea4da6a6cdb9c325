"""uvicorn.Server that ends unfinished requests cleanly when its grace period runs out, and exits normally.

Why the hook at the end of the grace period: uvicorn itself only cancels the tasks that are still running
(a stream is cut mid-body, with no error frame and no [DONE], and a CancelledError traceback in the log),
and only then runs the app's lifespan shutdown. So at `timeout_graceful_shutdown` this server calls
`on_grace_expired` (the async engine's `stop`, which aborts every remaining request with a "server is
shutting down" error that streams send as an error frame and [DONE], and other requests as a 503), and
gives those responses `drain_s` more seconds to go out before uvicorn's own cut.

Why the signal handling: uvicorn re-raises SIGTERM/SIGINT once its graceful shutdown is done, so the process
would end by the signal (status 143, or a KeyboardInterrupt traceback). A server that was asked to stop and
stopped cleanly (running requests finished or, after the grace period, aborted) should exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
from collections.abc import Callable, Iterator

import uvicorn

DRAIN_S = 5  # after the grace period: time for the error frames and 503s to reach their clients


def _announce_shutdown(app: object) -> None:
    """Set the app's `state.shutting_down` event, if it has one: endless streams (the KV inspector's) end at once
    instead of holding the graceful shutdown for its whole grace period."""
    event = getattr(getattr(app, "state", None), "shutting_down", None)
    if isinstance(event, asyncio.Event):
        event.set()


class GracefulServer(uvicorn.Server):
    """SIGTERM/SIGINT start uvicorn's graceful shutdown (a second SIGINT forces it) and are then consumed.
    With `on_grace_expired`, `config.timeout_graceful_shutdown` is the grace period after which it is
    called, and uvicorn cancels what is still running `drain_s` seconds later."""

    def __init__(
        self, config: uvicorn.Config, on_grace_expired: Callable[[], None] | None = None, drain_s: int = DRAIN_S
    ) -> None:
        super().__init__(config)
        self._on_grace_expired = on_grace_expired
        self._grace_s = config.timeout_graceful_shutdown
        if on_grace_expired is not None and self._grace_s is not None:
            config.timeout_graceful_shutdown = self._grace_s + drain_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's graceful shutdown, with `on_grace_expired` armed for the end of the grace period."""
        _announce_shutdown(self.config.app)
        timer = None
        if self._on_grace_expired is not None and self._grace_s is not None:
            timer = asyncio.get_running_loop().call_later(self._grace_s, self._on_grace_expired)
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
