"""Graceful shutdown under load: `kvserve serve` gets SIGTERM while a dozen streams are in flight (some
still waiting for admission); every one of them finishes in full within the grace period, and the process
exits 0."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import httpx
from server_support import serve_process

STREAMS = 12
MAX_TOKENS = 120
GRACE_S = 60
DEADLINE_S = 90.0


async def _stream(client: httpx.AsyncClient, i: int, started: asyncio.Event, count: list[int]) -> list[str]:
    body = {"prompt": f"stream {i}", "stream": True, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    frames: list[str] = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                frames.append(line[6:])
                if len(frames) == 1:
                    count[0] += 1
                    if count[0] >= STREAMS // 2:
                        started.set()
    return frames


def test_sigterm_under_load_finishes_running_requests_and_exits_0(tiny_model_dir: Path, tmp_path: Path):
    proc, base = serve_process(
        tiny_model_dir,
        tmp_path,
        "--uvicorn-log-level",
        "warning",
        "--max-num-seqs",
        "4",
        "--shutdown-grace-seconds",
        str(GRACE_S),
    )
    try:

        async def load() -> list[list[str]]:
            started, count = asyncio.Event(), [0]
            limits = httpx.Limits(max_connections=STREAMS + 2)
            async with httpx.AsyncClient(base_url=base, timeout=DEADLINE_S, limits=limits) as client:
                tasks = [asyncio.create_task(_stream(client, i, started, count)) for i in range(STREAMS)]
                await asyncio.wait_for(started.wait(), DEADLINE_S)
                proc.send_signal(signal.SIGTERM)  # half are streaming, the rest still wait for a slot
                return await asyncio.wait_for(asyncio.gather(*tasks), DEADLINE_S)

        results = asyncio.run(load())
        for frames in results:
            assert frames[-1] == "[DONE]", frames[-3:]
            last = json.loads(frames[-2])
            assert last["choices"][0]["finish_reason"] == "length", last
        assert proc.wait(timeout=DEADLINE_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
