"""LangChain (langchain-openai's ChatOpenAI) against the real server on the tiny tool-template model:
with_structured_output by its three methods, and bind_tools in a one-step agent loop that runs a Python function
and sends its result back as a tool message."""

from __future__ import annotations

from typing import Literal

import langchain_core.messages as messages_mod
import langchain_core.tools as tools_mod
import langchain_openai
import pytest
from pydantic import BaseModel, Field
from tool_server_support import COMPACT, MODEL


class Weather(BaseModel):
    """The weather in a city."""

    city: Literal["Paris", "Rome", "Oslo"]
    celsius: int = Field(ge=-30, le=45)
    sunny: bool


def _llm(server, **kw) -> langchain_openai.ChatOpenAI:
    options = {"temperature": 0, "max_tokens": 200, **kw}
    return langchain_openai.ChatOpenAI(
        model=MODEL, base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60, **options
    )


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output_pydantic(tools_server, method):
    llm = _llm(tools_server, extra_body=COMPACT) if method == "json_schema" else _llm(tools_server)
    result = llm.with_structured_output(Weather, method=method).invoke("What is the weather in Rome?")
    assert isinstance(result, Weather)


def test_with_structured_output_json_mode(tools_server):
    """json_mode sends response_format json_object; the reply parses as a JSON object."""
    llm = _llm(tools_server, temperature=1.0, seed=2, max_tokens=300, extra_body=COMPACT)
    schema = {"title": "anything", "type": "object"}
    result = llm.with_structured_output(schema, method="json_mode").invoke("Reply with a JSON object.")
    assert isinstance(result, dict)


def test_with_structured_output_include_raw(tools_server):
    llm = _llm(tools_server)
    out = llm.with_structured_output(Weather, method="function_calling", include_raw=True).invoke("Weather?")
    assert out["parsing_error"] is None and isinstance(out["parsed"], Weather)
    assert out["raw"].tool_calls[0]["name"] == "Weather"


def test_bind_tools_agent_loop(tools_server):
    """Step 1 forces a call (tool_choice "required"); the function runs; its result goes back as a ToolMessage, and
    the model answers in text (tool_choice "none")."""
    ran: list[dict] = []

    @tools_mod.tool
    def get_weather(city: Literal["Paris", "Rome", "Oslo"], days: int = 1) -> str:
        """The forecast for a city, a few days ahead."""
        ran.append({"city": city, "days": days})
        return f"{city}: sunny for {days} day(s)"

    llm = _llm(tools_server)
    question = messages_mod.HumanMessage("What's the weather in Oslo?")
    first = llm.bind_tools([get_weather], tool_choice="required").invoke([question])
    assert first.tool_calls and first.response_metadata["finish_reason"] == "tool_calls"
    history = [question, first]
    for call in first.tool_calls:
        assert call["name"] == "get_weather"
        history.append(get_weather.invoke(call))  # a ToolMessage with the call's id
    assert len(ran) == len(first.tool_calls) and isinstance(history[-1], messages_mod.ToolMessage)
    final = llm.bind_tools([get_weather], tool_choice="none").invoke(history)
    assert isinstance(final, messages_mod.AIMessage) and not final.tool_calls and final.content


def test_bind_tools_streams_tool_call_chunks(tools_server):
    """Streamed, LangChain puts the call pieces back together into the same call."""

    @tools_mod.tool
    def lookup(term: Literal["cat", "dog"]) -> str:
        """Look a term up."""
        return term

    llm = _llm(tools_server, temperature=1.0, seed=5).bind_tools([lookup], tool_choice="lookup")
    whole = llm.invoke("Look up cat.")
    merged = None
    for chunk in llm.stream("Look up cat."):
        merged = chunk if merged is None else merged + chunk
    assert [c["args"] for c in merged.tool_calls] == [c["args"] for c in whole.tool_calls]
    assert merged.tool_calls[0]["name"] == "lookup"
