"""POST /v1/messages through the anthropic SDK (its own types parse every object and event) on the tiny tools server:
plain and streamed replies equal to the chat path's, system blocks, the typed event stream in order, forced tool use
and the tool_use -> tool_result loop, cache_control usage that adds up to count_tokens, and 400s in Anthropic's
shape for what kvserve refuses."""

from __future__ import annotations

import json
import uuid

import anthropic
import httpx
import openai
import pytest
from server_support import RunningServer, make_engine
from tool_server_support import MODEL, TOOLS_TEMPLATE, WEATHER_TOOL, start_server

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.server.app import build_app
from kvserve.server.context import ServerSettings

WEATHER = {
    "name": "get_weather",
    "description": WEATHER_TOOL["function"]["description"],
    "input_schema": WEATHER_TOOL["function"]["parameters"],
}
HI = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def client(tools_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=tools_server.base_url, api_key="unused", max_retries=0, timeout=60)


GREEDY = {"temperature": 0}  # the SDK has no sampling arguments any more; the API (and kvserve) still takes them


def salt() -> dict[str, object]:
    """Greedy, under a fresh cache salt: this request's prefix was never cached before."""
    return GREEDY | {"cache_salt": uuid.uuid4().hex}


def test_plain_reply_equals_chat_and_is_counted(client, tools_client):
    kw = dict(model=MODEL, max_tokens=8, system="Be brief.", messages=HI)
    first = client.messages.create(**kw, extra_body=salt())
    assert first.type == "message" and first.role == "assistant" and first.id.startswith("msg_")
    assert first.stop_reason == "max_tokens" and first.stop_sequence is None
    assert [b.type for b in first.content] == ["text"]
    chat = tools_client.chat.completions.create(
        model=MODEL, max_tokens=8, extra_body=GREEDY, messages=[{"role": "system", "content": "Be brief."}, *HI]
    )
    assert first.content[0].text == chat.choices[0].message.content  # the same prompt, greedy
    assert first.usage.output_tokens == 8
    assert first.usage.cache_read_input_tokens == first.usage.cache_creation_input_tokens == 0  # no breakpoint
    count = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=HI)
    assert first.usage.input_tokens == count.input_tokens == chat.usage.prompt_tokens


