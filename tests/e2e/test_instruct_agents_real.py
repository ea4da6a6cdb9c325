"""Agents on the instruct model, through the real server as `kvserve serve --model qwen2.5-coder-0.5b-instruct
--enable-auto-tool-choice --tool-call-parser hermes --exclude-tools-when-tool-choice-none` runs it: the openai SDK
(streamed and not), LangChain's bind_tools, a LangGraph agent (LangChain's create_agent), and from JavaScript the
openai npm package and the Vercel AI SDK. Each runs the tool loop a user writes: the model calls get_weather under
tool_choice auto, the tool runs, its result goes back, and the last step (tool_choice "none", its prompt without the
tools) answers in text.

Why that last step: after a tool result this 0.5B model calls the tool again whenever the tools are in its prompt
(docs/AGENTS.md); rendered without them, and with a system prompt that says to answer, it answers. The LangGraph agent
gets there with a middleware that sends its step after a tool result with tool_choice "none".
The replies are greedy, so each test asserts what this model says (its greedy output equals HF's,
tests/e2e/test_instruct_real.py): the call's arguments and the temperature in the answer."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_support import RunningServer

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.engine.llm import LLM
from kvserve.server.app import build_app
from kvserve.server.context import ServerSettings

pytestmark = pytest.mark.real_model
MODEL = "qwen2.5-coder-0.5b-instruct"
JS_DIR = Path(__file__).resolve().parents[1] / "js"
SYSTEM = "You are a helpful assistant. Once a tool result is given, answer the user in one sentence."
QUESTION = "What's the weather like in Paris today?"
RESULT = '{"temperature": 18, "sky": "sunny"}'
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    engine = LLM(model=MODEL, kv_cache_memory_bytes=256 << 20).engine
    async_engine = AsyncLLMEngine(engine)
    settings = ServerSettings(
        served_model_names=(MODEL,),
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
        exclude_tools_when_tool_choice_none=True,
    )
    running = RunningServer(build_app(async_engine, settings), async_engine).start()
    yield running
    running.stop()
    engine.check_invariants()


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client: openai.OpenAI, messages: list[Any], **kw: Any):
    return client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], temperature=0, max_tokens=100, **kw
    )


def _assert_answers(text: str | None) -> None:
    assert text and "18" in text and "Paris" in text, text
    assert '"name"' not in text, text


def test_openai_sdk_tool_loop(client):
    messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    first = _chat(client, messages).choices[0]
    assert first.finish_reason == "tool_calls" and not first.message.content
    (call,) = first.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    messages += [
        first.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": RESULT},
    ]
    final = _chat(client, messages, tool_choice="none").choices[0]
    assert final.finish_reason == "stop" and final.message.tool_calls is None
    _assert_answers(final.message.content)


def test_anthropic_sdk_tool_loop(server):
    """The anthropic SDK on /v1/messages, auto tool choice: the model calls get_weather (a tool_use block, stop_reason
    tool_use), the tool_result goes back, and it answers; the same loop as the openai SDK's above."""
    import anthropic

    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    tool = {"name": "get_weather", **{k: v for k, v in WEATHER["function"].items() if k != "name"}}
    tool["input_schema"] = tool.pop("parameters")
    kw: dict[str, Any] = dict(model=MODEL, max_tokens=100, system=SYSTEM, tools=[tool], extra_body={"temperature": 0})
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    first = client.messages.create(**kw, messages=messages)
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Paris"}
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT}]},
    ]
    final = client.messages.create(**kw, messages=messages, tool_choice={"type": "none"})
    assert final.stop_reason == "end_turn" and [b.type for b in final.content] == ["text"]
    _assert_answers(final.content[0].text)


