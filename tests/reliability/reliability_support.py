"""Checks shared by the reliability tests: OpenAI (and, under /v1/messages, Anthropic) error bodies, a drained and
whole engine, process RSS.

Why a uniquely named module (not conftest): several test folders have a conftest.py, and `from conftest
import` would pick whichever was imported first.
"""

from __future__ import annotations

import ctypes
import gc
import os
from typing import Any
from urllib.parse import urlsplit

import httpx
from server_support import RunningServer, metric_values, wait_until

DRAIN_TIMEOUT_S = 30.0


def assert_openai_error(response: httpx.Response, status: int | None = None) -> dict[str, Any]:
    """A 4xx (or exactly `status`) whose body is `{"error": {"message", "type", "param", "code"}}`."""
    if status is None:
        assert 400 <= response.status_code < 500, (response.status_code, response.text[:500])
    else:
        assert response.status_code == status, (response.status_code, response.text[:500])
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    return error


def assert_api_error(response: httpx.Response, status: int | None = None) -> dict[str, Any]:
    """assert_openai_error, except under /v1/messages (Anthropic's Messages API), whose errors have Anthropic's shape
    `{"type": "error", "error": {"type", "message"}}`; the error object either way."""
    if not urlsplit(str(response.request.url)).path.startswith("/v1/messages"):  # httpx's URL, or schemathesis' str
        return assert_openai_error(response, status)
    if status is None:
        assert 400 <= response.status_code < 500, (response.status_code, response.text[:500])
    else:
        assert response.status_code == status, (response.status_code, response.text[:500])
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def wait_drained(server: RunningServer, timeout: float = DRAIN_TIMEOUT_S) -> dict[str, float]:
    """Wait until /metrics shows nothing running, nothing waiting and no KV block in use; the metrics."""
    with server.client() as c:

        def drained() -> bool:
            m = metric_values(c)
            return (
                m["kvserve:kv_cache_usage_perc"] == 0
                and m["kvserve:num_requests_running"] == 0
                and m["kvserve:num_requests_waiting"] == 0
            )

        wait_until(drained, timeout=timeout, interval=0.05)
        return metric_values(c)


def leaked_blocks(server: RunningServer) -> int:
    """Blocks not back in the free queue once every request is gone (0 when nothing leaked); raises if the
    pool invariant (free + referenced == usable blocks, ref counts == holders) is broken."""

    def check(engine: Any) -> int:
        engine.check_invariants()
        assert not engine.has_unfinished_requests(), "the engine still holds requests"
        return engine.pool.num_usable_blocks - engine.pool.num_free_blocks

    return int(server.engine.call(check).result(timeout=10))


def assert_serving(server: RunningServer, headers: dict[str, str] | None = None) -> None:
    """The server still answers a normal request after whatever came before."""
    with server.client(headers=headers or {}) as c:
        r = c.post("/v1/completions", json={"prompt": "still alive?", "max_tokens": 2})
        assert r.status_code == 200, r.text


def rss_bytes() -> int:
    """This process's resident set size after a full collection and glibc's malloc_trim, from /proc; 0 where there
    is none. Why trim: freed memory that malloc keeps in its arenas (high-water marks of the largest batch seen,
    fragmentation) moved the default model's RSS by tens of MiB up and down between otherwise equal samples;
    returned to the system first, what is left is what is live, which is what a leak grows."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: sample as it is
        pass
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0
