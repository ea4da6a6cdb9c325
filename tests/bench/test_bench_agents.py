"""`kvserve bench agents`: a recorded conversation's turns as each server is sent them (a Responses request as a chat
completion for a peer without the endpoint: tools flattened, hosted tools left out), one reader for three APIs'
streams, and a whole run on a tiny model against the fake llama-server: per-turn TTFT and cached fractions, the
injected chat against its solo time, the ratios and the plot."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
from tiny_models import build_tiny_hf_model
from tiny_tokenizer import write_char_tokenizer

from kvserve.bench.agent_requests import (
    AgentConversation,
    StreamedReply,
    _read_usage,
    new_conversation,
    responses_to_chat,
    turn_body,
)
from kvserve.bench.agents import DEFAULT_CONVERSATIONS, fixtures_dir
from kvserve.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "structured"))
from tool_server_support import TOOLS_TEMPLATE

SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
SYSTEM = [{"type": "text", "text": "You are a coding agent. " * 6, "cache_control": {"type": "ephemeral"}}]
TOOLS = [{"name": "read", "description": "read a file", "input_schema": SCHEMA}]


def claude_like() -> dict:
    """Three turns in Claude Code's shape: a prompt, its tool call and result, a second prompt."""
    first = [{"role": "user", "content": [{"type": "text", "text": "List the files."}]}]
    call = {"type": "tool_use", "id": "toolu_1", "name": "read", "input": {"path": "a.py"}}
    second = [*first, {"role": "assistant", "content": [call]}]
    second.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "x = 1"}]})
    third = [*second, {"role": "assistant", "content": "done"}, {"role": "user", "content": "What is x?"}]
    turns = [{"model": "local", "system": SYSTEM, "tools": TOOLS, "max_tokens": 32000, "messages": m, "stream": True}
             for m in (first, second, third)]  # fmt: skip
    return {"client": "claude-code", "version": "0", "endpoint": "/v1/messages", "query": "beta=true",
            "headers": {"anthropic-version": "2023-06-01"}, "turns": turns}  # fmt: skip


def codex_like(extra_tools: list | None = None) -> dict:
    """Two turns in Codex's shape: developer instructions and a prompt, then its function call and output."""
    first = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief. " * 8}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the files."}]},
    ]
    second = [
        *first,
        {"type": "reasoning", "summary": []},
        {"type": "function_call", "name": "exec_command", "arguments": '{"cmd": "ls"}', "call_id": "call_1"},
        {"type": "function_call_output", "call_id": "call_1", "output": "a.py"},
    ]
    tools = [{"type": "function", "name": "exec_command", "description": "run a command", "parameters": SCHEMA}]
    turns = [{"model": "local", "input": i, "tools": tools + (extra_tools or []), "tool_choice": "auto",
              "store": False, "stream": True} for i in (first, second)]  # fmt: skip
    return {"client": "codex", "version": "0", "endpoint": "/v1/responses", "headers": {}, "turns": turns}


def test_a_responses_request_as_a_chat_completion():
    namespace = {"type": "namespace", "name": "agents", "tools": [{"type": "function", "name": "close_agent"}]}
    body = copy.deepcopy(codex_like([namespace, {"type": "web_search"}])["turns"][1])
    chat = responses_to_chat({**body, "instructions": "Obey."}, 3)
    assert [m["role"] for m in chat["messages"]] == ["system", "system", "user", "assistant", "tool"]
    assert chat["messages"][1]["content"] == "Be brief. " * 8
    assert chat["messages"][3]["tool_calls"][0]["function"] == {"name": "exec_command", "arguments": '{"cmd": "ls"}'}
    assert chat["messages"][4] == {"role": "tool", "tool_call_id": "call_1", "content": "a.py"}
    assert [t["function"]["name"] for t in chat["tools"]] == ["exec_command", "close_agent"]  # web_search left out
    assert chat["max_tokens"] == 3 and chat["stream"] and chat["tool_choice"] == "auto"


def test_a_turn_is_sent_as_recorded_but_for_model_and_output_length(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(claude_like()))
    conversation = AgentConversation.load(path)
    assert conversation.path == "/v1/messages?beta=true"
    body = turn_body(conversation, 1, "bench", 1)
    assert body == {**claude_like()["turns"][1], "model": "bench", "max_tokens": 1}
    codex = tmp_path / "x.json"
    codex.write_text(json.dumps(codex_like()))
    assert turn_body(AgentConversation.load(codex), 0, "bench", 2)["max_output_tokens"] == 2
    other = new_conversation(conversation, body, "Fix the build.")
    assert other["messages"][0]["content"] == [{"type": "text", "text": "Fix the build."}]
    assert {k: v for k, v in other.items() if k != "messages"} == {k: v for k, v in body.items() if k != "messages"}
    assert body["messages"][0]["content"][0]["text"] == "List the files."  # the recorded turn is left as it was
    path.write_text(json.dumps({"client": "x", "version": "0", "endpoint": "/v1/completions", "turns": [{}]}))
    with pytest.raises(ValueError, match="not a recorded agent conversation"):
        AgentConversation.load(path)


@pytest.mark.parametrize(
    "event, prompt, cached",
    [
        ({"type": "message_start",
          "message": {"usage": {"input_tokens": 5, "cache_read_input_tokens": 90, "cache_creation_input_tokens": 5}}},
         100, 90),
        ({"type": "response.completed",
          "response": {"usage": {"input_tokens": 100, "input_tokens_details": {"cached_tokens": 60}}}}, 100, 60),
        ({"choices": [], "usage": {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 30}}}, 100, 30),
        ({"choices": [], "usage": {"prompt_tokens": 100}, "timings": {"cache_n": 70, "prompt_n": 30}}, 100, 70),
    ],
)  # fmt: skip
def test_the_cache_report_of_each_api(event, prompt, cached):
    reply = StreamedReply()
    _read_usage(event, reply)
    assert (reply.prompt_tokens, reply.cached_tokens) == (prompt, cached)


