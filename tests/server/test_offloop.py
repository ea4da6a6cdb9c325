"""Prompt preparation runs off the event loop (issue 14), and handlers read the engine's facts, not the engine.

Structural, not timed: a tokenizer whose chat templating (or encoding) blocks on a gate while it prepares a
long prompt. While it is blocked, the event loop must still answer /health and keep an open stream going;
before the fix the template and the tokenizer ran on the loop, so both would hang until the gate opened.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from server_support import API_KEY, MODEL, RunningServer, make_engine

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.engine.facts import EngineFacts
from kvserve.server.app import build_app
from kvserve.server.context import ServerContext, ServerSettings

GATE_TIMEOUT_S = 30.0
LONG = 100_000  # characters in the prompt being prepared
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


class GatedTokenizer:
    """The engine's tokenizer, except that templating or encoding a long text first waits for `release`
    (after setting `entered`), and the threads that encode are recorded."""

    def __init__(self, inner: Any, min_chars: int) -> None:
        self._inner = inner
        self._min_chars = min_chars
        self.entered = threading.Event()
        self.release = threading.Event()
        self.encode_threads: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _gate(self, size: int) -> None:
        if size >= self._min_chars:
            self.entered.set()
            assert self.release.wait(GATE_TIMEOUT_S), "the test never opened the gate"

    def apply_chat_template(self, messages: list[dict], *args: Any, **kwargs: Any) -> str:
        self._gate(sum(len(str(m.get("content") or "")) for m in messages))
        return self._inner.apply_chat_template(messages, *args, **kwargs)

    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]:
        self.encode_threads.add(threading.current_thread().name)
        self._gate(len(text))
        return self._inner.encode(text, *args, **kwargs)

    def snapshot(self) -> Any:
        """The server builds its own tokenizers from the engine's snapshot: gate those copies alike."""
        return _GatedSnapshot(self._inner.snapshot(), self)


class _GatedSnapshot:
    def __init__(self, inner: Any, gated: GatedTokenizer) -> None:
        self._inner, self._gated = inner, gated

    def build(self) -> GatedTokenizer:
        copy = GatedTokenizer(self._inner.build(), self._gated._min_chars)
        copy.entered, copy.release, copy.encode_threads = (
            self._gated.entered,
            self._gated.release,
            self._gated.encode_threads,
        )
        return copy


@pytest.fixture
def gated_server(tiny_model_dir):
    """A server whose tokenizer gates long texts; yields (server, tokenizer); always opens the gate."""
    engine = make_engine(tiny_model_dir)
    tokenizer = GatedTokenizer(engine.tokenizer, min_chars=1_000)
    engine.tokenizer = tokenizer  # type: ignore[assignment]  # a stand-in with the same surface
    async_engine = AsyncLLMEngine(engine)
    running = RunningServer(build_app(async_engine, ServerSettings((MODEL,), api_key=API_KEY)), async_engine).start()
    try:
        yield running, tokenizer
    finally:
        tokenizer.release.set()
        running.stop()


def _frames(lines: Any) -> list[str]:
    return [line[len("data: ") :] for line in lines if line.startswith("data: ")]


LONG_REQUESTS = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * LONG}], "max_tokens": 2}),
    "completion": ("/v1/completions", {"prompt": "b" * 2_000, "max_tokens": 2}),
}


@pytest.mark.parametrize("kind", sorted(LONG_REQUESTS))
def test_loop_answers_while_a_long_prompt_is_prepared(gated_server, kind):
    server, tokenizer = gated_server
    path, body = LONG_REQUESTS[kind]
    stream_body = {
        "model": MODEL,
        "prompt": "ab",
        "max_tokens": 40,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    with server.client(headers=HEADERS, timeout=10.0) as http, ThreadPoolExecutor(1) as pool:
        with http.stream("POST", "/v1/completions", json=stream_body) as open_stream:
            lines = open_stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))  # the stream is open
            long_request = pool.submit(http.post, path, json={"model": MODEL, **body})
            assert tokenizer.entered.wait(GATE_TIMEOUT_S), "the long prompt never reached the tokenizer"
            # The preparation is blocked right now; the loop must still serve everyone else.
            assert http.get("/health").status_code == 200
            rest = _frames(lines)  # the open stream runs to its end meanwhile
            assert not long_request.done()
        tokenizer.release.set()
        response = long_request.result(timeout=GATE_TIMEOUT_S)
    frames = [*_frames([first]), *rest]  # a busy machine may send the whole stream in its first frame
    assert frames[-1] == "[DONE]" and len(frames) >= 2
    assert json.loads(frames[-2])["choices"][0]["finish_reason"] == "length"
    assert response.status_code == 400  # longer than max-model-len: prepared, then refused with both numbers


def test_prompts_are_encoded_on_the_preparation_thread_only(gated_server):
    server, tokenizer = gated_server
    tokenizer.release.set()
    with server.client(headers=HEADERS) as http:
        assert http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 1}).status_code == 200
        assert (
            http.post(
                "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
            ).status_code
            == 200
        )
        assert http.post("/tokenize", json={"prompt": "abc"}).status_code == 200
    assert tokenizer.encode_threads and all(n.startswith("kvserve-prepare") for n in tokenizer.encode_threads)


