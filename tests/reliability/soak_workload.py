"""The soak's workload: a seeded stream of mixed OpenAI requests, some of whose clients walk away, and the
check that each one either completed with the right number of tokens or was aborted by its client.

Why every outcome is classified on the client: "nothing lost" means no request ends in any third way
(a 5xx, an error frame, a hang, a truncated or overlong answer), so the test can say precisely which
request broke which rule; the server side (metrics, pool) is checked separately once all are done.
"""

from __future__ import annotations

import asyncio
import json
import random
import string
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

REQUEST_TIMEOUT_S = 120.0  # per request; the soak as a whole is bounded by its caller


@dataclass(frozen=True, slots=True)
class SoakShape:
    """How big and how varied the workload is."""

    num_requests: int
    concurrency: int
    prompt_chars: tuple[int, int]  # inclusive range
    max_tokens: tuple[int, int]
    disconnect_share: float = 0.2
    words: tuple[str, ...] = ()  # draw prompts from these words if given, else from letters
    # Requests after which the process's memory has stopped growing from warm-up alone (allocator pools, the
    # largest batch and sequence lengths seen, lazily built kernels and caches): measured per shape
    # (docs/RELIABILITY.md, "Soak"); RSS growth past it is judged by rss_verdict.
    warmup_requests: int = 0


@dataclass(frozen=True, slots=True)
class RequestSpec:
    index: int
    chat: bool
    stream: bool
    body: dict[str, Any]
    leave_after_frames: int | None  # streaming: leave after this many data frames
    leave_after_s: float | None  # non-streaming: leave after this many seconds

    @property
    def n(self) -> int:
        return int(self.body.get("n", 1))


@dataclass(slots=True)
class Outcome:
    """What one request ended as: "completed", "aborted" (its client left) or "failed" (with why)."""

    spec: RequestSpec
    kind: str
    detail: str = ""


@dataclass(slots=True)
class SoakReport:
    outcomes: list[Outcome] = field(default_factory=list)

    def count(self, kind: str) -> int:
        return sum(o.kind == kind for o in self.outcomes)

    @property
    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.kind == "failed"]

    def sequences(self, kind: str) -> int:
        return sum(o.spec.n for o in self.outcomes if o.kind == kind)


def make_specs(shape: SoakShape, seed: int) -> list[RequestSpec]:
    """The whole workload, decided up front from `seed` (so a failure can be replayed)."""
    rng = random.Random(seed)
    return [_spec(rng, shape, i) for i in range(shape.num_requests)]


def _prompt(rng: random.Random, shape: SoakShape) -> str:
    size = rng.randint(*shape.prompt_chars)
    if shape.words:
        text = ""
        while len(text) < size:
            text += rng.choice(shape.words) + " "
        return text[:size].strip() or shape.words[0]
    return "".join(rng.choice(string.ascii_letters + "  ") for _ in range(size)).strip() or "a"


def _spec(rng: random.Random, shape: SoakShape, index: int) -> RequestSpec:
    chat, stream = rng.random() < 0.4, rng.random() < 0.5
    body: dict[str, Any] = {
        "max_tokens": rng.randint(*shape.max_tokens),
        "n": rng.choices([1, 2, 3], weights=[7, 2, 1])[0],
        "temperature": rng.choice([0.0, 0.7, 1.0]),
        "top_p": rng.choice([1.0, 0.9]),
        "top_k": rng.choice([0, 20]),
        "ignore_eos": rng.random() < 0.7,
    }
    if rng.random() < 0.5:
        body["seed"] = rng.randrange(1 << 31)
    if rng.random() < 0.25:
        body["stop"] = [rng.choice(string.ascii_lowercase) + rng.choice(["", " "])]
    prompt = _prompt(rng, shape)
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    leaves = rng.random() < shape.disconnect_share
    return RequestSpec(
        index,
        chat,
        stream,
        body,
        leave_after_frames=rng.randint(1, 6) if leaves and stream else None,
        leave_after_s=rng.uniform(0.02, 0.6) if leaves and not stream else None,
    )


# ---- running ----------------------------------------------------------------------------------------


async def run_specs(
    base_url: str, specs: list[RequestSpec], concurrency: int, headers: dict[str, str] | None = None
) -> SoakReport:
    """Send every spec (at most `concurrency` at a time) and classify each outcome."""
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(
        base_url=base_url, timeout=REQUEST_TIMEOUT_S, limits=limits, headers=headers or {}
    ) as client:

        async def one(spec: RequestSpec) -> Outcome:
            async with gate:
                try:
                    return await _send(client, spec)
                except Exception as e:  # noqa: BLE001 -- any surprise is a failed request, reported
                    return Outcome(spec, "failed", f"{type(e).__name__}: {e}")

        outcomes = await asyncio.gather(*(one(s) for s in specs))
    return SoakReport(list(outcomes))


async def _send(client: httpx.AsyncClient, spec: RequestSpec) -> Outcome:
    path = "/v1/chat/completions" if spec.chat else "/v1/completions"
    if spec.stream:
        return await _send_stream(client, path, spec)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, read=spec.leave_after_s) if spec.leave_after_s else None
    try:
        response = await client.post(path, json=spec.body, **({"timeout": timeout} if timeout else {}))
    except httpx.ReadTimeout:
        if spec.leave_after_s is None:
            raise
        return Outcome(spec, "aborted")  # the client gave up and closed its connection
    if response.status_code != 200:
        return Outcome(spec, "failed", f"HTTP {response.status_code}: {response.text[:300]}")
    data = response.json()
    choices = {c["index"]: (_choice_text(spec, c), c["finish_reason"]) for c in data["choices"]}
    return _judge(spec, choices, data["usage"]["completion_tokens"])


