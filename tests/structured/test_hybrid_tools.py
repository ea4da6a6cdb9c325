"""Chat templates, tool calling and the Responses API on the hybrid models (LFM2's short convolutions, Qwen3.5's
Gated DeltaNet) through the real server and the openai SDK, as on a transformer: tiny random checkpoints of each
with the tool tests' Hermes-shaped template and the hermes parser. The models are random, so a forced call is valid
only because the grammar makes it so (the grammar's masks run beside the state layers, which cannot roll back); a
Responses chain's second turn takes its prefix from the first turn's state snapshot (cached tokens reported); and
every sequence slot and block is back in the pool at the end."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest
from tool_server_support import MAX_MODEL_LEN, MODEL, NAMED, SCHEMAS, TOOLS, TWO_HERMES_CALLS, USER, sdk, start_server

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "models"))
from tiny_models import build_tiny_hf_model
from tiny_tokenizer import write_char_tokenizer


@pytest.fixture(scope="module", params=["lfm2_hybrid", "qwen3_5_hybrid"])
def hybrid_server(request, tmp_path_factory) -> Iterator:  # type: ignore[no-untyped-def]
    path = tmp_path_factory.mktemp(request.param)
    build_tiny_hf_model(request.param, max_position_embeddings=MAX_MODEL_LEN).save_pretrained(path)
    write_char_tokenizer(path)
    server = start_server(path, enable_auto_tool_choice=True, tool_call_parser="hermes")
    assert server.engine.core.kv_manager.state_slots is not None, "the engine keeps states for this model"
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(hybrid_server) -> openai.OpenAI:  # type: ignore[no-untyped-def]
    return sdk(hybrid_server)


def test_a_named_tool_choice_is_a_valid_call_whole_and_streamed(client):
    whole = client.chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, tool_choice=NAMED, max_tokens=200, temperature=0
    )
    (call,) = whole.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and whole.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=USER, tools=TOOLS, tool_choice=NAMED, max_tokens=200, temperature=0, stream=True
        )
    )
    pieces = [p for c in chunks if c.choices for p in c.choices[0].delta.tool_calls or []]
    assert pieces[0].function.name == "get_weather"
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments


def test_auto_tool_choice_parses_the_calls_the_model_writes(client):
    r = client.chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, max_tokens=300, temperature=0, extra_body=TWO_HERMES_CALLS
    )
    calls = r.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert r.choices[0].finish_reason == "tool_calls"
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def test_a_responses_chain_calls_a_tool_and_hits_the_first_turns_state(client):
    weather = {"type": "function", **TOOLS[0]["function"]}
    first = client.responses.create(
        model=MODEL,
        input="Weather in Rome, please, for the next few days, in degrees Celsius.",
        tools=[weather],
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
    )
    call = next(o for o in first.output if o.type == "function_call")
    jsonschema.validate(json.loads(call.arguments), SCHEMAS["get_weather"])
    second = client.responses.create(
        model=MODEL,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 18}'}],
        previous_response_id=first.id,
        tools=[weather],
        tool_choice="none",
        max_output_tokens=5,
        temperature=0,
    )
    assert second.output[0].type == "message"
    assert second.usage.input_tokens > first.usage.input_tokens
    # The chain's prompt starts with the whole first prompt: its blocks and the state snapshot saved at its end (or
    # at its last block boundary: the tests' blocks are 4 tokens) are cached.
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 4


def test_every_slot_and_block_is_back_at_the_end(hybrid_server):
    core = hybrid_server.engine.core
    slots = core.kv_manager.state_slots
    assert slots.num_free == slots.num_slots
    assert core.pool.num_free_blocks == core.pool.num_usable_blocks