def test_stream_events_in_order_and_equal_to_the_whole(client):
    kw = dict(model=MODEL, max_tokens=12, extra_body=GREEDY, messages=HI)
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events if e.type not in ("text",)]  # "text" is the SDK's own convenience event
    assert kinds[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    deltas = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert deltas == final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason == "max_tokens"
    assert final.usage.output_tokens == whole.usage.output_tokens == 12
    start = next(e for e in events if e.type == "message_start")
    assert start.message.usage.input_tokens + start.message.usage.cache_read_input_tokens == (
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    )  # the prompt is counted at message_start already


def test_stop_sequences_name_the_one_that_matched(client):
    whole = client.messages.create(model=MODEL, max_tokens=40, extra_body=GREEDY, messages=HI)
    text = whole.content[0].text
    stop = text[3:5]
    cut = client.messages.create(model=MODEL, max_tokens=40, extra_body=GREEDY, messages=HI, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]


def test_forced_tool_use_and_the_tool_result_loop(client):
    kw = dict(model=MODEL, max_tokens=200, extra_body=GREEDY, tools=[WEATHER])
    ask = [{"role": "user", "content": "weather?"}]
    first = client.messages.create(**kw, messages=ask, tool_choice={"type": "tool", "name": "get_weather"})
    assert first.stop_reason == "tool_use"
    use = next(b for b in first.content if b.type == "tool_use")
    assert use.name == "get_weather" and use.input["city"] in ("Paris", "Rome", "Oslo")
    with client.messages.stream(**kw, messages=ask, tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    pieces = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    streamed = next(b for b in final.content if b.type == "tool_use")
    assert json.loads(pieces) == streamed.input == use.input
    loop = [
        *ask,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": '{"temp": 18}'}]},
    ]
    second = client.messages.create(**kw | {"max_tokens": 5}, messages=loop, tool_choice={"type": "none"})
    assert second.content[0].type == "text" and second.stop_reason == "max_tokens"
    count = client.messages.count_tokens(model=MODEL, messages=loop, tools=[WEATHER], tool_choice={"type": "none"})
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == count.input_tokens


def test_any_tool_choice_calls_a_tool(client):
    reply = client.messages.create(
        model=MODEL, max_tokens=200, extra_body=GREEDY, tools=[WEATHER], messages=HI, tool_choice={"type": "any"}
    )
    assert reply.stop_reason == "tool_use" and reply.content[-1].type == "tool_use"


def test_cache_control_usage_adds_up(client, tools_server):
    """A breakpoint at the end of the system blocks: the first request writes the whole blocks before it, the second
    reads them; input + cache read + cache creation is count_tokens every time."""
    system = [
        {"type": "text", "text": "You are a careful assistant who answers in one line."},
        {"type": "text", "text": "Never use tools.", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
    ]
    kw = dict(model=MODEL, max_tokens=4, system=system, messages=HI)
    block = tools_server.engine.facts.block_size
    count = client.messages.count_tokens(model=MODEL, system=system, messages=HI).input_tokens
    key = salt()
    first = client.messages.create(**kw, extra_body=key)
    u = first.usage
    assert u.cache_read_input_tokens == 0 and u.cache_creation_input_tokens > 0
    assert u.cache_creation_input_tokens % block == 0 and u.cache_creation.ephemeral_1h_input_tokens == (
        u.cache_creation_input_tokens
    )
    assert u.input_tokens + u.cache_creation_input_tokens == count
    second = client.messages.create(**kw, extra_body=key).usage
    assert second.cache_read_input_tokens >= u.cache_creation_input_tokens and second.cache_creation_input_tokens == 0
    assert second.input_tokens + second.cache_read_input_tokens == count
    with client.messages.stream(**kw, extra_body=salt()) as stream:
        streamed = stream.get_final_message().usage
    assert streamed.cache_creation_input_tokens == u.cache_creation_input_tokens


@pytest.mark.parametrize(
    "change,field",
    [
        (
            {"system": [{"type": "text", "text": "x", "cache_control": {"type": "persistent"}}]},
            "system[0].cache_control",
        ),
        ({"system": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "2h"}}]}, "ttl"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": str(i), "cache_control": {"type": "ephemeral"}} for i in range(5)
                        ],
                    }
                ]
            },
            "at most 4",
        ),
        (
            {
                "system": [
                    {"type": "text", "text": "a", "cache_control": {"type": "ephemeral", "ttl": "5m"}},
                    {"type": "text", "text": "b", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
                ]
            },
            "1h",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "'image'"),
        ({"messages": [*HI, {"role": "assistant", "content": "Sure"}]}, "prefill"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search_20250305"),
        ({"tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ],
)
def test_refused_in_anthropics_shape(client, change, field):
    body = dict(model=MODEL, max_tokens=4, messages=HI) | change
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(**body)
    error = refused.value.body["error"]
    assert error["type"] == "invalid_request_error" and field in error["message"], error


def test_top_level_cache_control_marks_the_last_block(client, tools_server):
    """Automatic caching (a top-level cache_control): the whole blocks up to the end of the last message are written,
    so the next turn reads them."""
    block = tools_server.engine.facts.block_size
    key = salt()
    turn = [{"role": "user", "content": "a longer question about the weather in three cities"}]
    kw = dict(model=MODEL, max_tokens=4, messages=turn, cache_control={"type": "ephemeral"})
    first = client.messages.create(**kw, extra_body=key).usage
    assert first.cache_creation_input_tokens >= 3 * block and first.cache_creation.ephemeral_5m_input_tokens > 0
    # the rest: past the message's last whole block, the template's reply header (one token a character here)
    assert first.input_tokens < len("\n<assistant>") + block
    second = client.messages.create(**kw, extra_body=key).usage
    assert second.cache_read_input_tokens >= first.cache_creation_input_tokens


def test_output_config_format_constrains_the_reply(client):
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}
    reply = client.messages.create(
        model=MODEL,
        max_tokens=60,
        messages=HI,
        output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body=GREEDY,
    )
    assert json.loads(reply.content[0].text)["city"] in ("Paris", "Rome")


@pytest.fixture(scope="module")
def small_pool(tools_model_dir):
    """The tools model on a pool of 96 blocks of 16 tokens (1,536 tokens): four other users' prompts evict every
    unpinned block."""
    engine = make_engine(tools_model_dir, chat_template=TOOLS_TEMPLATE, num_gpu_blocks_override=96, block_size=16)
    async_engine = AsyncLLMEngine(engine)
    server = RunningServer(build_app(async_engine, ServerSettings(served_model_names=(MODEL,))), async_engine).start()
    yield server, anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    server.stop()


def test_cache_control_pins_survive_pressure_that_evicts_the_rest(small_pool):
    """A system prompt marked with cache_control is served from the cache after other users' prompts filled the pool;
    the same prompt unmarked (another salt, so nothing is shared) is recomputed. Counted in hits, never timed."""
    server, client = small_pool
    system = "".join(chr(ord("a") + i % 26) for i in range(480))  # 30 blocks

    def ask(marked: bool, key: dict[str, object]) -> anthropic.types.Usage:
        block: dict[str, object] = {"type": "text", "text": system}
        if marked:
            block["cache_control"] = {"type": "ephemeral"}
        return client.messages.create(model=MODEL, max_tokens=2, system=[block], messages=HI, extra_body=key).usage

    def flood() -> None:
        for n in range(4):
            text = "".join(chr(ord("A") + (i * (n + 3)) % 26) for i in range(900))
            client.messages.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": text}])

    pinned, unpinned = salt(), salt()
    first = ask(True, pinned)
    assert first.cache_creation_input_tokens >= 480 - 16
    ask(False, unpinned)
    flood()
    assert ask(False, unpinned).cache_read_input_tokens == 0  # evicted
    again = ask(True, pinned)
    assert again.cache_read_input_tokens == first.cache_creation_input_tokens  # the pinned blocks, all of them
    assert again.cache_creation_input_tokens == 0
    pins = server.engine.core.kv_manager.pins  # read between requests: the engine is idle
    assert len(pins.pins) == 1 and pins.stats.refreshed >= 1
    metrics = httpx.get(f"{server.base_url}/metrics").text
    assert f'kvserve:kv_pinned_prefixes{{model_name="{MODEL}"}} 1.0' in metrics
    assert f'kvserve:kv_pinned_blocks{{model_name="{MODEL}"}} 30.0' in metrics
    assert f'kvserve:kv_pins_created_total{{model_name="{MODEL}"}} 1.0' in metrics
    (shown,) = httpx.get(f"{server.base_url}/v1/kv/snapshot").json()["pins"]  # the KV inspector
    assert shown["num_tokens"] == 480 and len(shown["block_ids"]) == 30 and 0 < shown["expires_in_s"] <= 300


def test_the_response_says_what_became_of_its_pins(small_pool):
    """include_kv_cache: each mark's pin, pinned, refreshed, or refused when larger than the budget alone (48 of the
    96 blocks here), in the whole reply and in a stream's message_delta."""
    _, client = small_pool
    key = salt() | {"include_kv_cache": True}

    def ask(text: str, **kw: object) -> anthropic.types.Message:
        system = [{"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}]
        return client.messages.create(model=MODEL, max_tokens=1, system=system, messages=HI, extra_body=key, **kw)

    text = "".join(chr(ord("a") + i % 23) for i in range(200))
    first = ask(text).model_extra["kv_cache"]["pins"]
    assert [p["outcome"] for p in first] == ["pinned"] and first[0]["num_tokens"] == 208  # 13 whole blocks
    assert [p["outcome"] for p in ask(text).model_extra["kv_cache"]["pins"]] == ["refreshed"]
    huge = "".join(chr(ord("a") + i % 19) for i in range(1000))  # 62 blocks > 48
    assert [p["outcome"] for p in ask(huge).model_extra["kv_cache"]["pins"]] == ["refused"]
    other = "".join(chr(ord("b") + i % 17) for i in range(200))  # a new prefix; a reply of 4 tokens
    system = [{"type": "text", "text": other, "cache_control": {"type": "ephemeral"}}]
    body = key | {"ignore_eos": True}
    with client.messages.stream(model=MODEL, max_tokens=4, system=system, messages=HI, extra_body=body) as stream:
        events = list(stream)
    # The pins are known once the request finished: in the last report (message_delta). The first (message_start) has
    # them too when the server read the request's outputs only after it finished (a consumer that falls behind gets
    # them as one), so it is not asserted on.
    delta = next(e for e in events if e.type == "message_delta").model_extra["kv_cache"]
    assert [p["outcome"] for p in delta["pins"]] == ["pinned"]


def test_cache_diagnostics_say_which_part_changed(client):
    """diagnostics.previous_message_id: null when a turn only appends, else the first part that differs, in prompt
    order; an unknown id, or another tenant's, is not found."""
    key = salt()
    system = "You answer in one line."
    kw = dict(model=MODEL, max_tokens=3, system=system)
    first = client.messages.create(**kw, messages=HI, diagnostics={"previous_message_id": None}, extra_body=key)
    assert first.diagnostics is None
    turn2 = [*HI, {"role": "assistant", "content": first.content[0].text}, {"role": "user", "content": "and?"}]
    second = client.messages.create(**kw, messages=turn2, diagnostics={"previous_message_id": first.id}, extra_body=key)
    assert second.diagnostics is None  # appended only
    previous = {"previous_message_id": second.id}

    def reason(**change):
        body = kw | {"messages": turn2} | change
        return client.messages.create(**body, diagnostics=previous, extra_body=key).diagnostics.cache_miss_reason

    changed = reason(system="You answer in two lines.")
    assert changed.type == "system_changed" and changed.cache_missed_input_tokens > 0
    assert reason(tools=[WEATHER], tool_choice={"type": "none"}).type == "tools_changed"
    edited = [{"role": "user", "content": "goodbye"}, *turn2[1:]]
    assert reason(messages=edited).type == "messages_changed"
    unknown = client.messages.create(
        **kw, messages=turn2, diagnostics={"previous_message_id": "msg_unknown"}, extra_body=key
    )
    assert unknown.diagnostics.cache_miss_reason.type == "previous_message_not_found"
    other_tenant = client.messages.create(**kw, messages=turn2, diagnostics=previous, extra_body=salt())
    assert other_tenant.diagnostics.cache_miss_reason.type == "previous_message_not_found"
    assert client.messages.create(**kw, messages=turn2, extra_body=key).diagnostics is None  # not asked
    streamed = kw | {"system": "Other.", "messages": turn2}
    with client.messages.stream(**streamed, diagnostics=previous, extra_body=key) as s:
        start = next(e for e in s if e.type == "message_start")
    assert start.message.diagnostics.cache_miss_reason.type == "system_changed"


def test_kv_cache_report_says_why_a_prompt_missed(client, tools_client, tools_server):
    """include_kv_cache: a cold prompt was never seen; the same prompt changed at one character diverged there (the
    text either side decoded from this request's own prompt); under another salt a client is told never_seen, and so
    is an open /metrics (the operator's, with the admin key, counts a different salt: test_tenant_isolation.py)."""
    key = salt() | {"include_kv_cache": True}
    base = "The quick brown fox jumps over the lazy dog, again and again and again. Then it rests."
    ask = lambda text, extra: tools_client.chat.completions.create(  # noqa: E731
        model=MODEL, max_tokens=1, messages=[{"role": "user", "content": text}], extra_body=extra
    )
    first = ask(base, key)
    report = first.model_extra["kv_cache"]
    assert report["miss"]["reason"] == "never_seen" and report["pool_tokens"] == 0
    assert report["computed_tokens"] == first.usage.prompt_tokens
    changed = base[:40] + "X" + base[41:]
    miss = ask(changed, key).model_extra["kv_cache"]["miss"]
    assert miss["reason"] == "diverged" and miss["after"].startswith("X") and base[32:40] in miss["before"]
    assert miss["at_token"] <= miss["diverged_at_token"] < miss["at_token"] + tools_server.engine.facts.block_size
    other = ask(base, salt() | {"include_kv_cache": True}).model_extra["kv_cache"]["miss"]
    assert other["reason"] == "never_seen"  # not "different_cache_salt": that is another tenant's business
    metrics = httpx.get(f"{tools_server.base_url}/metrics").text  # no admin key: a client may read it too
    assert f'kvserve:prefix_cache_miss_reasons_total{{model_name="{MODEL}",reason="never_seen"}}' in metrics
    assert (
        'reason="different_cache_salt"' not in metrics
    )  # the operator's, behind --admin-api-key (test_tenant_isolation.py)
    message = client.messages.create(
        model=MODEL, max_tokens=1, messages=[{"role": "user", "content": base}], extra_body=key
    )
    assert message.model_extra["kv_cache"]["pool_tokens"] > 0  # the chat's prompt, rendered the same
    with client.messages.stream(
        model=MODEL, max_tokens=1, messages=[{"role": "user", "content": changed}], extra_body=key
    ) as stream:
        start = next(e for e in stream if e.type == "message_start")
    assert start.message.model_extra["kv_cache"]["pool_tokens"] > 0


def test_completions_report_per_prompt(tools_client):
    extra = salt() | {"include_kv_cache": True}
    body = tools_client.completions.create(
        model=MODEL, prompt=["one prompt here", "another one"], max_tokens=1, extra_body=extra
    )
    reports = body.model_extra["kv_cache"]
    assert [r["miss"]["reason"] for r in reports] == ["never_seen", "never_seen"]
    with pytest.raises(openai.BadRequestError, match="include_kv_cache"):
        tools_client.completions.create(model=MODEL, prompt="x", max_tokens=1, stream=True, extra_body=extra)


def scripted(text: str) -> dict[str, object]:
    """extra_body that makes the reply exactly `text` (a one-string choice: one token a character here); vLLM's
    structured_outputs, taken by /v1/messages as by chat and the Responses API."""
    return GREEDY | {"structured_outputs": {"choice": [text]}}


CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c", "days": 1}}</tool_call>'
CALL_INPUT = {"city": "Paris", "unit": "c", "days": 1}


def final_message(client, stream: bool, **kw):
    if not stream:
        return client.messages.create(**kw)
    with client.messages.stream(**kw) as events:
        return events.get_final_message()


@pytest.mark.parametrize("stream", [False, True])
def test_blocks_come_in_the_order_the_model_wrote_them(client, stream):
    """A call, then text: the tool_use block first (the text block came first whatever the model wrote); a reply
    that ends by itself after its call says tool_use."""
    kw = dict(model=MODEL, max_tokens=400, tools=[WEATHER], messages=HI)
    reply = final_message(client, stream, **kw, extra_body=scripted(CALL + "Checking now."))
    assert [b.type for b in reply.content] == ["tool_use", "text"]
    assert reply.content[0].input == CALL_INPUT and reply.content[1].text == "Checking now."
    assert reply.stop_reason == "tool_use"
    before = final_message(client, stream, **kw, extra_body=scripted("Checking." + CALL))
    assert [b.type for b in before.content] == ["text", "tool_use"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_reply_cut_after_its_call_says_max_tokens(client, stream):
    """max_tokens cut the text after a complete call: stop_reason max_tokens, as Anthropic's (it said tool_use, chat's
    "tool_calls" for a parser that reports whole calls only)."""
    kw = dict(model=MODEL, max_tokens=len(CALL) + 4, tools=[WEATHER], messages=HI)
    reply = final_message(client, stream, **kw, extra_body=scripted(CALL + "Checking now."))
    assert reply.stop_reason == "max_tokens"
    assert [b.type for b in reply.content] == ["tool_use", "text"] and reply.content[1].text == "Chec"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}])
def test_a_forced_call_cut_by_max_tokens_is_a_partial_tool_use(client, choice, stream):
    """A forced call (tool_choice tool or any) cut by max_tokens was a 500 (its arguments are not a whole JSON
    object): 200 with stop_reason max_tokens and the partial block, its input what the cut arguments say so far."""
    kw = dict(model=MODEL, tools=[WEATHER], messages=HI, tool_choice=choice, extra_body=GREEDY)
    whole = client.messages.create(**kw, max_tokens=200)
    (use,) = [b for b in whole.content if b.type == "tool_use"]
    for max_tokens in (4, 12, 20):
        reply = final_message(client, stream, **kw, max_tokens=max_tokens)
        assert reply.stop_reason == "max_tokens"
        uses = [b for b in reply.content if b.type == "tool_use"]
        assert all(b.name == "get_weather" and isinstance(b.input, dict) for b in uses)
        for partial in uses:  # what it says is what the whole call says
            assert all(use.input[k] == v or str(use.input[k]).startswith(str(v)) for k, v in partial.input.items())


def test_a_null_cache_control_is_no_mark(client):
    """Anthropic's cache_control is optional and may be null (so may a mark's ttl): no mark, not a 400."""
    system = [{"type": "text", "text": "Be brief.", "cache_control": None}]
    messages = [{"role": "user", "content": [{"type": "text", "text": "hello there", "cache_control": None}]}]
    reply = client.messages.create(
        model=MODEL, max_tokens=2, system=system, messages=messages, extra_body=GREEDY | {"cache_control": None}
    )
    assert reply.usage.cache_creation_input_tokens == 0
    ttl_null = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral", "ttl": None}}]
    assert client.messages.create(model=MODEL, max_tokens=2, system=ttl_null, messages=HI).stop_reason


def test_the_prompt_caching_docs_example_runs_and_shows_the_cache(tools_server, capsys):
    """docs/PROMPT_CACHING.md's client example, as written but for the address and the model (the tiny one here): it
    once tripped on `temperature` (the SDK takes it in extra_body only) and its marked system prompt was shorter than
    a block, so it showed no cache creation."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "PROMPT_CACHING.md").read_text()
    code = re.findall(r"```python\n(.*?)```", text, re.S)[0]
    code = code.replace("http://127.0.0.1:8000", tools_server.base_url).replace("qwen2.5-coder-0.5b-instruct", MODEL)
    exec(compile(code, "PROMPT_CACHING.md", "exec"), {})
    out = capsys.readouterr().out
    (first_written, _), (second_written, second_read) = [
        tuple(map(int, row)) for row in re.findall(r"written to the cache: (\d+) read from it: (\d+)", out)
    ]
    # The first request writes the marked prefix (it may read a block another test's prompt shares with it, such as the
    # template's header: the server is shared); the second reads it all back and writes nothing.
    assert first_written > 0 and second_written == 0 and second_read >= first_written, out


# -- what Claude Code sends (issue 55) ----------------------------------------------------------------------------


def test_mid_conversation_system_messages_and_the_fields_that_change_nothing(client, tools_server):
    """Claude Code (for a model it does not know) puts a `role: "system"` message inside `messages`, and sends
    thinking, context_management, output_config.effort and metadata: a 200 rendered as the template allows (this
    one renders roles as turns: the system text is in the prompt, counted as count_tokens counts it), and a header
    naming the fields that changed nothing."""
    messages = [*HI, {"role": "system", "content": [{"type": "text", "text": "Agents: explore, plan."}]}]
    extra = {"context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}}
    raw = client.messages.with_raw_response.create(
        model=MODEL,
        max_tokens=4,
        messages=messages,
        thinking={"type": "adaptive"},
        metadata={"user_id": "u"},
        extra_body=GREEDY | extra | {"output_config": {"effort": "high"}},
    )
    assert raw.http_response.status_code == 200
    ignored = raw.headers["x-kvserve-ignored-fields"].split(", ")
    assert ignored == ["thinking", "context_management", "metadata", "output_config.effort"]
    reply = raw.parse()
    count = client.messages.count_tokens(model=MODEL, messages=messages, extra_body=extra)
    without = client.messages.count_tokens(model=MODEL, messages=HI)
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == count.input_tokens
    assert count.input_tokens >= without.input_tokens + len("Agents: explore, plan.")
    with pytest.raises(anthropic.BadRequestError, match="'user', 'assistant' or 'system'"):
        client.messages.create(model=MODEL, max_tokens=4, messages=[*HI, {"role": "tool", "content": "x"}])


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_beyond_the_context_fills_the_window(client, tools_server, stream):
    """Claude Code asks for max_tokens 32000 whatever its prompt: not a 400 (chat's rule), the reply generates until
    the context window is full and stops with Anthropic's model_context_window_exceeded."""
    max_model_len = tools_server.engine.facts.max_model_len
    long = [{"role": "user", "content": "x" * (max_model_len - 40)}]  # one token a character: about 20 tokens left
    kw = dict(model=MODEL, max_tokens=32000, messages=long, extra_body=GREEDY)
    if stream:
        with client.messages.stream(**kw) as events:
            reply = events.get_final_message()
    else:
        reply = client.messages.create(**kw)
    assert reply.stop_reason == "model_context_window_exceeded"
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens + reply.usage.output_tokens == max_model_len
    fits = client.messages.create(**kw | {"max_tokens": 3})
    assert fits.stop_reason == "max_tokens" and fits.usage.output_tokens == 3
    with pytest.raises(anthropic.BadRequestError) as too_long:
        client.messages.create(**kw | {"messages": [{"role": "user", "content": "x" * max_model_len}]})
    assert too_long.value.body["error"]["message"].startswith("messages: ")  # the prompt alone does not fit


def test_errors_name_anthropics_fields(client):
    """A forced call whose schema no backend compiles is a 400 naming the Messages field (tools[1].input_schema),
    never chat's tools[1].function.parameters; a stop sequence, Anthropic's stop_sequences."""
    bogus = {"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": "bogus"}}}}
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(
            model=MODEL, max_tokens=4, messages=HI, tools=[WEATHER, bogus], tool_choice={"type": "tool", "name": "f"}
        )
    message = refused.value.body["error"]["message"]
    assert message.startswith("tools[1].input_schema: invalid JSON schema") and "function" not in message, message
    auto = client.messages.create(model=MODEL, max_tokens=4, messages=HI, tools=[WEATHER, bogus], extra_body=GREEDY)
    assert auto.stop_reason in ("max_tokens", "end_turn", "tool_use")  # unforced: the schema only shapes the prompt


