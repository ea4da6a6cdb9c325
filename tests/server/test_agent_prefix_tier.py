"""#55: a coding agent's system prompt and tools (Claude Code's are the same 25k tokens for every conversation a version
starts in one project) survive new conversations and restarts: with a disk tier, a second conversation's first turn
reads them from the KV cache, and so does the first turn after the server restarts (restored from the tier), over
Anthropic's /v1/messages with Claude Code's cache_control marks, on a tiny model."""

from __future__ import annotations

import sys
from pathlib import Path

from server_support import RunningServer, make_engine, metric_values

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "structured"))
from tool_server_support import TOOLS_TEMPLATE, build_tools_model

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.server.app import build_app
from kvserve.server.context import ServerSettings

SYSTEM = [
    {"type": "text", "text": "You are a coding agent."},
    {"type": "text", "text": "Work in small steps; read before you edit. " * 4, "cache_control": {"type": "ephemeral"}},
]
TOOLS = [
    {
        "name": name,
        "description": f"{name} a file of the project",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    }
    for name in ("read", "edit", "grep")
]


def first_turn(server, task: str) -> dict:
    """A conversation's first request, as Claude Code sends it (its newest user block marked)."""
    content = [{"type": "text", "text": task, "cache_control": {"type": "ephemeral"}}]
    body = {"model": "tiny-tools", "system": SYSTEM, "tools": TOOLS, "max_tokens": 2}
    body["messages"] = [{"role": "user", "content": content}]
    with server.client() as c:
        r = c.post("/v1/messages", json=body)
        assert r.status_code == 200, r.text
        return r.json()["usage"]


def start(model: Path, tier: Path) -> RunningServer:
    """A server on the tiny tools model (2048 positions, its Hermes-shaped template) with a disk tier in `tier`."""
    engine = make_engine(
        model,
        chat_template=TOOLS_TEMPLATE,
        num_gpu_blocks_override=2048,
        kv_offloading_size="64MiB",
        kv_offloading_path=str(tier),
    )
    async_engine = AsyncLLMEngine(engine)
    return RunningServer(
        build_app(
            async_engine,
            ServerSettings(served_model_names=("tiny-tools",), enable_auto_tool_choice=True, tool_call_parser="hermes"),
        ),
        async_engine,
    ).start()


def test_an_agents_prefix_is_read_from_the_tier_by_new_conversations_and_after_a_restart(tmp_path):
    model = build_tools_model(tmp_path / "model")
    first = start(model, tmp_path / "tier")
    one = first_turn(first, "Fix the failing test in tests/test_parser.py.")
    assert one["cache_read_input_tokens"] == 0
    prompt_one = one["input_tokens"] + one["cache_creation_input_tokens"]
    two = first_turn(first, "Add a --verbose flag to the command line.")
    shared = two["cache_read_input_tokens"]
    # the system prompt and the tools, rendered before the first message (a character a token): all but a block
    assert shared >= len(SYSTEM[1]["text"]) + 3 * len("a file of the project") and shared < prompt_one
    first.stop()  # the engine closes: what is queued for the disk is written first

    second = start(model, tmp_path / "tier")
    three = first_turn(second, "Explain what src/cache.py does.")
    assert three["cache_read_input_tokens"] == shared  # all of it from the tier
    with second.client() as c:
        m = metric_values(c)
    second.stop()
    assert m["kvserve:external_prefix_cache_hits_total{medium=DISK}"] == shared
