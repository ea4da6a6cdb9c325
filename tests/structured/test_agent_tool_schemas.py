"""Every tool schema Claude Code 2.1.197 and Codex CLI 0.171.0 send (tests/fixtures/agents/) is accepted in every
tool_choice mode, on every grammar backend: auto and none compile nothing (the schemas only shape the prompt), a
forced call (required, or each tool named) compiles, leaving out only the keywords the backend lacks (Claude Code's
zod records carry `propertyNames`). Before issue 55, the first request of each was a 400. Through the Messages and
Responses translations (kvserve.server.messages / responses.chat_tools), as the server runs them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from structured_support import TINY_LOGITS_WIDTH

from kvserve.server import messages, responses
from kvserve.server.context import ServerSettings
from kvserve.server.protocol import ChatCompletionRequest
from kvserve.server.tools import compile_tools, plan_tools
from kvserve.structured.compiler import GrammarCompiler

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "agents"
SETTINGS = ServerSettings(served_model_names=("m",), enable_auto_tool_choice=True, tool_call_parser="hermes")


def _chat_tools(client: str) -> list[dict[str, Any]]:
    fixture = json.loads((FIXTURES / f"{client}.json").read_text())
    tools = fixture["turns"][0]["tools"]
    translated = (
        messages.chat_tools(tools) if client == "claude-code" else responses.chat_tools(tools, ignore_unsupported=True)
    )
    assert translated.tools
    return translated.tools


@pytest.fixture(scope="module", params=["auto", "xgrammar", "guidance"])
def grammar(request: pytest.FixtureRequest, tiny_tokenizer) -> Iterator[GrammarCompiler]:
    compiler = GrammarCompiler(tiny_tokenizer, TINY_LOGITS_WIDTH, [tiny_tokenizer.eos_token_id], request.param)
    yield compiler
    compiler.close()


@pytest.mark.parametrize("client", ["claude-code", "codex"])
def test_every_schema_in_every_mode(grammar: GrammarCompiler, client: str) -> None:
    tools = _chat_tools(client)
    names = [t["function"]["name"] for t in tools]
    choices: list[Any] = ["auto", "none", "required"] + [{"type": "function", "function": {"name": n}} for n in names]
    ignored: dict[str, tuple[str, ...]] = {}
    for choice in choices:
        request = ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": choice}
        )
        forced = compile_tools(grammar, plan_tools(request, SETTINGS))
        assert (forced is None) == (choice in ("auto", "none"))
        if forced is not None and forced.ignored:
            ignored[choice if isinstance(choice, str) else choice["function"]["name"]] = forced.ignored
    # Claude Code's two zod records (TaskCreate's and TaskUpdate's metadata) carry the one keyword no backend has;
    # Codex's schemas compile as sent
    expected = {"required": ("propertyNames",), "TaskCreate": ("propertyNames",), "TaskUpdate": ("propertyNames",)}
    assert ignored == (expected if client == "claude-code" else {})
