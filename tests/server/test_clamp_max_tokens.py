"""--clamp-max-tokens: max_tokens beyond the context left after the prompt generates until the window is full, on chat,
completions and Responses, instead of chat's 400 (vLLM's rule, kept as the default). The Messages API always does it
(tests/structured/test_messages.py). The tiny model's context is 256 tokens, one token a character."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from server_support import MODEL, RunningServer, make_engine

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.server.app import build_app
from kvserve.server.context import ServerSettings

PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


def _body(path: str, prompt: str) -> dict[str, object]:
    """A greedy request for 1000 tokens after `prompt`, in the shape of the API at `path`."""
    body: dict[str, object] = {"model": MODEL, "ignore_eos": True, "temperature": 0}
    if path == "/v1/chat/completions":
        return body | {"messages": [{"role": "user", "content": prompt}], "max_tokens": 1000}
    if path == "/v1/completions":
        return body | {"prompt": prompt, "max_tokens": 1000}
    return body | {"input": prompt, "max_output_tokens": 1000}


def _serve(model_dir: Path, clamp: bool) -> RunningServer:
    async_engine = AsyncLLMEngine(make_engine(model_dir))
    settings = ServerSettings(served_model_names=(MODEL,), clamp_max_tokens=clamp)
    return RunningServer(build_app(async_engine, settings), async_engine).start()


@pytest.fixture(scope="module")
def servers(tiny_model_dir: Path) -> Iterator[dict[bool, RunningServer]]:
    running = {clamp: _serve(tiny_model_dir, clamp) for clamp in (False, True)}
    yield running
    for server in running.values():
        server.stop()


@pytest.mark.parametrize("path", PATHS)
def test_max_tokens_beyond_the_context(servers, path):
    body = _body(path, "x" * 200)
    with servers[False].client() as http:
        refused = http.post(path, json=body)
    assert refused.status_code == 400 and "at most" in refused.json()["error"]["message"]
    with servers[True].client() as http:
        filled = http.post(path, json=body).json()
    max_model_len = servers[True].engine.facts.max_model_len
    usage = filled["usage"]
    if path == "/v1/responses":
        assert filled["status"] == "incomplete"
        assert usage["input_tokens"] + usage["output_tokens"] == max_model_len
    else:
        assert filled["choices"][0]["finish_reason"] == "length"
        assert usage["prompt_tokens"] + usage["completion_tokens"] == max_model_len
    with servers[True].client() as http:  # a prompt that leaves no room is still a 400
        assert http.post(path, json=_body(path, "x" * 300)).status_code == 400
