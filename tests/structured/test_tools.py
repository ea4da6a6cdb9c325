"""Tools through the real server and the openai SDK, on a tiny random checkpoint whose chat template renders tools
(Hermes / Qwen shape) and the hermes parser: tool_choice none / auto / required / named, streamed and not, parallel
calls, the next turn with the tool's result, and the 400s. The model is random, so a forced call is valid only
because the grammar makes it so; `auto` calls are produced by constraining the text to the Hermes format."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from tool_server_support import (
    MODEL,
    NAMED,
    SCHEMAS,
    TIME_TOOL,
    TOOLS,
    TWO_HERMES_CALLS,
    USER,
    WEATHER_TOOL,
    sdk,
    start_server,
)


def _assert_valid_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _streamed(tools_client, **kw) -> tuple[str, list[tuple[str, str]], str, list]:
    """(content, [(name, arguments)], finish reason, chunks) of a streamed reply, put together as a client would,
    checking OpenAI's shape: each call's first piece has its id, type and name, later ones only arguments."""
    content, calls, finish, chunks = "", {}, None, list(tools_client.chat.completions.create(stream=True, **kw))
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for piece in choice.delta.tool_calls or []:
            if piece.index not in calls:
                assert piece.id and piece.type == "function" and piece.function.name
                calls[piece.index] = [piece.function.name, ""]
            else:
                assert piece.id is None and piece.type is None and piece.function.name is None
            calls[piece.index][1] += piece.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish, chunks


def _whole(r) -> tuple[str | None, list[tuple[str, str]], str]:
    message = r.choices[0].message
    return (
        message.content,
        [(c.function.name, c.function.arguments) for c in message.tool_calls or []],
        r.choices[0].finish_reason,
    )


def test_required_forces_valid_calls(tools_client):
    for seed in (2, 3, 4):
        r = tools_client.chat.completions.create(
            model=MODEL, messages=USER, tools=TOOLS, tool_choice="required", max_tokens=300, temperature=1.0, seed=seed
        )
        assert r.choices[0].finish_reason == "tool_calls"
        assert r.choices[0].message.content is None
        _assert_valid_calls(r.choices[0].message.tool_calls)


def test_named_forces_that_function(tools_client):
    r = tools_client.chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, tool_choice=NAMED, max_tokens=200, temperature=0
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
    _assert_valid_calls([call])


def test_required_may_return_several_calls_by_default(tools_client):
    """parallel_tool_calls defaults to true (OpenAI's default): the grammar lets a required reply hold several calls,
    each valid against its own function's schema, and the streamed reply equals the whole one."""
    kw = dict(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required", max_tokens=300, temperature=1.0, seed=6)
    r = tools_client.chat.completions.create(**kw)
    calls = r.choices[0].message.tool_calls
    assert len(calls) > 1 and r.choices[0].finish_reason == "tool_calls"
    _assert_valid_calls(calls)
    content, s_calls, finish, _ = _streamed(tools_client, **kw)
    assert (content or None, s_calls, finish) == _whole(r)


def test_parallel_tool_calls_false_gives_one_call(tools_client):
    for seed in (4, 5, 6):
        r = tools_client.chat.completions.create(
            model=MODEL,
            messages=USER,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=300,
            temperature=1.0,
            seed=seed,
        )
        assert len(r.choices[0].message.tool_calls) == 1


@pytest.mark.parametrize("tool_choice", ["required", NAMED, "auto"])
def test_streamed_calls_equal_the_whole(tools_client, tool_choice):
    """Per call an index, then id/type/name in its first piece, then (forced calls) arguments in pieces; put together
    they equal the non-streamed reply for the same seed. An `auto` (hermes) call comes whole, once its JSON closes."""
    extra = TWO_HERMES_CALLS if tool_choice == "auto" else None
    kw = dict(
        model=MODEL,
        messages=USER,
        tools=TOOLS,
        tool_choice=tool_choice,
        max_tokens=300,
        temperature=1.0,
        seed=9,
        extra_body=extra,
    )
    content, calls, finish = _whole(tools_client.chat.completions.create(**kw))
    s_content, s_calls, s_finish, chunks = _streamed(tools_client, **kw)
    assert (s_content or None, s_calls, s_finish) == (content, calls, finish)
    assert finish == "tool_calls"
    pieces = [p for c in chunks if c.choices for p in c.choices[0].delta.tool_calls or []]
    if tool_choice == "auto":
        assert len(pieces) == len(calls), "a hermes call is one piece"
    else:
        assert len(pieces) > len(calls), "arguments come in several pieces"


def test_sdk_stream_accumulator_rebuilds_the_calls(tools_client, tools_server):
    """The SDK's own stream helper (which merges deltas key by key) rebuilds the same calls; on the wire a call's
    later pieces carry no id or type at all (a null type would overwrite the accumulated one)."""
    kw = dict(
        model=MODEL,
        messages=USER,
        tools=TOOLS,
        tool_choice="auto",
        max_tokens=300,
        temperature=1.0,
        seed=4,
        extra_body=TWO_HERMES_CALLS,
    )
    whole = tools_client.chat.completions.create(**kw).choices[0].message
    with tools_client.beta.chat.completions.stream(**kw) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and final.message.content == whole.content
    assert [(c.type, c.function.name, c.function.arguments) for c in final.message.tool_calls] == [
        ("function", c.function.name, c.function.arguments) for c in whole.tool_calls
    ]
    body = {**{k: v for k, v in kw.items() if k != "extra_body"}, **TWO_HERMES_CALLS, "stream": True}
    with tools_server.client() as http:
        frames = [
            json.loads(line[6:])
            for line in http.post("/v1/chat/completions", json=body).text.splitlines()
            if line.startswith("data: {")
        ]
    pieces = [p for f in frames for c in f["choices"] for p in c["delta"].get("tool_calls", [])]
    firsts = {p["index"]: p for p in reversed(pieces)}
    for piece in pieces:
        if piece is firsts[piece["index"]]:
            assert set(piece) == {"index", "id", "type", "function"} and "name" in piece["function"]
        else:
            assert set(piece) == {"index", "function"} and set(piece["function"]) == {"arguments"}


def test_auto_reads_hermes_calls_and_content(tools_client):
    r = tools_client.chat.completions.create(
        model=MODEL,
        messages=USER,
        tools=TOOLS,
        tool_choice="auto",
        max_tokens=300,
        temperature=1.0,
        seed=2,
        extra_body=TWO_HERMES_CALLS,
    )
    message = r.choices[0].message
    assert message.content == "Checking."
    assert [c.function.name for c in message.tool_calls] == ["get_weather", "get_time"]
    _assert_valid_calls(message.tool_calls)
    assert r.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("tool_choice", [None, "none"])
def test_auto_is_the_default_and_plain_text_stays_text(tools_client, tool_choice):
    """Tools without tool_choice mean auto (OpenAI's default); a reply without calls is content, finish "stop" or
    "length", no tool_calls. tool_choice none answers in text too, streamed (no tool_calls delta at all) and not."""
    kw = dict(model=MODEL, messages=USER, tools=TOOLS, max_tokens=20, temperature=0)
    if tool_choice is not None:
        kw["tool_choice"] = tool_choice
    whole = _whole(tools_client.chat.completions.create(**kw))
    *streamed, chunks = _streamed(tools_client, **kw)
    assert not any(c.choices and c.choices[0].delta.tool_calls for c in chunks)
    for content, calls, finish in (whole, streamed):
        assert content and calls == [] and finish in ("stop", "length")
    assert tuple(streamed) == whole


def test_none_renders_the_tools_and_answers_in_text(tools_client, tools_server):
    """tool_choice none: the template still renders the tools into the prompt; the reply is text."""
    plain = tools_client.chat.completions.create(model=MODEL, messages=USER, max_tokens=5, temperature=0)
    r = tools_client.chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, tool_choice="none", max_tokens=5, temperature=0
    )
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 200  # the two function descriptions
    with tools_server.client() as http:
        ids = http.post("/tokenize", json={"messages": USER, "tools": TOOLS}).json()["tokens"]
        text = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text.startswith("<bos><system>Tools:\n{") and '"name": "get_time"' in text


def test_next_turn_renders_the_call_and_its_result(tools_client, tools_server):
    """The assistant's tool_calls and the tool message go back through the template (arguments as an object)."""
    first = tools_client.chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, tool_choice=NAMED, max_tokens=200, temperature=0
    )
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *USER,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"},
    ]
    r = tools_client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=5, temperature=0
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    with tools_server.client() as http:
        ids = http.post("/tokenize", json={"messages": messages, "tools": TOOLS}).json()["tokens"]
        text = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    arguments = json.dumps(json.loads(call.function.arguments))
    assert f'<tool_call>{{"name": "get_weather", "arguments": {arguments}}}</tool_call>' in text
    assert "<tool_response>18 degrees, sunny</tool_response>" in text


