"""A `kvserve serve` subprocess for the benchmarks that measure whole server configurations (`bench router`):
started on a free port, waited for until /health answers, scraped on /metrics, stopped with SIGTERM.

Why a subprocess rather than the app in the bench's own process: the figures are those of the command a user
runs (its flags, its Ray start-up, its ingress), each configuration starts from fresh processes and a cold
cache, and the load generator's event loop never shares a GIL with the server's.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import httpx

MetricKey = tuple[str, tuple[tuple[str, str], ...]]  # (sample name, sorted labels)
STOP_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(slots=True)
class ServerProcess:
    """One running server; use as a context manager so that it is stopped whatever happens."""

    proc: subprocess.Popen[bytes]
    base_url: str
    log_path: Path
    startup_s: float

    @classmethod
    def start(
        cls, serve_args: Sequence[str], log_path: Path, timeout_s: float, env: dict[str, str] | None = None
    ) -> ServerProcess:
        """`kvserve serve <serve_args> --host 127.0.0.1 --port <free>`, healthy within `timeout_s` (model load and,
        with replicas, Ray's) or a ValueError carrying the end of its log."""
        port = free_port()
        cmd = [sys.executable, "-m", "kvserve.cli", "serve", *serve_args, "--host", "127.0.0.1", "--port", str(port)]
        start = time.perf_counter()
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        server = cls(proc, f"http://127.0.0.1:{port}", log_path, 0.0)
        try:
            server._wait_healthy(timeout_s)
        except BaseException:
            server.stop()
            raise
        server.startup_s = time.perf_counter() - start
        return server

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ValueError(
                    f"the server exited with status {self.proc.returncode} while starting:\n{self.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.base_url + "/health", timeout=2.0).status_code == 200:
                    return
            time.sleep(0.25)
        raise ValueError(f"the server was not healthy within {timeout_s:.0f} s:\n{self.log_tail()}")

    def metrics(self) -> dict[MetricKey, float]:
        """Every sample of /metrics, by name and labels (but model_name, which every series has: one model a
        server)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.base_url + "/metrics", timeout=30.0).text
        return {
            (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): float(s.value)
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """SIGTERM (the server drains and, with replicas, stops them), then SIGKILL if it hangs."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
