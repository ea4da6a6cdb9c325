"""Streams stay alive while a prompt is computed (issue 55): from the moment a request is accepted, a stream that has
sent nothing for --stream-keepalive-interval seconds sends a keepalive (an SSE comment on chat, completions and
Responses, Anthropic's `ping` event on /v1/messages), so that no client's or proxy's idle timeout drops a reply whose
prompt takes minutes. The engine is held at its first step by a gate (the slow prefill, without wall-clock), the
interval is 20 ms; the test counts keepalives before the first token, then opens the gate and checks the reply is
whole and parses with the SDKs, and that a client leaving during the wait aborts its request."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest
from server_support import MODEL, RunningServer, hook_steps, make_engine, metric_values, wait_until

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.server.app import build_app
from kvserve.server.context import ServerSettings

INTERVAL_S = 0.02
HI = [{"role": "user", "content": "hello"}]


class Gate:
    """Holds the engine's steps until opened (the prefill that takes minutes on a real CPU)."""

    def __init__(self) -> None:
        self.opened = threading.Event()

    def __call__(self) -> None:
        assert self.opened.wait(timeout=30), "the test never opened the gate"


@pytest.fixture
def gated(tiny_model_dir: Path) -> Iterator[tuple[RunningServer, Gate]]:
    gate = Gate()
    engine = hook_steps(make_engine(tiny_model_dir), gate)
    async_engine = AsyncLLMEngine(engine)
    settings = ServerSettings(served_model_names=(MODEL,), stream_keepalive_s=INTERVAL_S)
    server = RunningServer(build_app(async_engine, settings), async_engine).start()
    yield server, gate
    gate.opened.set()
    server.stop()
    engine.check_invariants()


def _read_until(lines: Iterator[str], keepalive: str, count: int) -> list[str]:
    """Lines of a stream until `count` keepalive lines have come (each keepalive frame ends with a blank line)."""
    seen: list[str] = []
    while sum(line == keepalive for line in seen) < count:
        seen.append(next(lines))
    return seen


CASES = {
    "chat": ("/v1/chat/completions", {"messages": HI, "max_tokens": 4}, ": keepalive"),
    "completions": ("/v1/completions", {"prompt": "hello", "max_tokens": 4}, ": keepalive"),
    "responses": ("/v1/responses", {"input": "hello", "max_output_tokens": 4}, ": keepalive"),
    "messages": ("/v1/messages", {"messages": HI, "max_tokens": 4}, "event: ping"),
}


@pytest.mark.parametrize("api", list(CASES))
def test_keepalives_until_the_first_token_then_the_whole_reply(gated, api):
    server, gate = gated
    path, body, keepalive = CASES[api]
    with server.client() as http, http.stream("POST", path, json={"model": MODEL, "stream": True, **body}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        before = _read_until(lines, keepalive, 3)
        # nothing of the reply has come yet: Responses has said it was created, the others nothing but keepalives
        data = [json.loads(line[6:]) for line in before if line.startswith("data: ")]
        kinds = {d.get("type") for d in data}
        assert kinds <= ({"response.created", "response.in_progress"} if api == "responses" else {"ping"}), before
        gate.opened.set()
        rest = list(lines)
    text = "\n".join(rest)
    if api == "messages":
        assert "event: message_stop" in text
    elif api == "responses":
        assert "event: response.completed" in text
    else:
        assert rest[-2:] == ["data: [DONE]", ""] or rest[-1] == "data: [DONE]", rest[-3:]


def test_the_sdks_read_through_the_keepalives(gated):
    """The openai and anthropic SDKs parse a stream with keepalives in it (comments, and pings before
    message_start) as one without."""
    server, gate = gated
    threading.Timer(0.2, gate.opened.set).start()  # a few keepalives first, whatever the SDKs read
    chat = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    chunks = list(chat.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    with claude.messages.stream(model=MODEL, max_tokens=4, messages=HI) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 4


def test_a_client_that_leaves_during_the_wait_aborts_its_request(gated):
    server, gate = gated
    body = {"model": MODEL, "messages": HI, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with server.client() as http, http.stream("POST", "/v1/chat/completions", json=body) as r:
        _read_until(r.iter_lines(), ": keepalive", 2)
    gate.opened.set()  # the engine steps again, and finds the request aborted

    def drained() -> bool:
        m = metric_values(http)
        return m["kvserve:num_requests_running"] == 0 and m["kvserve:num_requests_waiting"] == 0

    with server.client() as http:
        wait_until(drained, timeout=10)
        assert metric_values(http)["kvserve:generation_tokens_total"] < 200  # aborted, not run to its end


def test_zero_turns_keepalives_off(tiny_model_dir: Path):
    engine = make_engine(tiny_model_dir)
    async_engine = AsyncLLMEngine(engine)
    settings = ServerSettings(served_model_names=(MODEL,), stream_keepalive_s=0)
    server = RunningServer(build_app(async_engine, settings), async_engine).start()
    try:
        with server.client() as http:
            r = http.post(
                "/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 2, "stream": True}
            )
        assert ": keepalive" not in r.text and r.text.endswith("data: [DONE]\n\n")
    finally:
        server.stop()
    with pytest.raises(ValueError, match="keepalive"):
        ServerSettings(served_model_names=(MODEL,), stream_keepalive_s=-1)
