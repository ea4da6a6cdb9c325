"""Structured output through the real server and the real openai SDK, on a tiny random model (whose output is
valid only because the grammar makes it so): response_format json_object / json_schema, the SDK's
beta.chat.completions.parse, vLLM's structured_outputs and guided_* fields on both endpoints, streaming, and the
400s that name the field at fault."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from tool_server_support import COMPACT, MODEL

USER = [{"role": "user", "content": "Describe a cat as JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "indoor": {"type": "boolean"},
        "color": {"enum": ["black", "white", "tabby"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
    },
    "required": ["name", "age", "indoor", "color", "tags"],
    "additionalProperties": False,
}


def _json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "cat", "schema": schema, "strict": True}}


def test_json_object(tools_client):
    r = tools_client.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=300,
        temperature=1.0,
        seed=2,
        response_format={"type": "json_object"},
        extra_body=COMPACT,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content), dict)
    assert choice.message.tool_calls is None


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_json_schema_strict(tools_client, seed):
    r = tools_client.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=300,
        temperature=1.0,
        seed=seed,
        response_format=_json_schema_format(SCHEMA),
        extra_body=COMPACT,
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


class Cat(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=30)
    color: Literal["black", "white", "tabby"]
    indoor: bool


def test_sdk_parse_with_a_pydantic_model(tools_client):
    """beta.chat.completions.parse: the SDK sends the model's strict schema and parses the reply into it."""
    r = tools_client.beta.chat.completions.parse(
        model=MODEL, messages=USER, max_tokens=200, temperature=0, response_format=Cat, extra_body=COMPACT
    )
    cat = r.choices[0].message.parsed
    assert isinstance(cat, Cat) and cat.color in ("black", "white", "tabby")


def test_regex_choice_and_grammar(tools_client):
    def ask(extra: dict) -> str:
        r = tools_client.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=40, temperature=1.0, seed=3, extra_body=extra
        )
        assert r.choices[0].finish_reason == "stop"
        return r.choices[0].message.content

    assert ask({"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}}).__len__() == 6
    assert ask({"guided_regex": r"(yes|no)!"}) in ("yes!", "no!")
    assert ask({"structured_outputs": {"choice": ["red", "green", "blue"]}}) in ("red", "green", "blue")
    assert ask({"guided_choice": ["up", "down"]}) in ("up", "down")
    assert ask({"guided_grammar": 'root ::= "x" [0-9] [0-9]'})[0] == "x"
    assert ask({"structured_outputs": {"grammar": 'start: "a" | "b"'}}) in ("a", "b")


def test_completions_take_the_same_fields(tools_client):
    for extra in (
        {"guided_json": SCHEMA, **COMPACT},
        {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
        {"response_format": _json_schema_format(SCHEMA), **COMPACT},
    ):
        r = tools_client.completions.create(
            model=MODEL, prompt="A cat: ", max_tokens=300, temperature=0, extra_body=extra
        )
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    r = tools_client.completions.create(
        model=MODEL, prompt="Pick: ", max_tokens=10, temperature=0, extra_body={"guided_choice": ["one", "two"]}
    )
    assert r.choices[0].text in ("one", "two")


def test_response_format_streams_as_content(tools_client):
    """Streamed constrained output is ordinary content, and with the same seed it equals the non-streamed reply."""
    kw = dict(
        model=MODEL,
        messages=USER,
        max_tokens=300,
        temperature=1.0,
        seed=11,
        response_format=_json_schema_format(SCHEMA),
        extra_body=COMPACT,
    )
    whole = tools_client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(tools_client.chat.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(c.choices[0].delta.tool_calls is None for c in chunks if c.choices)


def test_unmet_within_max_tokens_is_length(tools_client):
    r = tools_client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=3, temperature=0, response_format=_json_schema_format(SCHEMA)
    )
    assert r.choices[0].finish_reason == "length"


def test_n_samples_each_follow_the_schema(tools_client):
    r = tools_client.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=300,
        temperature=1.0,
        seed=5,
        n=3,
        response_format=_json_schema_format(SCHEMA),
        extra_body=COMPACT,
    )
    assert len(r.choices) == 3
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


# -- 400s naming the field ----------------------------------------------------------------------------------------


def _error(tools_client, route: str = "chat", **body) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        if route == "chat":
            tools_client.chat.completions.create(model=MODEL, messages=USER, max_tokens=5, **body)
        else:
            tools_client.completions.create(model=MODEL, prompt="x", max_tokens=5, **body)
    return info.value


@pytest.mark.parametrize(
    "route,body,param,words",
    [
        (
            "chat",
            {"response_format": _json_schema_format({"type": "object", "properties": {"a": {"type": "nope"}}})},
            "response_format.json_schema.schema",
            "invalid JSON schema",
        ),
        (
            "chat",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
            "required",
        ),
        ("chat", {"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
        ("chat", {"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex", "invalid regex"),
        (
            "cmpl",
            {"extra_body": {"structured_outputs": {"regex": "[z-a]"}}},
            "structured_outputs.regex",
            "invalid regex",
        ),
        (
            "cmpl",
            {"extra_body": {"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}},
            "guided_json",
            "guided_json",
        ),
        ("chat", {"extra_body": {"guided_grammar": "root ::= undefined_rule"}}, "guided_grammar", "invalid grammar"),
        ("chat", {"extra_body": {"guided_choice": []}}, "guided_choice", "non-empty"),
        (
            "chat",
            {"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}},
            "guided_regex",
            "only one",
        ),
        (
            "chat",
            {"extra_body": {"structured_outputs": {"json": {}, "regex": "a"}}},
            "structured_outputs",
            "exactly one",
        ),
        ("chat", {"extra_body": {"structured_outputs": {"jsonn": {}}}}, "structured_outputs", "unknown"),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(tools_client, route, body, param, words):
    error = _error(tools_client, route, **body)
    assert error.body["param"] == param, error.body
    assert words in error.body["message"], error.body


def test_options_alone_constrain_nothing(tools_client):
    """As vLLM: structured_outputs options without a constraint change nothing (LangChain sends a model's
    extra_body with every request, plain ones too)."""
    for route in ("chat", "cmpl"):
        kw = dict(model=MODEL, max_tokens=4, temperature=0, extra_body=COMPACT)
        if route == "chat":
            r = tools_client.chat.completions.create(messages=USER, **kw)
        else:
            r = tools_client.completions.create(prompt="x", **kw)
        assert r.choices[0].finish_reason in ("stop", "length")


def test_server_keeps_serving_after_bad_constraints(tools_client):
    _error(tools_client, extra_body={"guided_regex": "("})
    r = tools_client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