def test_the_repositorys_recorded_conversations_load():
    """The default conversations: Claude Code's and Codex's recorded requests (tests/fixtures/agents)."""
    paths = [fixtures_dir() / n for n in DEFAULT_CONVERSATIONS]
    loaded = [AgentConversation.load(p) for p in paths]
    assert [c.endpoint for c in loaded] == ["/v1/messages", "/v1/responses"] and all(len(c.turns) > 1 for c in loaded)


def test_a_run_on_the_tiny_model_against_the_fake_llama_server(tmp_path, fake_llama_server, capsys):
    model = tmp_path / "model"
    build_tiny_hf_model("llama_gqa", max_position_embeddings=2048).save_pretrained(model)
    write_char_tokenizer(model)
    template = tmp_path / "tools.jinja"
    template.write_text(TOOLS_TEMPLATE)
    conversations = []
    for name, doc in (("claude.json", claude_like()), ("codex.json", codex_like())):
        (tmp_path / name).write_text(json.dumps(doc))
        conversations += ["--conversation", str(tmp_path / name)]
    out, png = tmp_path / "agents.json", tmp_path / "agents.png"
    serve = f"--chat-template {template} --enable-auto-tool-choice --tool-call-parser hermes --block-size 4"
    serve += f" --kv-offloading-size 16MiB --kv-offloading-path {tmp_path / 'tier'}"
    args = ["bench", "agents", "--model", str(model), *conversations, "--max-model-len", "2048"]
    args += ["--kv-cache-memory-bytes", "8MiB", "--kvserve-args", serve + " --cpu-threads 1", "--inject-after", "0"]
    args += ["--chat-words", "4", "--chat-output-len", "4", "--solo-repeats", "2"]
    args += ["--llama-server", str(fake_llama_server), "--new-conversations", "--json", str(out), "--plot", str(png)]
    assert main(args) == 0
    report = json.loads(out.read_text())
    systems = report["results"]["systems"]
    assert set(systems) == {"kvserve", "llama-server"}
    for row in systems.values():
        turns = row["turns"]
        assert [(t["conversation"], t["turn"]) for t in turns] == [
            ("claude-code", 1),
            ("claude-code", 2),
            ("claude-code", 3),
            ("codex", 1),
            ("codex", 2),
        ]
        assert all(t["error"] is None and t["ttft_ms"] > 0 and t["prompt_tokens"] > 0 for t in turns), turns
        assert turns[0]["cached_fraction"] < 0.1 and turns[2]["cached_fraction"] > 0.5  # turn 3 extends turn 2
        injected = row["injected"]
        assert injected["error"] is None and injected["latency_ms"] > 0 and len(injected["solo_latency_ms"]) == 2
        assert injected["latency_over_solo"] == pytest.approx(
            injected["latency_ms"] / injected["solo_latency_ms_median"]
        )
        slowed = injected["first_turn_slowdown_at_most"]
        assert slowed is None or slowed > 1  # None: the tiny model's turn ended before the chat did
    # kvserve reads every later turn's prompt up to its new messages from its cache (the fake's cache holds only the
    # request before: the injected chat, for turn 2)
    assert all(t["cached_fraction"] > 0.5 for t in systems["kvserve"]["turns"] if t["turn"] > 1)
    assert systems["kvserve"]["turns"][0]["cached_fraction"] == 0
    assert [t["endpoint"] for t in systems["llama-server"]["turns"][3:]] == ["/v1/chat/completions"] * 2
    assert [t["endpoint"] for t in systems["kvserve"]["turns"][3:]] == ["/v1/responses"] * 2
    # a new conversation's first turn reads the system prompt and tools from kvserve's cache, and after a restart
    # from its disk tier; the fake llama-server restarts empty
    new = {(t["conversation"], t["phase"]): t for t in systems["kvserve"]["new_conversations"]}
    assert sorted(new) == [(c, p) for c in ("claude-code", "codex") for p in ("after restart", "new conversation")]
    assert all(t["error"] is None and t["cached_fraction"] > 0.5 for t in new.values()), new
    peer = {(t["conversation"], t["phase"]): t for t in systems["llama-server"]["new_conversations"]}
    assert peer[("claude-code", "after restart")]["cached_fraction"] < 0.1
    assert report["ratios"]["later_turns_ttft_p50_kvserve_over_llama_server"] > 0
    assert set(report["ratios"]) >= {
        "first_turn_ttft_codex_kvserve_over_llama_server",
        "injected_latency_over_solo_kvserve",
        "injected_latency_over_solo_llama_server",
    }
    assert report["machine"]["cpu_model"] and png.stat().st_size > 0
    assert "Recorded agent turns" in capsys.readouterr().out


def test_bad_settings_fail_before_any_server_starts(tmp_path, capsys):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(claude_like()))
    assert main(["bench", "agents", "--conversation", str(path), "--conversation", str(path)]) != 0
    assert "one conversation a client" in capsys.readouterr().err
    assert main(["bench", "agents", "--conversation", str(path), "--solo-repeats", "0"]) != 0
    assert "--solo-repeats must be at least 1" in capsys.readouterr().err
    assert main(["bench", "agents", "--conversation", str(tmp_path / "missing.json")]) != 0
