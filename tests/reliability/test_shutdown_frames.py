"""Shutdown with requests that outlast the grace period: when it runs out, each open stream gets an
OpenAI-shaped error frame (code `server_shutting_down`) followed by `data: [DONE]`, a non-streamed request a
503, before the connections close; the blocks are freed and the log holds no CancelledError traceback."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from server_support import serve_process, wait_until

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
DEADLINE_S = 60.0


def _frames(lines: list[str]) -> list[str]:
    return [line[len("data: ") :] for line in lines if line.startswith("data: ")]


def _assert_ends_with_shutdown_error(frames: list[str]) -> None:
    assert frames and frames[-1] == "[DONE]", frames[-3:]
    error = json.loads(frames[-2])["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == "server_shutting_down" and error["type"] == "service_unavailable_error", error


def _stream_lines(
    client: httpx.Client, path: str, body: dict[str, Any], lines: list[str], first: threading.Event
) -> None:
    try:
        with client.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                lines.append(line)
                if line.startswith("data: "):
                    first.set()
    except httpx.HTTPError as e:  # the connection was cut: the failure this test guards against
        lines.append(f"error: {type(e).__name__}")
    finally:
        first.set()


def test_grace_period_end_sends_error_frames_and_503s(make_server):
    server = make_server(before_step=lambda: time.sleep(0.01), grace_s=0.3)  # 200 tokens take >= 2 s
    body = {"prompt": "ab", "max_tokens": 200, "ignore_eos": True}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "ignore_eos": True}
    streams: list[tuple[threading.Thread, list[str]]] = []
    plain: dict[str, httpx.Response] = {}
    first = threading.Event()
    with server.client() as a, server.client() as b, server.client() as c:
        for client, path, request in ((a, CMPL, body), (b, CHAT, chat)):
            lines: list[str] = []
            thread = threading.Thread(
                target=_stream_lines, args=(client, path, {**request, "stream": True}, lines, first)
            )
            thread.start()
            streams.append((thread, lines))
        waiter = threading.Thread(target=lambda: plain.setdefault("r", c.post(CMPL, json=body)))
        waiter.start()
        assert first.wait(DEADLINE_S)
        wait_until(lambda: server.engine.stats().num_running + server.engine.stats().num_waiting >= 3, timeout=10)
        server.stop()
        for thread, _ in streams:
            thread.join(DEADLINE_S)
        waiter.join(DEADLINE_S)
    for _, lines in streams:
        _assert_ends_with_shutdown_error(_frames(lines))
    error = plain["r"].json()["error"]
    assert plain["r"].status_code == 503 and error["code"] == "server_shutting_down", plain["r"].text
    core = server.engine.core
    core.check_invariants()
    assert not core.has_unfinished_requests()
    assert core.pool.num_free_blocks == core.pool.num_usable_blocks


def test_sigterm_with_streams_longer_than_the_grace_period(tiny_model_dir: Path, tmp_path: Path):
    """A real `kvserve serve` with --shutdown-grace-seconds 0 and one sequence at a time: SIGTERM while a
    stream is running and others wait. Every stream ends with [DONE] (the running ones with the error frame),
    the process exits 0, and its log has no traceback."""
    proc, base = serve_process(
        tiny_model_dir, tmp_path, "--uvicorn-log-level", "info", "--max-num-seqs", "1", "--shutdown-grace-seconds", "0"
    )
    try:

        async def one(client: httpx.AsyncClient, i: int, started: asyncio.Event) -> list[str]:
            body = {"prompt": f"stream {i}", "stream": True, "max_tokens": 240, "ignore_eos": True}
            lines: list[str] = []
            try:
                async with client.stream("POST", CMPL, json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        lines.append(line)
                        if line.startswith("data: "):
                            started.set()
            except httpx.HTTPError as e:
                lines.append(f"error: {type(e).__name__}")
            return lines

        async def load() -> list[list[str]]:
            started = asyncio.Event()
            async with httpx.AsyncClient(base_url=base, timeout=DEADLINE_S) as client:
                tasks = [asyncio.create_task(one(client, i, started)) for i in range(4)]
                await asyncio.wait_for(started.wait(), DEADLINE_S)
                proc.send_signal(signal.SIGTERM)
                return await asyncio.wait_for(asyncio.gather(*tasks), DEADLINE_S)

        results = asyncio.run(load())
        assert proc.wait(timeout=DEADLINE_S) == 0
        log = proc.stdout.read() if proc.stdout else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    aborted = 0
    for lines in results:
        frames = _frames(lines)
        assert frames and frames[-1] == "[DONE]", lines[-3:]
        if "error" in json.loads(frames[-2]):
            _assert_ends_with_shutdown_error(frames)
            aborted += 1
        else:
            assert json.loads(frames[-2])["choices"][0]["finish_reason"] == "length"
    assert aborted >= 1  # one at a time, 240 tokens each: not all of them can have finished
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