def test_n_choices_each_get_their_calls(tools_client):
    r = tools_client.chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, tool_choice="required", n=2, max_tokens=300, temperature=1.0, seed=3
    )
    assert [c.index for c in r.choices] == [0, 1]
    for choice in r.choices:
        _assert_valid_calls(choice.message.tool_calls)
    assert len({c.id for choice in r.choices for c in choice.message.tool_calls}) == sum(
        len(choice.message.tool_calls) for choice in r.choices
    )


def test_a_call_cut_by_max_tokens_is_length(tools_client):
    r = tools_client.chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, tool_choice=NAMED, max_tokens=4, temperature=0
    )
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"


# -- 400s ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body,param,words",
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "'nope' is not in tools",
        ),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "tool_choice must be"),
        ({"tool_choice": "required"}, "tool_choice", "at least one tool"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"type": "bogus"}}},
                        },
                    }
                ],
                "tool_choice": {"type": "function", "function": {"name": "f"}},
            },
            "tools[0].function.parameters",
            "invalid JSON schema",
        ),
        (
            {
                "tools": [
                    TIME_TOOL,
                    {
                        "type": "function",
                        "function": {
                            "name": "g",
                            "parameters": {"type": "object", "properties": {"a": {"$ref": "#/$defs/none"}}},
                        },
                    },
                ],
                "tool_choice": "required",
            },
            "tools[1].function.parameters",
            "invalid JSON schema",
        ),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", "name"),
        ({"tools": [{"type": "retrieval"}]}, "tools", "'function'"),
    ],
)
def test_bad_tools_are_400s_naming_the_field(tools_client, body, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        tools_client.chat.completions.create(model=MODEL, messages=USER, max_tokens=5, **body)
    assert info.value.body["param"] == param, info.value.body
    assert words in info.value.body["message"], info.value.body


# Claude Code's zod records: `propertyNames` on an object of string values, beside a property the call must have.
RECORD_TOOL = {
    "type": "function",
    "function": {
        "name": "tag",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome"]},
                "labels": {
                    "type": "object",
                    "propertyNames": {"type": "string"},
                    "additionalProperties": {"type": "integer"},
                },
            },
            "required": ["city", "labels"],
            "additionalProperties": False,
        },
    },
}
BOGUS_TOOL = {
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "bogus"}}}},
}