def _prompt_tokens(usage) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def test_server_tools_are_left_out_under_the_flag(tools_model_dir):
    """Anthropic's server tools run on Anthropic's servers: a 400 naming --ignore-unsupported-tools (the default,
    test_refused_in_anthropics_shape), and with the flag left out of the prompt, named in a header."""
    server = start_server(
        tools_model_dir, enable_auto_tool_choice=True, tool_call_parser="hermes", ignore_unsupported_tools=True
    )
    try:
        sdk = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
        search = {"type": "web_search_20250305", "name": "web_search"}
        raw = sdk.messages.with_raw_response.create(
            model=MODEL, max_tokens=4, messages=HI, tools=[search, WEATHER], extra_body=GREEDY
        )
        assert raw.headers["x-kvserve-ignored-tools"] == "tools[0] (web_search_20250305)"
        plain = sdk.messages.create(model=MODEL, max_tokens=4, messages=HI, tools=[WEATHER], extra_body=GREEDY)
        assert _prompt_tokens(raw.parse().usage) == _prompt_tokens(plain.usage)  # the same prompt: no search in it
    finally:
        server.stop()


@pytest.fixture(scope="module")
def truncating(tools_model_dir):
    """The tools model behind --chat-history-policy truncate with a 160-token context: long chats lose old turns."""
    engine = make_engine(
        tools_model_dir, chat_template=TOOLS_TEMPLATE, num_gpu_blocks_override=96, block_size=16, max_model_len=160
    )
    async_engine = AsyncLLMEngine(engine)
    settings = ServerSettings(served_model_names=(MODEL,), chat_history_policy="truncate")
    server = RunningServer(build_app(async_engine, settings), async_engine).start()
    yield server, anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    server.stop()


