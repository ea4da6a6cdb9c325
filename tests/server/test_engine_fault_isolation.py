"""One request's fault ends that request only (issue 14): its stream gets EngineFaultError (a 500, or an error
frame then [DONE]), while the other requests complete, the loop keeps serving and /health stays 200."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
from server_support import MODEL, RunningServer, make_engine

from kvserve.engine.async_engine import AsyncLLMEngine, EngineFaultError
from kvserve.engine.core import EngineCore
from kvserve.engine.engine import LLMEngine
from kvserve.sampling_params import SamplingParams
from kvserve.server.app import build_app
from kvserve.server.context import ServerSettings

POISON = 200  # token id whose presence in a batch makes the injected model fail
TIMEOUT_S = 30.0


class PoisonedModel:
    """The real model, except that a forward pass whose batch holds POISON raises."""

    def __init__(self, inner: torch.nn.Module) -> None:
        self.inner = inner

    def __call__(self, input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if bool((input_ids == POISON).any()):
            raise RuntimeError("injected fault: poison token in the batch")
        return self.inner(input_ids, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def poisoned_engine(tiny_model_dir) -> LLMEngine:
    engine = make_engine(tiny_model_dir)
    engine.core.runner.model = PoisonedModel(engine.core.runner.model)
    return engine


def whole(core: EngineCore) -> bool:
    """On the engine thread (async_engine.call): every block back, no request left."""
    core.check_invariants()
    return core.pool.num_free_blocks == core.pool.num_usable_blocks and not core.has_unfinished_requests()


def test_async_engine_fails_the_faulty_stream_only(tiny_model_dir):
    async_engine = AsyncLLMEngine(poisoned_engine(tiny_model_dir))
    async_engine.start()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def one(rid: str, prompt: list[int]) -> object:
        try:
            return [o async for o in async_engine.generate(rid, prompt, params)][-1]
        except EngineFaultError as e:
            return e

    async def go() -> list[object]:
        return await asyncio.gather(
            one("a", [2, 10, 11, 12]), one("bad", [2, 10, POISON, 12]), one("c", [2, 20, 21, 22, 23])
        )

    try:
        a, bad, c = asyncio.run(asyncio.wait_for(go(), TIMEOUT_S))
        assert isinstance(bad, EngineFaultError) and "injected fault" in str(bad)
        assert a.finished and c.finished and len(a.outputs[0].token_ids) == len(c.outputs[0].token_ids) == 8
        assert async_engine.is_running and async_engine.error is None
        assert async_engine.call(whole).result(timeout=TIMEOUT_S)
    finally:
        async_engine.shutdown()


@pytest.fixture
def poisoned_server(tiny_model_dir) -> Iterator[RunningServer]:
    async_engine = AsyncLLMEngine(poisoned_engine(tiny_model_dir))
    server = RunningServer(build_app(async_engine, ServerSettings(served_model_names=(MODEL,))), async_engine).start()
    yield server
    server.stop()


async def _ending(client: httpx.AsyncClient, prompt: list[int], stream: bool) -> str:
    """How one completion ended: "ok", "500 engine_fault", "error-frame", or what went wrong."""
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": stream}
    if not stream:
        r = await client.post("/v1/completions", json=body)
        return "ok" if r.status_code == 200 else f"{r.status_code} {r.json()['error']['code']}"
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return str(r.status_code)
        frames = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
    if frames[-1] != "[DONE]":
        return f"no [DONE]: {frames[-2:]}"
    return "error-frame" if "error" in json.loads(frames[-2]) else "ok"


def test_server_answers_500_or_an_error_frame_for_the_faulty_request_and_serves_the_rest(poisoned_server):
    async def go() -> list[str]:
        async with httpx.AsyncClient(base_url=poisoned_server.base_url, timeout=TIMEOUT_S) as client:
            jobs = [_ending(client, [2, 30 + i, 31 + i, 32], stream=i % 2 == 0) for i in range(6)]
            jobs += [_ending(client, [2, 40, POISON], stream=False), _ending(client, [2, 41, POISON], stream=True)]
            return await asyncio.wait_for(asyncio.gather(*jobs), TIMEOUT_S)

    endings = asyncio.run(go())
    assert endings == ["ok"] * 6 + ["500 engine_fault", "error-frame"], endings
    with poisoned_server.client(timeout=10) as c:
        assert c.get("/health").status_code == 200
        assert c.post("/v1/completions", json={"prompt": [2, 5, 6], "max_tokens": 2}).status_code == 200
    assert poisoned_server.engine.call(whole).result(timeout=TIMEOUT_S)