@pytest.mark.parametrize("tool_choice", ["auto", "none", None])
def test_unforced_tool_schemas_only_shape_the_prompt(tools_client, tool_choice):
    """Issue 55: a schema no backend compiles (llguidance lacks propertyNames; `bogus` is no type) refused requests
    that forced nothing. Under auto and none the schemas are only rendered: the reply is the same as with a tool
    whose schema compiles, on the same prompt length."""
    kw = dict(model=MODEL, messages=USER, max_tokens=5, temperature=0)
    if tool_choice is not None:
        kw["tool_choice"] = tool_choice
    for tool in (RECORD_TOOL, BOGUS_TOOL):
        r = tools_client.chat.completions.with_raw_response.create(tools=[tool], **kw)
        assert r.http_response.status_code == 200
        assert "x-kvserve-ignored-schema-keywords" not in r.headers  # nothing was compiled, so nothing ignored
        assert r.parse().usage.prompt_tokens > 50


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "tag"}}])
def test_a_forced_call_ignores_only_the_keywords_the_backend_lacks(tools_client, tool_choice):
    """A forced call whose schema has a keyword neither backend enforces (auto tried llguidance after xgrammar)
    is compiled without that keyword alone, and says so in a header: the rest of the schema still forces the call
    (its required city from the enum, integer label values). Before: a 400 naming tools[0].function.parameters."""
    r = tools_client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=USER,
        tools=[RECORD_TOOL, WEATHER_TOOL],
        tool_choice=tool_choice,
        max_tokens=300,
        temperature=0,
        parallel_tool_calls=False,
    )
    assert r.http_response.status_code == 200
    assert r.headers["x-kvserve-ignored-schema-keywords"] == "tag: propertyNames"
    reply = r.parse().choices[0]
    assert reply.finish_reason == "tool_calls"
    (call,) = reply.message.tool_calls
    if call.function.name == "tag":
        arguments = json.loads(call.function.arguments)
        assert arguments["city"] in ("Paris", "Rome") and set(arguments) == {"city", "labels"}
        assert all(isinstance(v, int) for v in arguments["labels"].values())
    else:
        _assert_valid_calls([call])


