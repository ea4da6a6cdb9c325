"""Lifecycle over real HTTP: disconnects abort and free blocks, engine faults fail fast and mark the server
unhealthy, shutdown lets running requests finish within the grace period and aborts the rest."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_support import metric_values, serve_process, wait_until


def slow_steps(seconds: float):
    """A before_step hook that makes every step take at least `seconds` (so requests stay in flight)."""
    return lambda: time.sleep(seconds)


def engine_is_clean(server) -> bool:
    def check(e) -> bool:
        e.check_invariants()
        return e.pool.num_free_blocks == e.pool.num_usable_blocks and not e.has_unfinished_requests()

    return server.engine.call(check).result(timeout=10)


def data_frames(lines: list[str]) -> list[str]:
    return [line[len("data: ") :] for line in lines if line.startswith("data: ")]


def test_dropped_streams_are_aborted_and_free_their_blocks(make_server):
    srv = make_server(before_step=slow_steps(0.003))
    kept_tokens, dropped_tokens = 8, 200

    async def one(client: httpx.AsyncClient, i: int) -> int:
        drop = i % 2 == 1
        body = {
            "prompt": f"request {i}",
            "stream": True,
            "ignore_eos": True,
            "max_tokens": dropped_tokens if drop else kept_tokens,
        }
        frames = 0
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    frames += 1
                    if drop and frames == 3:
                        return frames  # leaving the block closes the connection mid-stream
        return frames

    async def run() -> list[int]:
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=30) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(20))), 60)

    frames = asyncio.run(run())
    assert all(f == 3 for f in frames[1::2])

    with srv.client() as c:

        def drained() -> bool:
            m = metric_values(c)
            return (
                m["kvserve:kv_cache_usage_perc"] == 0
                and m["kvserve:num_requests_running"] == 0
                and m["kvserve:num_requests_waiting"] == 0
            )

        wait_until(drained, timeout=10)
        generated = metric_values(c)["kvserve:generation_tokens_total"]
    assert engine_is_clean(srv)
    assert generated < 10 * kept_tokens + 10 * dropped_tokens // 2  # the dropped ones stopped early


def test_non_streaming_disconnect_aborts(make_server):
    srv = make_server(before_step=slow_steps(0.01))  # 200 tokens would take >= 2 s
    with srv.client(timeout=0.3) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 200, "ignore_eos": True})
    with srv.client() as c:
        wait_until(lambda: metric_values(c)["kvserve:num_requests_running"] == 0, timeout=5)
        assert metric_values(c)["kvserve:generation_tokens_total"] < 200  # aborted, not run to its end
    assert engine_is_clean(srv)


def test_engine_fault_in_a_stream_sends_an_error_frame(make_server):
    fail = threading.Event()

    def maybe_fail() -> None:
        time.sleep(0.002)
        if fail.is_set():
            raise RuntimeError("injected fault")

    srv = make_server(before_step=maybe_fail)
    lines = []
    with srv.client() as c:
        body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 200, "ignore_eos": True}
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                lines.append(line)
                if line.startswith("data: "):
                    fail.set()
        frames = data_frames(lines)
        assert frames[-1] == "[DONE]"
        error = json.loads(frames[-2])["error"]
        assert "injected fault" in error["message"] and error["code"] == "engine_fault"
        assert c.get("/health").status_code == 503
        r = c.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"


def test_engine_fault_fails_a_request_with_500_and_health_503(make_server):
    def always_fail() -> None:
        raise RuntimeError("injected fault")

    srv = make_server(before_step=always_fail)
    with srv.client() as c:
        assert c.get("/health").status_code == 200
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
        assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
        health = c.get("/health")
        assert health.status_code == 503 and "injected fault" in health.json()["error"]["message"]
        assert c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}).status_code == 503


def _stream_in_thread(srv, body: dict, first_frame: threading.Event) -> tuple[threading.Thread, list[str]]:
    lines: list[str] = []

    def read() -> None:
        try:
            with srv.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    if line.startswith("data: "):
                        first_frame.set()
        except httpx.HTTPError as e:  # the server cut the stream
            lines.append(f"error: {type(e).__name__}")
        finally:
            first_frame.set()

    thread = threading.Thread(target=read)
    thread.start()
    return thread, lines


def test_shutdown_lets_running_requests_finish(make_server):
    srv = make_server(before_step=slow_steps(0.005), grace_s=10)
    first = threading.Event()
    reader, lines = _stream_in_thread(
        srv, {"prompt": "ab", "stream": True, "max_tokens": 60, "ignore_eos": True}, first
    )
    assert first.wait(10)
    srv.stop()
    reader.join(10)
    frames = data_frames(lines)
    assert frames[-1] == "[DONE]"
    assert json.loads(frames[-2])["choices"][0]["finish_reason"] == "length"
    assert not srv.engine.is_running


def test_shutdown_aborts_requests_after_the_grace_period(make_server):
    srv = make_server(before_step=slow_steps(0.01), grace_s=0.3)  # 200 tokens would take >= 2 s
    first = threading.Event()
    reader, lines = _stream_in_thread(
        srv, {"prompt": "ab", "stream": True, "max_tokens": 200, "ignore_eos": True}, first
    )
    assert first.wait(10)
    srv.stop()
    reader.join(10)
    assert not reader.is_alive()
    frames = data_frames(lines)  # the stream was ended in-band, not cut (tests/reliability/test_shutdown_frames.py)
    assert frames[-1] == "[DONE]" and json.loads(frames[-2])["error"]["code"] == "server_shutting_down"
    assert len(frames) - 2 < 200  # aborted when the grace period ran out, before its 200 tokens
    core = srv.engine.core
    assert not core.has_unfinished_requests() and core.pool.num_free_blocks == core.pool.num_usable_blocks


def test_kvserve_serve_exits_0_on_sigterm_after_finishing_requests(tiny_model_dir: Path, tmp_path: Path):
    proc, base = serve_process(
        tiny_model_dir,
        tmp_path,
        "--uvicorn-log-level",
        "warning",
        "--shutdown-grace-seconds",
        "20",
        env={"KVSERVE_API_KEY": "env-key"},
    )
    try:
        headers = {"Authorization": "Bearer env-key"}  # the key came from $KVSERVE_API_KEY
        assert httpx.get(f"{base}/v1/models", timeout=5).status_code == 401
        assert httpx.get(f"{base}/v1/models", headers=headers, timeout=5).json()["data"][0]["id"] == "tiny"
        body = {"prompt": "ab", "stream": True, "max_tokens": 200, "ignore_eos": True}
        lines = []
        with httpx.stream("POST", f"{base}/v1/completions", json=body, headers=headers, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and not lines:
                    proc.send_signal(signal.SIGTERM)
                lines.append(line)
        frames = data_frames(lines)
        assert frames[-1] == "[DONE]"
        assert json.loads(frames[-2])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
