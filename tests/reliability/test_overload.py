"""Overload: once --max-num-queued-reqs requests wait, new ones get 503 at once (not after a timeout),
while every admitted request still finishes in full.

"At once" is shown without a clock: the engine is held at its first step for the whole burst, so no capacity
can free up; every refusal must still arrive while it is held. A refusal that waited for a slot would never
come and the test would fail at its deadline (a bound against a hang, not a latency claim)."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
from reliability_support import assert_openai_error, leaked_blocks, wait_drained

MAX_TOKENS = 12
BURST = 24
MAX_QUEUED = 4
HANG_DEADLINE_S = 120.0


def test_queue_full_is_503_at_once_and_admitted_requests_finish(make_server):
    release = threading.Event()

    def gate() -> None:
        assert release.wait(HANG_DEADLINE_S)

    # two running at a time, four waiting: of a burst of 24, most are refused
    server = make_server(before_step=gate, max_queued_requests=MAX_QUEUED, max_num_seqs=2)

    async def one(client: httpx.AsyncClient, i: int) -> httpx.Response:
        body = {"prompt": f"burst {i}", "max_tokens": MAX_TOKENS, "ignore_eos": True}
        return await client.post("/v1/completions", json=body)

    async def refusals_while_held(tasks: list[asyncio.Task[httpx.Response]]) -> list[httpx.Response]:
        """The finished responses once every request the held engine did not queue has had its answer."""
        deadline = time.monotonic() + HANG_DEADLINE_S
        while True:
            done = [t.result() for t in tasks if t.done()]
            if len(done) == BURST - server.engine.num_queued_seqs:
                return done
            assert time.monotonic() < deadline, f"{len(done)} answered, {server.engine.num_queued_seqs} queued"
            await asyncio.sleep(0.05)

    async def burst() -> tuple[list[httpx.Response], list[httpx.Response]]:
        limits = httpx.Limits(max_connections=BURST + 2)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=HANG_DEADLINE_S, limits=limits) as client:
            tasks = [asyncio.create_task(one(client, i)) for i in range(BURST)]
            try:
                early = await refusals_while_held(tasks)
            finally:
                release.set()
            return early, await asyncio.gather(*tasks)

    early, results = asyncio.run(burst())
    assert early and all(r.status_code == 503 for r in early), [r.status_code for r in early]
    admitted = [r for r in results if r.status_code == 200]
    refused = [r for r in results if r.status_code != 200]
    assert len(admitted) == MAX_QUEUED and len(refused) == BURST - MAX_QUEUED, [r.status_code for r in results]
    for response in refused:
        assert assert_openai_error(response, 503)["code"] == "queue_full"
    for response in admitted:
        body = response.json()
        assert body["usage"]["completion_tokens"] == MAX_TOKENS and body["choices"][0]["finish_reason"] == "length"
    wait_drained(server)
    assert leaked_blocks(server) == 0
    with server.client() as c:  # capacity is back
        assert c.post("/v1/completions", json={"prompt": "after", "max_tokens": 2}).status_code == 200