def test_auto_needs_the_server_flags(tools_model_dir):
    """As vLLM: tool_choice auto (the default with tools) is a 400 unless the server enables it; none, required
    and named work without."""
    server = start_server(tools_model_dir)
    try:
        plain = sdk(server)
        for tool_choice in ("auto", None):
            kw = {} if tool_choice is None else {"tool_choice": tool_choice}
            with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
                plain.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=5, **kw)
        r = plain.chat.completions.create(
            model=MODEL, messages=USER, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=200, temperature=0
        )
        _assert_valid_calls(r.choices[0].message.tool_calls)
    finally:
        server.stop()


def test_exclude_tools_when_tool_choice_none(tools_model_dir):
    """--exclude-tools-when-tool-choice-none (vLLM's flag): an explicit tool_choice none renders the prompt without
    the tools (so a small model answers from a tool result); auto still renders them; a schema no backend takes is
    no reason to refuse either (nothing is forced)."""
    server = start_server(
        tools_model_dir,
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
        exclude_tools_when_tool_choice_none=True,
    )
    try:
        client = sdk(server)
        plain = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=5, temperature=0)
        none = client.chat.completions.create(
            model=MODEL, messages=USER, tools=TOOLS, tool_choice="none", max_tokens=5, temperature=0
        )
        auto = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=5, temperature=0)
        assert none.usage.prompt_tokens == plain.usage.prompt_tokens
        assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 200
        assert none.choices[0].message.content == plain.choices[0].message.content
        bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]
        answer = client.chat.completions.create(
            model=MODEL, messages=USER, tools=bad, tool_choice="none", max_tokens=5, temperature=0
        )
        assert answer.choices[0].message.content == plain.choices[0].message.content
    finally:
        server.stop()


def test_tool_flags_are_checked_at_start():
    from kvserve.server.context import ServerSettings

    with pytest.raises(ValueError, match="requires --tool-call-parser"):
        ServerSettings(served_model_names=("m",), enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="hermes"):
        ServerSettings(served_model_names=("m",), tool_call_parser="nope")


def test_a_reply_that_ends_at_once_has_empty_content_with_tools_as_without(tools_client):
    """#43 item 10: a reply with tools that ended at once had `content: null` where one without tools has "" (OpenAI
    leaves content null only beside tool calls)."""
    kw = dict(model=MODEL, messages=USER, max_tokens=5, extra_body={"structured_outputs": {"choice": [""]}})
    plain = tools_client.chat.completions.create(**kw)
    with_tools = tools_client.chat.completions.create(**kw, tools=TOOLS)
    assert plain.choices[0].message.content == "" == with_tools.choices[0].message.content
    assert with_tools.choices[0].message.tool_calls is None and with_tools.choices[0].finish_reason == "stop"


def scripted(text: str) -> dict:
    """extra_body that makes the reply exactly `text` (a one-string choice; this tokenizer has a token a character)."""
    return {"structured_outputs": {"choice": [text]}}


