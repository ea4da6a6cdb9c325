"""Overload: once --max-num-queued-reqs requests wait, new ones get 503 at once (not after a timeout),
while every admitted request still finishes in full."""

from __future__ import annotations

import asyncio
import time

import httpx
from reliability_support import assert_openai_error, leaked_blocks, wait_drained

MAX_TOKENS = 12
BURST = 24
REFUSAL_BOUND_S = 1.0  # a refusal must not wait for capacity; admitted requests take several seconds


def test_queue_full_is_503_at_once_and_admitted_requests_finish(make_server):
    # two running at a time, four waiting: of a burst of 24, most are refused
    server = make_server(before_step=lambda: time.sleep(0.02), max_queued_requests=4, max_num_seqs=2)

    async def one(client: httpx.AsyncClient, i: int) -> tuple[httpx.Response, float]:
        started = time.monotonic()
        body = {"prompt": f"burst {i}", "max_tokens": MAX_TOKENS, "ignore_eos": True}
        response = await client.post("/v1/completions", json=body)
        return response, time.monotonic() - started

    async def burst() -> list[tuple[httpx.Response, float]]:
        limits = httpx.Limits(max_connections=BURST + 2)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60, limits=limits) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(BURST))), 120)

    results = asyncio.run(burst())
    admitted = [(r, s) for r, s in results if r.status_code == 200]
    refused = [(r, s) for r, s in results if r.status_code != 200]
    assert admitted and refused, [r.status_code for r, _ in results]
    for response, seconds in refused:
        assert assert_openai_error(response, 503)["code"] == "queue_full"
        assert seconds < REFUSAL_BOUND_S, f"a refusal took {seconds:.2f} s"
    for response, _ in admitted:
        body = response.json()
        assert body["usage"]["completion_tokens"] == MAX_TOKENS and body["choices"][0]["finish_reason"] == "length"
    wait_drained(server)
    assert leaked_blocks(server) == 0
    with server.client() as c:  # capacity is back
        assert c.post("/v1/completions", json={"prompt": "after", "max_tokens": 2}).status_code == 200
