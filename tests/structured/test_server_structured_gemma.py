"""Structured output and forced tool calls on the default model (Gemma 3 270M, a base model) through the real
server and the openai SDK: 25 generated JSON schemas of varied shape, each reply that ends with "stop" valid
against its schema and at least 90% of them ending so; the SDK's parse with a pydantic model; tool_choice
required and named calls, grammar-forced, streamed equal to whole."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from tool_server_support import RunningServer

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.engine.engine import LLMEngine
from kvserve.server.app import build_app
from kvserve.server.context import ServerSettings

pytestmark = pytest.mark.real_model

MODEL = "gemma-3-270m"
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}


@pytest.fixture(scope="module")
def gemma_client(default_engine: LLMEngine) -> Iterator[openai.OpenAI]:
    engine = default_engine.sibling(kv_cache_memory_bytes=512 << 20, max_model_len=1024)
    async_engine = AsyncLLMEngine(engine)
    settings = ServerSettings(served_model_names=(MODEL,), enable_auto_tool_choice=True, tool_call_parser="pythonic")
    server = RunningServer(build_app(async_engine, settings), async_engine).start()
    yield openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    server.stop()


# -- 25 schemas of varied shape ------------------------------------------------------------------------------------

_NAMES = [
    "title",
    "city",
    "owner",
    "status",
    "score",
    "count",
    "tags",
    "price",
    "active",
    "code",
    "when",
    "kind",
    "items",
    "rating",
    "email",
    "level",
    "note",
    "size",
    "color",
    "id",
]


def _scalar(rng: random.Random) -> dict[str, Any]:
    return rng.choice(
        [
            {"type": "string", "maxLength": 16},
            {"type": "string", "minLength": 2, "maxLength": 10},
            {"type": "integer", "minimum": 0, "maximum": 1000},
            {"type": "number", "minimum": -5, "maximum": 5},
            {"type": "boolean"},
            {"enum": ["low", "medium", "high"]},
            {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
            {"const": "v1"},
            {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "string", "maxLength": 8}]},
            {"type": "string", "format": "date"},
            {"type": ["string", "null"], "maxLength": 12},
        ]
    )


def _value(rng: random.Random, depth: int) -> dict[str, Any]:
    kind = rng.random()
    if depth < 2 and kind < 0.2:
        return _object(rng, depth + 1, rng.randint(1, 3))
    if depth < 2 and kind < 0.35:
        low = rng.randint(0, 2)
        return {"type": "array", "items": _value(rng, depth + 1), "minItems": low, "maxItems": low + rng.randint(0, 2)}
    return _scalar(rng)


def _object(rng: random.Random, depth: int, size: int) -> dict[str, Any]:
    names = rng.sample(_NAMES, size)
    properties = {name: _value(rng, depth) for name in names}
    required = [n for n in names if rng.random() < 0.8] or names[:1]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def generated_schemas(count: int = 25, seed: int = 15) -> list[dict[str, Any]]:
    """`count` schemas: flat and nested objects, arrays with min/maxItems, enums, consts, patterns, formats, anyOf,
    nullable types, optional properties; every fifth one through $defs / $ref."""
    rng = random.Random(seed)
    schemas = []
    for i in range(count):
        schema = _object(rng, 0, rng.randint(2, 5))
        if i % 5 == 4:
            schema = {
                "$defs": {"Part": _object(rng, 1, 2)},
                "type": "object",
                "properties": {
                    "main": {"$ref": "#/$defs/Part"},
                    "extra": {"type": "array", "items": {"$ref": "#/$defs/Part"}, "maxItems": 2},
                },
                "required": ["main", "extra"],
                "additionalProperties": False,
            }
        schemas.append(schema)
    return schemas


def test_generated_schemas_are_valid(gemma_client):
    def ask(i_schema: tuple[int, dict[str, Any]]) -> tuple[str, str]:
        i, schema = i_schema
        r = gemma_client.chat.completions.create(
            model=MODEL,
            max_tokens=400,
            temperature=0.7,
            seed=i,
            messages=[{"role": "user", "content": "Write one realistic example record as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}},
            extra_body=COMPACT,
        )
        return r.choices[0].finish_reason, r.choices[0].message.content

    schemas = generated_schemas()
    assert len({json.dumps(s, sort_keys=True) for s in schemas}) == 25
    with ThreadPoolExecutor(len(schemas)) as pool:  # one batch in the engine
        replies = list(pool.map(ask, enumerate(schemas)))
    stopped = 0
    for schema, (finish, content) in zip(schemas, replies):
        if finish == "stop":
            jsonschema.validate(json.loads(content), schema)
            stopped += 1
    assert stopped >= 23, [r[0] for r in replies]  # at least 90%


class Movie(BaseModel):
    title: str = Field(max_length=40)
    year: int = Field(ge=1900, le=2030)
    genre: Literal["drama", "comedy", "action", "horror"]


def test_parse_with_a_pydantic_model(gemma_client):
    r = gemma_client.beta.chat.completions.parse(
        model=MODEL,
        max_tokens=100,
        temperature=0,
        response_format=Movie,
        extra_body=COMPACT,
        messages=[{"role": "user", "content": "Name a famous movie."}],
    )
    assert isinstance(r.choices[0].message.parsed, Movie)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_calls_on_the_default_model(gemma_client, tool_choice):
    # A base model left to itself repeats the call until max_tokens: one call (parallel_tool_calls false) ends it.
    kw = dict(
        model=MODEL,
        max_tokens=80,
        temperature=0,
        tools=[WEATHER],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        messages=[{"role": "user", "content": "What's the weather like in Paris?"}],
    )
    r = gemma_client.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    arguments = "".join(
        p.function.arguments or ""
        for c in gemma_client.chat.completions.create(stream=True, **kw)
        if c.choices
        for p in c.choices[0].delta.tool_calls or []
        if p.index == 0
    )
    assert arguments == call.function.arguments