NOT_CALLS = {
    # #43 item 11: arguments that are not one strict JSON object (the first is what the instruct model writes)
    "bare word": '<tool_call>{"name": "get_weather", "arguments": {"city": Paris}}</tool_call>',
    "trailing comma": '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris",}}</tool_call>',
    "single quotes": '<tool_call>{"name": "get_weather", "arguments": {\'city\': \'Paris\'}}</tool_call>',
    "NaN": '<tool_call>{"name": "get_weather", "arguments": {"days": NaN}}</tool_call>',
    "a string": '<tool_call>{"name": "get_weather", "arguments": "Paris"}</tool_call>',
    "two objects": '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}{"city": "Rome"}}</tool_call>',
    # #43 item 12: tools the request never offered
    "not offered": '<tool_call>{"name": "delete_all_files", "arguments": {}}</tool_call>',
    "a path": '<tool_call>{"name": "../../etc/passwd", "arguments": {}}</tool_call>',
}


@pytest.mark.parametrize("text", NOT_CALLS.values(), ids=NOT_CALLS.keys())
def test_a_call_that_is_not_one_stays_content(tools_client, text):
    """The hermes parser returned each of these as a call with finish_reason "tool_calls"; it is content, whole and
    streamed alike (vLLM returns the first six as calls; the last two too)."""
    kw = dict(model=MODEL, messages=USER, tools=TOOLS, max_tokens=200, extra_body=scripted(text))
    assert _whole(tools_client.chat.completions.create(**kw)) == (text, [], "stop")
    content, calls, finish, _ = _streamed(tools_client, **kw)
    assert (content, calls, finish) == (text, [], "stop")


def test_a_strict_function_gets_only_calls_its_schema_accepts(tools_client):
    """#43 item 11: with `strict: true` a call read from free text validates against the function's schema."""
    strict = {**WEATHER_TOOL, "function": {**WEATHER_TOOL["function"], "strict": True}}
    call = '<tool_call>{{"name": "get_weather", "arguments": {{"city": "Paris", "unit": "c", "days": {}}}}}</tool_call>'
    kw = dict(model=MODEL, messages=USER, tools=[strict], max_tokens=200)
    assert _whole(tools_client.chat.completions.create(**kw, extra_body=scripted(call.format(9))))[1] == []
    accepted = _whole(tools_client.chat.completions.create(**kw, extra_body=scripted(call.format(2))))
    assert accepted[1] == [("get_weather", '{"city": "Paris", "unit": "c", "days": 2}')]
    unstrict = _whole(
        tools_client.chat.completions.create(**{**kw, "tools": TOOLS}, extra_body=scripted(call.format(9)))
    )
    assert unstrict[1] == [("get_weather", '{"city": "Paris", "unit": "c", "days": 9}')]  # as OpenAI: unchecked


def test_a_strict_schema_kvserve_cannot_check_is_a_400(tools_client):
    parameters = {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters, "strict": True}}
    with pytest.raises(openai.BadRequestError, match=r"tools\[0\]\.function\.parameters.*'not'"):
        tools_client.chat.completions.create(model=MODEL, messages=USER, tools=[tool], max_tokens=2)


def test_the_pythonic_parser_returns_only_offered_calls_with_strict_json(tools_model_dir):
    """#43 items 11 and 12 on a `--tool-call-parser pythonic` server: Infinity (1e999), a keyword given twice, a
    positional argument (it became `{}`) and a function never offered are content; a good call is a call, whole."""
    server = start_server(tools_model_dir, enable_auto_tool_choice=True, tool_call_parser="pythonic")
    try:
        client = sdk(server)
        kw = dict(model=MODEL, messages=USER, tools=TOOLS, max_tokens=200)
        for text in (
            '[get_weather(city="Paris", unit="c", days=1e999)]',
            '[get_weather(city="Paris", city="Rome", unit="c", days=1)]',
            '[get_weather("Paris")]',
            "[delete_all_files()]",
        ):
            assert _whole(client.chat.completions.create(**kw, extra_body=scripted(text))) == (text, [], "stop")
            content, calls, finish, _ = _streamed(client, **kw, extra_body=scripted(text))
            assert (content, calls, finish) == (text, [], "stop")
        good = '[get_time(zone="UTC")]'
        r = client.chat.completions.create(**kw, extra_body=scripted(good))
        assert _whole(r) == (None, [("get_time", '{"zone": "UTC"}')], "tool_calls")
    finally:
        server.stop()
