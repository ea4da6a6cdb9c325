"""POST /v1/responses through the openai SDK (its own types parse every object and event) on the tiny tools server:
text and message input, instructions, the typed event stream, function tools with forced calls (a tiny random model
never calls under `auto`) and the call / output loop, text.format json_schema, previous_response_id, usage with cached
tokens, and clear 400s for what kvserve does not have."""

from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
from tool_server_support import MODEL, TIME_TOOL, WEATHER_TOOL, start_server

WEATHER = {"type": "function", **WEATHER_TOOL["function"]}  # the Responses API's flat function tool
TIME = {"type": "function", **TIME_TOOL["function"]}
NAMED = {"type": "function", "name": "get_weather"}


def test_text_input_and_usage(tools_client):
    kw = dict(model=MODEL, input="hello there", instructions="Be brief.", max_output_tokens=8, temperature=0)
    first = tools_client.responses.create(**kw)
    assert first.object == "response" and first.id.startswith("resp_")
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
    assert first.output[0].type == "message" and first.output[0].role == "assistant"
    assert first.output_text == first.output[0].content[0].text != ""
    assert first.usage.output_tokens == 8
    assert first.usage.total_tokens == first.usage.input_tokens + 8
    again = tools_client.responses.create(**kw)
    assert again.output_text == first.output_text  # greedy
    assert again.usage.input_tokens_details.cached_tokens > 0  # the prompt's prefix, from the KV cache


def test_stream_events_are_typed_numbered_and_equal_the_whole(tools_client):
    kw = dict(model=MODEL, input=[{"role": "user", "content": "hi"}], max_output_tokens=12, temperature=0)
    whole = tools_client.responses.create(**kw)
    with tools_client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"  # also when incomplete (as vLLM; the SDK helper needs it)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[2:5] == ["response.output_item.added", "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.status == whole.status == "incomplete"


@pytest.mark.parametrize("tool_choice", [NAMED, "required"])
def test_function_calls_streamed_and_whole(tools_client, tool_choice):
    kw = dict(model=MODEL, input="weather?", tools=[WEATHER], tool_choice=tool_choice, temperature=0)
    whole = tools_client.responses.create(**kw)
    calls = [o for o in whole.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    assert json.loads(calls[0].arguments)["city"] in ("Paris", "Rome", "Oslo")
    with tools_client.responses.stream(**kw) as stream:
        events = list(stream)
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert pieces == "".join(d.arguments for d in done) == "".join(c.arguments for c in calls)


def test_the_call_output_loop(tools_client):
    """A function_call item and its function_call_output go back as input (the assistant's call, the tool result)."""
    first = tools_client.responses.create(
        model=MODEL, input="weather?", tools=[WEATHER], tool_choice=NAMED, temperature=0
    )
    call = next(o for o in first.output if o.type == "function_call")
    loop = [
        {"role": "user", "content": "weather?"},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 18}'},
    ]
    second = tools_client.responses.create(
        model=MODEL, input=loop, tools=[WEATHER], tool_choice="none", max_output_tokens=5
    )
    assert second.output[0].type == "message"
    assert second.usage.input_tokens > first.usage.input_tokens  # the call and its result are in the prompt


def test_previous_response_id_carries_the_conversation(tools_client):
    first = tools_client.responses.create(model=MODEL, input="one", max_output_tokens=4, temperature=0)
    chained = tools_client.responses.create(
        model=MODEL, input="two", previous_response_id=first.id, max_output_tokens=4, temperature=0
    )
    alone = tools_client.responses.create(model=MODEL, input="two", max_output_tokens=4, temperature=0)
    assert chained.previous_response_id == first.id
    assert chained.usage.input_tokens > alone.usage.input_tokens
    with pytest.raises(openai.NotFoundError, match="previous_response_id"):
        tools_client.responses.create(model=MODEL, input="x", previous_response_id="resp_unknown")