async def _send_stream(client: httpx.AsyncClient, path: str, spec: RequestSpec) -> Outcome:
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    usage: dict[str, Any] | None = None
    frames = 0
    done = False
    async with client.stream("POST", path, json=spec.body) as response:
        if response.status_code != 200:
            body = (await response.aread()).decode(errors="replace")
            return Outcome(spec, "failed", f"HTTP {response.status_code}: {body[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if spec.leave_after_frames is not None and frames >= spec.leave_after_frames:
                return Outcome(spec, "aborted")  # leaving the block closes the connection mid-stream
            frames += 1
            payload = line[len("data: ") :]
            if payload == "[DONE]":
                done = True
                continue
            chunk = json.loads(payload)
            if "error" in chunk:
                return Outcome(spec, "failed", f"error frame: {chunk['error']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + _choice_text(spec, c, delta=True)
                if c.get("finish_reason") is not None:
                    finish[c["index"]] = c["finish_reason"]
    if not done or usage is None:
        return Outcome(spec, "failed", f"stream ended without [DONE] or usage (frames={frames})")
    return _judge(spec, {i: (t, finish.get(i)) for i, t in texts.items()}, usage["completion_tokens"])


def _choice_text(spec: RequestSpec, choice: dict[str, Any], delta: bool = False) -> str:
    if not spec.chat:
        return choice.get("text") or ""
    return (choice["delta"] if delta else choice["message"]).get("content") or ""


def _judge(spec: RequestSpec, choices: dict[int, tuple[str, str | None]], completion_tokens: int) -> Outcome:
    """Completed correctly: n choices, each finished for a reason its parameters allow, and as many tokens
    as max_tokens unless a stop (EOS or a stop string, never inside the text) came first."""
    body, n, max_tokens = spec.body, spec.n, spec.body["max_tokens"]
    if sorted(choices) != list(range(n)):
        return Outcome(spec, "failed", f"choices {sorted(choices)}, expected {n}")
    reasons = Counter(reason for _, reason in choices.values())
    can_stop = bool(body.get("stop")) or not body["ignore_eos"]
    if set(reasons) - ({"length", "stop"} if can_stop else {"length"}):
        return Outcome(spec, "failed", f"finish reasons {dict(reasons)}")
    low, high = reasons["length"] * max_tokens + reasons["stop"], n * max_tokens
    if reasons["stop"] == 0:
        low = high
    if not low <= completion_tokens <= high:
        return Outcome(spec, "failed", f"{completion_tokens} tokens, expected {low}..{high} ({dict(reasons)})")
    for stop in body.get("stop", []):
        if any(stop in text for text, _ in choices.values()):
            return Outcome(spec, "failed", f"stop string {stop!r} inside the output")
    return Outcome(spec, "completed")


# A per-request leak at least this big fails the soak: a request that kept its prompt's text, its output's
# token list and a few objects would leak about 5-20 KiB; one that kept its logits row, a MiB.
LEAK_BYTES_PER_REQUEST = 32 << 10


@dataclass(frozen=True, slots=True)
class RssVerdict:
    """Memory over a soak, from RSS samples taken with the server drained: the growth during warm-up, the growth
    after it, and the median growth per request over the intervals between samples after it (what a per-request
    leak shows in every interval)."""

    warmup_growth_mib: float
    growth_after_warmup_mib: float
    kib_per_request: float
    samples_after_warmup: int

    @property
    def ok(self) -> bool:
        return self.kib_per_request * 1024 < LEAK_BYTES_PER_REQUEST

    def __str__(self) -> str:
        return (
            f"rss_warmup_mib={self.warmup_growth_mib:.1f} rss_after_warmup_mib={self.growth_after_warmup_mib:.1f} "
            f"rss_kib_per_request={self.kib_per_request:.1f}"
        )


def rss_verdict(samples: list[tuple[int, int]], warmup_requests: int) -> RssVerdict:
    """The verdict on (requests done, RSS bytes) samples, judged from warmup_requests on (at least three samples).

    Why the median of the intervals' growth and not first against last, nor a fitted line: warm-up growth
    flattens (a fixed amount, however long the soak), and the allocator moves a drained process's RSS by tens of
    MiB in single jumps, up or down (the default model: +31 MiB then back, +34 MiB in the last tenth), so any one
    interval can jump; a leak grows in every interval by the same amount per request, so the median interval shows
    it, and isolated jumps in under half of them do not move it."""
    after = [(n, rss) for n, rss in samples if n >= warmup_requests]
    if len(after) < 3:
        raise ValueError(f"{len(after)} RSS samples after {warmup_requests} warm-up requests: the trend needs 3")
    rates = sorted((b - a) / (m - n) for (n, a), (m, b) in zip(after, after[1:]))
    middle = len(rates) // 2
    median = rates[middle] if len(rates) % 2 else (rates[middle - 1] + rates[middle]) / 2
    return RssVerdict(
        (after[0][1] - samples[0][1]) / (1 << 20),
        (after[-1][1] - after[0][1]) / (1 << 20),
        median / 1024,
        len(after),
    )


def summary_line(report: SoakReport, preemptions: int, leaked: int, memory: RssVerdict, seconds: float) -> str:
    """The one line the soak prints (and docs/RELIABILITY.md quotes)."""
    return (
        f"soak: requests={len(report.outcomes)} completed={report.count('completed')} "
        f"aborted={report.count('aborted')} failed={report.count('failed')} preemptions={preemptions} "
        f"leaked_blocks={leaked} {memory} duration_s={seconds:.0f}"
    )
