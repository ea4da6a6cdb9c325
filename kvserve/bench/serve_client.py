"""A streaming OpenAI-API client and load generator (/v1/completions), for kvserve or any compatible
server (llama.cpp's llama-server, vLLM), so that every server is measured by the same client."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx


@dataclass(frozen=True, slots=True)
class Endpoint:
    base_url: str  # http://host:port, with or without a trailing /v1
    model: str | None = None  # None: the `model` field is left out (kvserve accepts that)
    api_key: str | None = None

    def url(self, path: str) -> str:
        base = self.base_url.rstrip("/")
        return (base if base.endswith("/v1") else base + "/v1") + path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it; a failure keeps its reason and the time it took to fail."""

    ok: bool
    output_tokens: int = 0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    error: str | None = None
    prompt_tokens: int | None = None  # from the server's usage report, when it sends one
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens: prompt tokens served from cache


@dataclass(frozen=True, slots=True)
class LoadRun:
    results: list[RequestResult]
    duration_s: float
    model: str | None  # the model id sent (discovered from /v1/models when not given)

    @property
    def completed(self) -> list[RequestResult]:
        return [r for r in self.results if r.ok]

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.completed)


async def discover_model(client: httpx.AsyncClient, endpoint: Endpoint) -> str | None:
    """The first model id from GET /v1/models, or None when the server does not say."""
    try:
        resp = await client.get(endpoint.url("/models"), headers=endpoint.headers)
        resp.raise_for_status()
        data = resp.json().get("data") or []
        return str(data[0]["id"]) if data else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        return None


async def stream_completion(
    client: httpx.AsyncClient, endpoint: Endpoint, prompt: str | list[int], max_tokens: int, ignore_eos: bool
) -> RequestResult:
    """POST a streaming completion (a text prompt, or token ids so that prompts share exact token prefixes);
    a chunk with text marks token arrival (TTFT, then inter-token gaps). The token count is the server's usage
    report when it sends one, else the number of text chunks; the report's prompt and cached token counts
    are kept as they come."""
    body: dict = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0.0,
        "ignore_eos": ignore_eos,
        "stream_options": {"include_usage": True},
    }
    if endpoint.model is not None:
        body["model"] = endpoint.model
    start = time.perf_counter()
    arrivals: list[float] = []
    usage: dict = {}
    done = False

    def failed(reason: str) -> RequestResult:
        return RequestResult(False, e2e_s=time.perf_counter() - start, error=reason)

    try:
        async with client.stream("POST", endpoint.url("/completions"), json=body, headers=endpoint.headers) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:200]
                return failed(f"HTTP {resp.status_code}: {detail}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    return failed(f"error event: {str(event['error'])[:200]}")
                if any(choice.get("text") for choice in event.get("choices") or []):
                    arrivals.append(time.perf_counter())
                usage = event.get("usage") or usage
    except (httpx.HTTPError, ValueError) as e:
        return failed(f"{type(e).__name__}: {e}")
    if not done:
        return failed("the stream closed before data: [DONE]")
    end = time.perf_counter()
    completion_tokens = usage.get("completion_tokens")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return RequestResult(
        ok=True,
        output_tokens=int(completion_tokens) if completion_tokens is not None else len(arrivals),
        ttft_s=arrivals[0] - start if arrivals else None,
        itl_s=[b - a for a, b in itertools.pairwise(arrivals)],
        e2e_s=end - start,
        prompt_tokens=int(usage["prompt_tokens"]) if usage.get("prompt_tokens") is not None else None,
        cached_tokens=int(cached) if cached is not None else None,
    )


async def run_load(
    endpoint: Endpoint,
    prompts: Sequence[str | list[int]],
    max_tokens: int,
    ignore_eos: bool,
    max_concurrency: int | None,
    request_rate: float,
    seed: int,
    timeout_s: float,
    warmup: int = 0,
    on_result: Callable[[RequestResult], None] | None = None,
) -> LoadRun:
    """Send every prompt, arrivals Poisson at `request_rate` (inf: all at once), at most `max_concurrency`
    in flight; the first `warmup` prompts go first, one by one and unmeasured, so that connection set-up
    and the server's first-request costs stay outside the figures. `on_result` sees each measured request
    as it ends (a progress bar)."""
    limit = max_concurrency or max(len(prompts) - warmup, 1)
    gate = asyncio.Semaphore(limit)
    limits = httpx.Limits(max_connections=limit + 1, max_keepalive_connections=limit + 1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        if endpoint.model is None:
            endpoint = Endpoint(endpoint.base_url, await discover_model(client, endpoint), endpoint.api_key)
        for prompt in prompts[:warmup]:
            await stream_completion(client, endpoint, prompt, min(max_tokens, 4), ignore_eos)

        async def one(prompt: str | list[int]) -> RequestResult:
            async with gate:
                result = await stream_completion(client, endpoint, prompt, max_tokens, ignore_eos)
            if on_result is not None:
                on_result(result)
            return result

        rng = random.Random(seed)
        start = time.perf_counter()
        tasks = []
        measured = prompts[warmup:]
        for i, prompt in enumerate(measured):
            tasks.append(asyncio.create_task(one(prompt)))
            if request_rate != float("inf") and i + 1 < len(measured):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = list(await asyncio.gather(*tasks))
        return LoadRun(results, time.perf_counter() - start, endpoint.model)
