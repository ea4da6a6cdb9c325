"""uvicorn.Server that exits normally after a graceful stop.

Why: uvicorn re-raises SIGTERM/SIGINT once its graceful shutdown is done, so the process would end by the
signal (status 143, or a KeyboardInterrupt traceback). A server that was asked to stop and stopped cleanly
(running requests finished or, after the grace period, aborted) should exit 0.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

import uvicorn


class GracefulServer(uvicorn.Server):
    """SIGTERM/SIGINT start uvicorn's graceful shutdown (a second SIGINT forces it) and are then consumed."""

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
