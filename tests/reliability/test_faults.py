"""Engine faults under load: a step that raises outside any request ends every in-flight request (500, or an
error frame then [DONE] for streams), /health turns 503 and new requests are refused; every wait here is
bounded. (A fault inside one request fails that request alone: tests/server/test_engine_fault_isolation.py.)"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
from reliability_support import assert_openai_error
from server_support import HookedCore

CONCURRENCY = 16
DEADLINE_S = 30.0


class FaultOnceAllArrived(HookedCore):
    """A core that runs no step until all CONCURRENCY requests are in it, then raises outside any request: the fault
    is driven by that event, not by a step count, so every request (streamed or not) is in flight when it fires.
    (Counting steps let the first requests finish or start alone, so a run saw no 500 about one time in three.)"""

    def step(self) -> Any:
        if len(self._inner.requests.groups) < CONCURRENCY:
            time.sleep(0.001)  # the engine thread takes the inbox between calls: the rest arrive meanwhile
            return []
        raise RuntimeError("injected fault")


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
    server = make_server(core=FaultOnceAllArrived)

    async def run() -> list[str]:
        limits = httpx.Limits(max_connections=CONCURRENCY + 2)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=DEADLINE_S, limits=limits) as client:
            return await asyncio.wait_for(asyncio.gather(*(_one(client, i) for i in range(CONCURRENCY))), DEADLINE_S)

    endings = asyncio.run(run())
    assert sorted(endings) == ["500"] * (CONCURRENCY // 2) + ["error-frame"] * (CONCURRENCY // 2), endings
    with server.client(timeout=5) as c:
        health = c.get("/health")
        assert health.status_code == 503 and "injected fault" in health.json()["error"]["message"]
        for path, body in [
            ("/v1/completions", {"prompt": "x"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
            ("/v1/completions", {"prompt": "x", "stream": True}),
        ]:
            assert assert_openai_error(c.post(path, json=body), 503)["code"] == "engine_dead"