def test_handlers_hold_the_engine_facts_not_the_engine(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    assert not hasattr(ServerContext, "core") and not hasattr(ServerContext, "tokenizer")
    facts = engine.facts
    assert isinstance(facts, EngineFacts) and facts.max_model_len == engine.core.max_model_len
    assert facts.vocab_size == engine.core.model_config.vocab_size and facts.block_size == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        facts.max_model_len = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        facts.generation_defaults["temperature"] = 0.0  # type: ignore[index]


@pytest.mark.parametrize("prompt", [[2, 10_000], [5] * 300])
def test_server_and_engine_refuse_a_prompt_with_the_same_rule(http, tiny_model_dir, prompt):
    """One validation path: the 400's message is the engine's own ValueError, word for word."""
    from kvserve.sampling_params import SamplingParams

    engine = make_engine(tiny_model_dir)
    with pytest.raises(ValueError) as refused:
        engine.add_request("r", prompt, SamplingParams(max_tokens=1))
    response = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    assert response.status_code == 400
    assert response.json()["error"]["message"].rstrip(".") == str(refused.value).rstrip(".")


class ThreadLog:
    """A tokenizer stand-in that records which threads call it; its snapshot builds recording copies, each with a
    log of its own, so a test can tell every tokenizer object the server made apart from the engine's."""

    def __init__(self, inner: Any, copies: list[ThreadLog]) -> None:
        self._inner, self._copies = inner, copies
        self.threads: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if not callable(value):
            return value

        def recorded(*args: Any, **kwargs: Any) -> Any:
            self.threads.add(threading.current_thread().name)
            return value(*args, **kwargs)

        return recorded

    def snapshot(self) -> Any:
        inner, copies = self._inner.snapshot(), self._copies

        class Snapshot:
            def build(self) -> ThreadLog:
                copies.append(ThreadLog(inner.build(), copies))
                return copies[-1]

        return Snapshot()


def test_the_engine_thread_runs_no_tokenizer_and_no_tokenizer_is_shared(tiny_model_dir):
    """The engine core takes and emits token ids: the engine thread never encodes, decodes or renders text. The
    front end's tokenizer (the engine's, handed over) serves the event loop alone (the streams' detokenizing, stop
    strings, logprob texts); the server builds one copy from its snapshot for the preparation thread (prompts, chat
    templates, /tokenize, /detokenize). Before, the engine thread detokenized every token with a third."""
    engine = make_engine(tiny_model_dir)
    copies: list[ThreadLog] = []
    front_tokenizer = ThreadLog(engine.tokenizer, copies)
    engine.tokenizer = front_tokenizer  # type: ignore[assignment]
    async_engine = AsyncLLMEngine(engine)
    running = RunningServer(build_app(async_engine, ServerSettings((MODEL,))), async_engine).start()
    try:
        with running.client() as http:
            for body in (
                {"prompt": "abc", "max_tokens": 3, "logprobs": 2, "echo": True},
                {"prompt": "abc", "max_tokens": 3, "logprobs": 2, "stream": True},
                {"prompt": "abc", "max_tokens": 8, "n": 2, "temperature": 1.0, "seed": 3, "stop": ["a", "b", "c"]},
                {"prompt": [5, 6, 7], "max_tokens": 5, "stream": True, "stop": ["x"], "ignore_eos": True},
            ):
                assert http.post("/v1/completions", json=body).status_code == 200
            assert (
                http.post(
                    "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "logprobs": True},
                ).status_code
                == 200
            )
            assert http.post("/detokenize", json={"tokens": [5, 6]}).status_code == 200
            assert http.get("/v1/kv/blocks/1").status_code == 200
    finally:
        running.stop()
    assert len(copies) == 1 and copies[0]._inner is not front_tokenizer._inner
    (prepare,) = copies
    assert len(prepare.threads) == 1 and next(iter(prepare.threads)).startswith("kvserve-prepare")
    assert front_tokenizer.threads and not any(t.startswith("kvserve-") for t in front_tokenizer.threads)
    assert len(front_tokenizer.threads) == 1  # the serving loop's thread


def test_a_tokenizer_copy_is_independent_and_identical(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    original = engine.tokenizer
    copy = original.copy()
    assert copy is not original and copy.backend is not original.backend
    text = "Hello, <bos>world! \u00e9\u4e16 12 3"
    for special in (True, False):
        assert copy.encode(text, add_special_tokens=special) == original.encode(text, add_special_tokens=special)
    ids = original.encode(text)
    for skip in (True, False):
        assert copy.decode(ids, skip_special_tokens=skip) == original.decode(ids, skip_special_tokens=skip)
    assert (copy.special_ids, copy.bos_token_id, copy.eos_token_id, copy.add_bos, copy.chat_template, copy.name) == (
        original.special_ids,
        original.bos_token_id,
        original.eos_token_id,
        original.add_bos,
        original.chat_template,
        original.name,
    )
    messages = [{"role": "user", "content": "hi"}]
    assert copy.apply_chat_template(messages) == original.apply_chat_template(messages)
