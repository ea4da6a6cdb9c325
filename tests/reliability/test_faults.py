"""Engine faults under load: a step that raises outside any request ends every in-flight request (500, or an
error frame then [DONE] for streams), /health turns 503 and new requests are refused; every wait here is
bounded. (A fault inside one request fails that request alone: tests/server/test_engine_fault_isolation.py.)"""

from __future__ import annotations

import asyncio
import itertools
import json

import httpx
from reliability_support import assert_openai_error

CONCURRENCY = 16
FAIL_AT_STEP = 6
DEADLINE_S = 30.0


def fail_after(steps: int):
    """A before_step hook that raises on step `steps` and every step after it."""
    counter = itertools.count(1)

    def hook() -> None:
        if next(counter) >= steps:
            raise RuntimeError("injected fault")

    return hook


async def _one(client: httpx.AsyncClient, i: int) -> str:
    """How request i ended: "500", "503", "error-frame" (or anything else, which the test rejects)."""
    stream = i % 2 == 0
    body = {"prompt": f"request {i}", "max_tokens": 100, "ignore_eos": True, "stream": stream}
    if not stream:
        r = await client.post("/v1/completions", json=body)
        code = assert_openai_error(r)["code"] if r.status_code < 500 else r.json()["error"]["code"]
        return {500: "500", 503: "503"}.get(r.status_code, f"{r.status_code} {code}")
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return "503" if r.status_code == 503 else str(r.status_code)
        frames = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
    if frames[-1] == "[DONE]" and "error" in json.loads(frames[-2]):
        return "error-frame"
    return f"stream ended without an error frame: {frames[-2:]}"


def test_fault_under_load_ends_every_request_and_marks_the_server_dead(make_server):
    server = make_server(before_step=fail_after(FAIL_AT_STEP))

    async def run() -> list[str]:
        limits = httpx.Limits(max_connections=CONCURRENCY + 2)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=DEADLINE_S, limits=limits) as client:
            return await asyncio.wait_for(asyncio.gather(*(_one(client, i) for i in range(CONCURRENCY))), DEADLINE_S)

    endings = asyncio.run(run())
    assert set(endings) <= {"500", "503", "error-frame"}, endings
    assert "500" in endings and "error-frame" in endings
    with server.client(timeout=5) as c:
        health = c.get("/health")
        assert health.status_code == 503 and "injected fault" in health.json()["error"]["message"]
        for path, body in [
            ("/v1/completions", {"prompt": "x"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
            ("/v1/completions", {"prompt": "x", "stream": True}),
        ]:
            assert assert_openai_error(c.post(path, json=body), 503)["code"] == "engine_dead"