def test_marks_in_turns_the_truncate_policy_dropped_pin_nothing_of_another_prompt(truncating):
    """D6 (issue 54): mark positions were computed on the whole conversation, then --chat-history-policy truncate
    dropped old turns, so pins and the usage split pointed into another prompt: a mark on the first (dropped) turn
    pinned and counted blocks of the turns after it. Now a mark holds only the prefix the prompt sent still shares
    with the whole conversation: the system text survives, the dropped turn's mark says not_placed."""
    server, client = truncating
    system = [{"type": "text", "text": "S" * 40, "cache_control": {"type": "ephemeral"}}]
    first = {
        "role": "user",
        "content": [{"type": "text", "text": "q" * 60, "cache_control": {"type": "ephemeral", "ttl": "5m"}}],
    }
    later = []
    for i in range(4):
        later += [
            {"role": "assistant", "content": f"answer {i} " * 3},
            {"role": "user", "content": f"question {i} " * 3},
        ]
    key = salt() | {"include_kv_cache": True}
    raw = client.messages.with_raw_response.create(
        model=MODEL, max_tokens=1, system=system, messages=[first, *later], extra_body=key
    )
    assert int(raw.headers["X-Kvserve-Truncated-Turns"]) >= 1
    reply = raw.parse()
    pins = reply.model_extra["kv_cache"]["pins"]
    assert [p["outcome"] for p in pins] == ["pinned", "not_placed"]
    kept = server.engine.core.kv_manager.pins.pins
    (pin,) = kept.values()
    assert pin.num_tokens <= 48 + 16  # the system text's blocks (40 characters and the template's own), no more
    usage = reply.usage
    assert usage.cache_creation_input_tokens == pin.num_tokens
    assert usage.input_tokens + usage.cache_creation_input_tokens + usage.cache_read_input_tokens <= 160