def test_text_format_json_schema(tools_client):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    r = tools_client.responses.create(
        model=MODEL,
        input="a number",
        text={"format": {"type": "json_schema", "name": "n", "schema": schema}},
        max_output_tokens=40,
        temperature=0,
    )
    assert isinstance(json.loads(r.output_text)["n"], int)


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"background": True}, "background"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ],
)
def test_what_kvserve_lacks_is_a_clear_400(tools_client, extra, param):
    kw = {"model": MODEL, "input": "x", "max_output_tokens": 2, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        tools_client.responses.create(**kw)
    assert e.value.body["param"] == param


def test_routine_fields_are_accepted(tools_client):
    r = tools_client.responses.create(
        model=MODEL,
        input="x",
        max_output_tokens=2,
        store=False,
        include=["message.output_text.logprobs"],
        truncation="disabled",
        metadata={"k": "v"},
        user="u1",
        parallel_tool_calls=False,
    )
    assert r.metadata == {"k": "v"} and r.store is False
    with pytest.raises(openai.NotFoundError):  # not stored
        tools_client.responses.create(model=MODEL, input="y", previous_response_id=r.id, max_output_tokens=2)


def test_objects_and_events_validate_strictly_against_the_sdk_types(tools_server):
    """The SDK builds its objects without validating; here pydantic validates the raw JSON against its types."""
    import httpx
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    url = f"{tools_server.base_url}/v1/responses"
    body = {"model": MODEL, "input": "weather?", "tools": [WEATHER], "tool_choice": "required", "max_output_tokens": 60}
    Response.model_validate(httpx.post(url, json=body, timeout=60).json())
    events = TypeAdapter(ResponseStreamEvent)
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
        frames = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert {f["type"] for f in frames} >= {"response.function_call_arguments.done", "response.completed"}
    for frame in frames:
        events.validate_python(frame)


@pytest.mark.parametrize(
    "body",
    [
        {"input": "x", "text": {"format": "json"}},
        {"input": "x", "text": {"format": {"type": "yaml"}}},
        {"input": [{"type": "message", "role": "user", "content": [1]}]},
        {"input": [{"type": "message", "role": "robot", "content": "x"}]},
        {"input": [{"type": "computer_call"}]},
        {"input": [], "max_output_tokens": 2},
        {"input": "x", "max_output_tokens": 0},
        {"input": "x", "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "nonsense"}}}},
    ],
)
def test_malformed_bodies_are_400s(tools_server, body):
    import httpx

    r = httpx.post(f"{tools_server.base_url}/v1/responses", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"]


def test_openai_agents_sdk_runs_a_tool_and_a_streamed_turn(tools_server):
    """The OpenAI Agents SDK unchanged on /v1/responses: an agent whose forced call runs a Python tool (a tiny random
    model never calls under `auto`), and a streamed turn with a structured output type (text.format json_schema, which
    ends the tiny model's reply where the object closes)."""
    import asyncio

    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from pydantic import BaseModel

    set_tracing_disabled(True)
    seen: list[str] = []

    class Verdict(BaseModel):
        ok: Literal["yes", "no"]

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"], unit: Literal["c", "f"], days: Literal[1, 2]) -> str:
        """The weather in a city (closed types: a random model's strings would run on)."""
        seen.append(city)
        return f"18 {unit} in {city} for {days} days"

    async def run() -> tuple[object, object]:
        client = openai.AsyncOpenAI(base_url=f"{tools_server.base_url}/v1", api_key="unused", max_retries=0)
        model = OpenAIResponsesModel(model=MODEL, openai_client=client)
        settings = ModelSettings(temperature=0, tool_choice="get_weather", max_tokens=80)
        agent = Agent(
            name="weather",
            tools=[get_weather],
            model=model,
            model_settings=settings,
            tool_use_behavior="stop_on_first_tool",
        )
        called = await Runner.run(agent, "weather?")
        plain = Agent(name="plain", model=model, model_settings=ModelSettings(temperature=0), output_type=Verdict)
        streamed = Runner.run_streamed(plain, "hello")
        async for _ in streamed.stream_events():
            pass
        await client.close()
        return called.final_output, streamed.final_output

    called, streamed = asyncio.run(run())
    assert seen and called == f"18 {called.split()[1]} in {seen[0]} for {called.split()[-2]} days"
    assert isinstance(streamed, Verdict)


# -- hostile input, round three (#43) ----------------------------------------------------------------------------


def _post(server, body: dict, path: str = "/v1/responses"):
    import httpx

    return httpx.post(f"{server.base_url}{path}", json={"model": MODEL, **body}, timeout=60)


@pytest.mark.parametrize(
    "field,value",
    [("max_output_tokens", "4"), ("stream", "yes"), ("temperature", "0.5"), ("store", 1), ("top_p", True)],
)
def test_types_are_as_strict_as_chat(tools_server, field, value):
    """#43 item 10: `"4"` and `"yes"` were accepted here where chat refuses them."""
    r = _post(tools_server, {"input": "x", "max_output_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


@pytest.mark.parametrize(
    "item,param",
    [
        (
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": {"city": "Paris"}},
            "arguments",
        ),
        ({"type": "function_call", "call_id": "c1", "name": 7, "arguments": "{}"}, "name"),
        ({"type": "function_call", "call_id": ["c1"], "name": "get_weather", "arguments": "{}"}, "call_id"),
        ({"type": "function_call_output", "call_id": "c1", "output": {"temp": 18}}, "output"),
    ],
)
def test_input_items_are_typed_as_openai_types_them(tools_server, item, param):
    """#43 item 10: an object `arguments` was rendered into the prompt as Python repr (`{'city': 'Paris'}`). OpenAI
    and vLLM type a call's `arguments` and `call_id` as strings, and an output as text: a 400 naming the field."""
    r = _post(tools_server, {"input": [{"role": "user", "content": "hi"}, item], "max_output_tokens": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == f"input[1].{param}"


@pytest.mark.parametrize(
    "body,param",
    [
        ({"input": "x", "max_output_tokens": 2047}, "max_output_tokens"),
        ({"input": "x" * 3000, "max_output_tokens": 2}, "input"),
        ({"input": "x" * 100_000, "max_output_tokens": 2}, "input"),
        (
            {
                "input": "x",
                "tools": [{"type": "function", "name": "f", "parameters": {"type": "nonsense"}}],
                "tool_choice": "required",
            },
            "tools[0].parameters",
        ),
        (
            {"input": "x", "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "nonsense"}}}},
            "text.format.schema",
        ),
    ],
)
def test_errors_name_the_responses_fields(tools_server, body, param):
    """#43 item 10: the errors of the chat path underneath named chat's fields (max_tokens, messages, prompt,
    response_format..., tools[0].function.parameters), which a Responses client never sent."""
    r = _post(tools_server, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    for chat_name in ("max_tokens", "messages", "prompt", "response_format", "function.parameters"):
        assert chat_name not in error["message"], error


def test_cache_salt_isolates_tenants_and_follows_the_chain(tools_client):
    """#43 item 8: `cache_salt` was ignored here, so tenant B hit tenant A's cached prompt. It is honoured as in chat,
    and a chained request (previous_response_id) without one keeps the salt its chain was computed under."""
    kw = dict(model=MODEL, max_output_tokens=2, temperature=0)
    text = "tenant A's private question, long enough to fill some blocks"
    first = tools_client.responses.create(input=text, extra_body={"cache_salt": "tenant-a"}, **kw)
    again = tools_client.responses.create(input=text, extra_body={"cache_salt": "tenant-a"}, **kw)
    other = tools_client.responses.create(input=text, extra_body={"cache_salt": "tenant-b"}, **kw)
    assert again.usage.input_tokens_details.cached_tokens >= len(text)
    assert other.usage.input_tokens_details.cached_tokens == 0
    chained = tools_client.responses.create(input="and then?", previous_response_id=first.id, **kw)
    # the unsalted cache holds no more of this prompt than the template's first characters
    assert chained.usage.input_tokens_details.cached_tokens >= len(text)


def test_an_empty_cache_salt_is_a_400_as_in_chat(tools_server):
    r = _post(tools_server, {"input": "x", "max_output_tokens": 2, "cache_salt": ""})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "cache_salt"


def test_retrieve_and_delete_a_stored_response(tools_client):
    """#43 item 10: GET and DELETE /v1/responses/{id} were missing, so the openai SDK's `responses.retrieve` got a 404
    although `store` defaults to true. OpenAI has both."""
    kw = dict(model=MODEL, input="keep me", max_output_tokens=3, temperature=0)
    whole = tools_client.responses.create(**kw)
    got = tools_client.responses.retrieve(whole.id)
    assert got.model_dump() == whole.model_dump()
    with tools_client.responses.stream(**kw) as stream:
        streamed = stream.get_final_response()
    again = tools_client.responses.retrieve(streamed.id)  # the stream helper's final response is a ParsedResponse
    assert (again.status, again.output_text, again.usage) == (streamed.status, streamed.output_text, streamed.usage)
    tools_client.responses.delete(whole.id)
    with pytest.raises(openai.NotFoundError):
        tools_client.responses.retrieve(whole.id)
    with pytest.raises(openai.NotFoundError):
        tools_client.responses.delete(whole.id)
    with pytest.raises(openai.NotFoundError, match="previous_response_id"):
        tools_client.responses.create(model=MODEL, input="x", previous_response_id=whole.id, max_output_tokens=2)
    unstored = tools_client.responses.create(**kw, store=False)
    with pytest.raises(openai.NotFoundError):
        tools_client.responses.retrieve(unstored.id)


def test_structured_outputs_as_vllm_takes_them(tools_client, tools_server):
    """vLLM's Responses request takes `structured_outputs` (any constraint, e.g. a choice), and refuses it beside
    `text.format`; the tests below script replies with it."""
    r = tools_client.responses.create(
        model=MODEL, input="x", max_output_tokens=20, extra_body={"structured_outputs": {"choice": ["forced text"]}}
    )
    assert r.output_text == "forced text" and r.status == "completed"
    json_format = {"format": {"type": "json_object"}}
    body = {"input": "x", "text": json_format, "structured_outputs": {"choice": ["a"]}}
    bad = _post(tools_server, body)
    assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("structured_outputs"), bad.text


def scripted(text: str) -> dict:
    """extra_body that makes the reply exactly `text` (a one-string choice: one token a character here)."""
    return {"structured_outputs": {"choice": [text]}}


TWO_CALLS = (
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c", "days": 1}}</tool_call>'
    '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
)


@pytest.mark.parametrize("stream", [False, True])
def test_a_reply_cut_inside_a_tool_call_is_incomplete(tools_client, stream):
    """#43 item 10: max_output_tokens ending the reply inside its second call came back `status: "completed"`,
    `incomplete_details: null` (chat's finish_reason is "tool_calls" there, as vLLM's); OpenAI says incomplete."""
    cut = TWO_CALLS.index("get_time") + 4
    kw = dict(model=MODEL, input="weather and time?", tools=[WEATHER, TIME], max_output_tokens=cut, temperature=0)
    if stream:
        with tools_client.responses.stream(**kw, extra_body=scripted(TWO_CALLS)) as events:
            r = events.get_final_response()
    else:
        r = tools_client.responses.create(**kw, extra_body=scripted(TWO_CALLS))
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [(o.name, o.status) for o in r.output if o.type == "function_call"] == [("get_weather", "completed")]
    assert r.output_text == TWO_CALLS[TWO_CALLS.index("</tool_call>") + len("</tool_call>") : cut]  # the cut call
    whole = tools_client.responses.create(**{**kw, "max_output_tokens": 400}, extra_body=scripted(TWO_CALLS))
    assert whole.status == "completed" and [o.name for o in whole.output] == ["get_weather", "get_time"]


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "get_weather", "arguments": {"city": Paris}}</tool_call>',  # item 11
        '<tool_call>{"name": "delete_all_files", "arguments": {}}</tool_call>',  # item 12
    ],
)
def test_a_call_that_is_not_one_is_a_message(tools_client, text):
    """#43 items 11 and 12 through /v1/responses: no function_call item, the text as the message."""
    r = tools_client.responses.create(
        model=MODEL, input="weather?", tools=[WEATHER], max_output_tokens=200, extra_body=scripted(text)
    )
    assert [o.type for o in r.output] == ["message"] and r.output_text == text and r.status == "completed"


def test_a_strict_function_tool_is_validated(tools_client):
    """Responses' function tools carry `strict` through (it was dropped): a call its schema refuses is a message."""
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "k", "days": 1}}</tool_call>'
    kw = dict(model=MODEL, input="weather?", max_output_tokens=200, extra_body=scripted(call))
    strict = tools_client.responses.create(**kw, tools=[{**WEATHER, "strict": True}])
    assert [o.type for o in strict.output] == ["message"]
    lax = tools_client.responses.create(**kw, tools=[WEATHER])
    assert [o.type for o in lax.output] == ["function_call"]


# -- what Codex sends (issue 55) ----------------------------------------------------------------------------------

CLOSE = {
    "type": "function",
    "name": "close_agent",
    "description": "Close an agent.",
    "strict": False,
    "parameters": {
        "type": "object",
        "properties": {"target": {"type": "string", "enum": ["a1", "a2"]}},
        "required": ["target"],
        "additionalProperties": False,
    },
}
AGENTS = {"type": "namespace", "name": "agents", "description": "Sub-agents.", "tools": [CLOSE]}
# the same function as a plain one, as the prompt names it
FLAT = {**CLOSE, "name": "agents__close_agent", "description": "Sub-agents.\nClose an agent."}


@pytest.mark.parametrize("stream", [False, True])
def test_namespace_tools_are_called_as_codex_expects(tools_server, stream):
    """Codex's default tool list holds a `namespace` tool (a group of functions): a 400 before. Its functions are
    offered as `namespace__name`, and a call of one comes back as `name` plus `namespace`, the only form Codex
    dispatches (a flat or dotted name is 'unsupported call' there)."""
    body = {"input": "close a1", "tools": [WEATHER, AGENTS], "temperature": 0, "max_output_tokens": 60}
    body["tool_choice"] = {"type": "function", "name": "close_agent", "namespace": "agents"}
    if not stream:
        output = _post(tools_server, body).json()["output"]
    else:
        import httpx

        with httpx.stream(
            "POST", f"{tools_server.base_url}/v1/responses", json={"model": MODEL, **body, "stream": True}, timeout=60
        ) as r:
            frames = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        added = next(f["item"] for f in frames if f["type"] == "response.output_item.added")
        assert (added["name"], added["namespace"]) == ("close_agent", "agents")
        output = frames[-1]["response"]["output"]
    (call,) = [o for o in output if o["type"] == "function_call"]
    assert (call["name"], call["namespace"]) == ("close_agent", "agents")
    assert json.loads(call["arguments"])["target"] in ("a1", "a2")


def test_a_namespaced_call_sent_back_is_rendered_by_its_prompt_name(tools_server):
    """Codex sends the call back with its namespace, and its output: the prompt is the one a plain function of the
    prompt name gives, so the turn's prefix is the same as the model saw it."""
    call = {"type": "function_call", "call_id": "call_1", "arguments": '{"target": "a1"}', "status": "completed"}
    output = {"type": "function_call_output", "call_id": "call_1", "output": "closed"}
    turn = [{"role": "user", "content": "close a1"}]
    kw = {"max_output_tokens": 2, "temperature": 0}
    namespaced = _post(
        tools_server,
        {"input": [*turn, {**call, "name": "close_agent", "namespace": "agents"}, output], "tools": [AGENTS], **kw},
    )
    flat = _post(
        tools_server, {"input": [*turn, {**call, "name": "agents__close_agent"}, output], "tools": [FLAT], **kw}
    )
    assert namespaced.status_code == flat.status_code == 200
    assert namespaced.json()["usage"]["input_tokens"] == flat.json()["usage"]["input_tokens"]
    assert namespaced.json()["output"][0]["content"] == flat.json()["output"][0]["content"]  # greedy, same prompt


def test_hosted_tools_left_out_under_the_flag(tools_model_dir):
    """Codex sends the hosted web_search tool: a 400 naming --ignore-unsupported-tools by default; with the flag, left
    out of the prompt with a warning and named in a header."""
    body = {"input": "hi", "tools": [{"type": "web_search", "external_web_access": False}, WEATHER]}
    body |= {"max_output_tokens": 2, "temperature": 0}
    server = start_server(tools_model_dir, enable_auto_tool_choice=True, tool_call_parser="hermes")
    try:
        refused = _post(server, body)
        assert refused.status_code == 400 and "--ignore-unsupported-tools" in refused.json()["error"]["message"]
    finally:
        server.stop()
    server = start_server(
        tools_model_dir, enable_auto_tool_choice=True, tool_call_parser="hermes", ignore_unsupported_tools=True
    )
    try:
        kept = _post(server, body)
        plain = _post(server, {**body, "tools": [WEATHER]})
        assert kept.status_code == 200 and kept.headers["x-kvserve-ignored-tools"] == "tools[0] (web_search)"
        assert kept.json()["usage"]["input_tokens"] == plain.json()["usage"]["input_tokens"]
    finally:
        server.stop()