def test_openai_sdk_streamed_call_arrives_whole(client):
    """Streamed, the call comes in one delta (name, id and the whole arguments) once its JSON closes: nothing of the
    bare call object leaks into content while the parser is still deciding."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    chunks = list(_chat(client, messages, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    pieces = [t for d in deltas for t in d.tool_calls or []]
    assert not "".join(d.content or "" for d in deltas).strip()
    assert len(pieces) == 1 and pieces[0].id and pieces[0].function.name == "get_weather"
    assert json.loads(pieces[0].function.arguments) == {"city": "Paris"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def _lc_model(server: RunningServer):
    import langchain_openai

    return langchain_openai.ChatOpenAI(
        model=MODEL, base_url=f"{server.base_url}/v1", api_key="unused", temperature=0, max_tokens=100, max_retries=0
    )


def test_langchain_bind_tools_loop(server):
    import langchain_core.messages as lc
    import langchain_core.tools as lc_tools

    ran: list[str] = []

    @lc_tools.tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city"""
        ran.append(city)
        return RESULT

    llm = _lc_model(server)
    history: list[Any] = [lc.SystemMessage(SYSTEM), lc.HumanMessage(QUESTION)]
    first = llm.bind_tools([get_weather]).invoke(history)
    assert [c["name"] for c in first.tool_calls] == ["get_weather"]
    history.append(first)
    history += [get_weather.invoke(call) for call in first.tool_calls]
    assert ran == ["Paris"]
    final = llm.bind_tools([get_weather], tool_choice="none").invoke(history)
    assert not final.tool_calls
    _assert_answers(final.content)


def test_langgraph_agent_loop(server):
    """LangChain's create_agent (a LangGraph ReAct graph; LangGraph 1.0 moved its create_react_agent there): the model
    calls, the tool node runs, and a middleware sends the step after a tool result with tool_choice "none", as an
    agent on a small model is written; the agent ends with the model's answer."""
    import langchain_core.messages as lc
    import langchain_core.tools as lc_tools
    from langchain.agents import create_agent
    from langchain.agents.middleware import ModelRequest, wrap_model_call

    ran: list[str] = []

    @lc_tools.tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city"""
        ran.append(city)
        return RESULT

    @wrap_model_call
    def answer_after_tool_results(request: ModelRequest, handler):
        if isinstance(request.messages[-1], lc.ToolMessage):
            request = request.override(tool_choice="none")
        return handler(request)

    agent = create_agent(_lc_model(server), [get_weather], system_prompt=SYSTEM, middleware=[answer_after_tool_results])
    state = agent.invoke({"messages": [lc.HumanMessage(QUESTION)]}, {"recursion_limit": 8})
    kinds = [type(m).__name__ for m in state["messages"]]
    assert kinds == ["HumanMessage", "AIMessage", "ToolMessage", "AIMessage"], kinds
    assert ran == ["Paris"] and not state["messages"][-1].tool_calls
    _assert_answers(state["messages"][-1].content)


def _js_modules() -> Path:
    """tests/js/node_modules, installed from the lock file when missing (npm ci: about 10 s from the registry)."""
    if shutil.which("npm") is None or shutil.which("node") is None:
        pytest.fail("node and npm are needed for the JavaScript client tests (.ci/run installs them)")
    modules = JS_DIR / "node_modules"
    if not (modules / ".package-lock.json").exists():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=JS_DIR, check=True, timeout=300)
    return modules


def test_javascript_clients_tool_loop(server):
    """The openai npm package (a hand-written loop) and the Vercel AI SDK's generateText with tools (its own loop:
    two steps, the second with toolChoice "none") both get the call and then the answer."""
    _js_modules()
    run = subprocess.run(
        ["node", "clients.mjs", f"{server.base_url}/v1", MODEL],
        cwd=JS_DIR,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    sdk = got["openai"]
    assert sdk["finish_reason"] == "tool_calls" and sdk["calls"] == [
        {"name": "get_weather", "arguments": {"city": "Paris"}}
    ]
    assert sdk["final_calls"] == []
    _assert_answers(sdk["final_text"])
    ai = got["ai_sdk"]
    assert ai["finish_reason"] == "tool-calls" and ai["calls"] == [
        {"name": "get_weather", "arguments": {"city": "Paris"}}
    ]
    assert ai["steps"] == 2 and ai["tool_ran_for"] == ["Paris"]
    _assert_answers(ai["final_text"])
