"""Preemption loses nothing: with a KV cache so small that concurrent requests must be preempted and
recomputed, greedy outputs equal those of a server whose cache holds them all."""

from __future__ import annotations

import asyncio
import json

import httpx
from reliability_support import leaked_blocks, wait_drained
from server_support import metric_values

PROMPTS = [f"{i}: " + "the quick brown fox jumps over the lazy dog "[: 5 + 3 * i] for i in range(12)]
MAX_TOKENS = 40


def greedy_outputs(server) -> list[list[str]]:
    async def one(client: httpx.AsyncClient, i: int, prompt: str) -> list[str]:
        body = {
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "n": 1 + i % 2,
            "stream": i % 3 == 0,
        }
        if not body["stream"]:
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
        texts = [""] * body["n"]
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        texts[c["index"]] += c["text"]
        return texts

    async def run() -> list[list[str]]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i, p) for i, p in enumerate(PROMPTS))), 120)

    return asyncio.run(run())


def test_greedy_outputs_survive_forced_preemption(make_server):
    roomy = make_server(num_gpu_blocks_override=512, max_model_len=128)
    expected = greedy_outputs(roomy)
    # 32 usable blocks of 4 tokens (+ the null block): one request of max-model-len fits, a dozen do not
    tight = make_server(num_gpu_blocks_override=33, max_model_len=128)
    got = greedy_outputs(tight)
    with tight.client() as c:
        preemptions = metric_values(c)["kvserve:num_preemptions_total"]
    assert preemptions > 0
    assert got == expected
    assert all(len(t) > 0 for texts in got for t in texts)
    wait_drained(tight)
    assert leaked_blocks(tight) == 0
