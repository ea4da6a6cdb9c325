"""The check every free-text tool parser runs before it reports a call (#43 items 11 and 12): the function was
offered, its arguments are one strict JSON object, and a `strict` function's schema accepts them. The schema check
is compared with the `jsonschema` package (a test dependency only) on the keywords it takes."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvserve.structured.call_arguments import OfferedTools, strict_json, strict_json_object
from kvserve.structured.schema_validate import MAX_VISITS, is_valid, unchecked_keyword
from kvserve.structured.tool_calls import ToolCall, extract_all
from kvserve.structured.tool_parsers import HermesExtractor, PythonicExtractor
from kvserve.structured.tool_schemas import parse_tools

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        "at": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/time"}]},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
    "$defs": {"time": {"type": "object", "properties": {"h": {"type": "integer"}}, "required": ["h"]}},
}


@pytest.mark.parametrize(
    "value",
    [
        {"city": "Paris", "days": 3},
        {"city": "Paris", "days": 3.0},
        {"city": "Rome", "days": 7, "tags": ["a", "bcd"], "at": None},
        {"city": "Rome", "days": 1, "at": {"h": 9}},
        {"city": "Berlin", "days": 3},
        {"city": "Paris", "days": 8},
        {"city": "Paris", "days": "3"},
        {"city": "Paris", "days": True},
        {"city": "Paris", "days": 2.5},
        {"city": "Paris"},
        {"city": "Paris", "days": 3, "extra": 1},
        {"city": "Paris", "days": 3, "tags": ["abcd"]},
        {"city": "Paris", "days": 3, "tags": ["a", "b", "c"]},
        {"city": "Paris", "days": 3, "at": {"m": 1}},
        {"city": "Paris", "days": 3, "at": "noon"},
    ],
)
def test_the_schema_check_agrees_with_jsonschema(value):
    expected = jsonschema.Draft202012Validator(WEATHER).is_valid(value)
    assert is_valid(value, WEATHER) is expected


@pytest.mark.parametrize(
    "schema,value,expected",
    [
        ({"const": 1}, True, False),  # JSON's true is not 1 (Python's True == 1)
        ({"enum": [1]}, 1.0, True),
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, 1, False),
        ({"allOf": [{"minimum": 1}, {"maximum": 2}]}, 3, False),
        ({"prefixItems": [{"type": "string"}], "items": {"type": "integer"}}, ["a", 1, 2], True),
        ({"prefixItems": [{"type": "string"}], "items": {"type": "integer"}}, ["a", "b"], False),
        ({"multipleOf": 0.5}, 1.5, True),
        ({"exclusiveMaximum": 3}, 3, False),
        ({"minProperties": 2}, {"a": 1}, False),
        ({"properties": {"x": False}}, {"x": 1}, False),
        ({"$ref": "#/$defs/missing"}, 1, False),
        ({"maxLength": "3"}, "abcd", False),  # a malformed keyword fails, it never raises
    ],
)
def test_the_schema_check_keyword_by_keyword(schema, value, expected):
    assert is_valid(value, schema) is expected
    if schema.get("maxLength") != "3" and "missing" not in json.dumps(schema):
        assert jsonschema.Draft202012Validator(schema).is_valid(value) is expected


def test_a_self_referring_schema_cannot_make_the_check_run_on(monkeypatch):
    """Two `anyOf` branches that both fail only at the bottom double the work at every level: 2^40 visits here. The
    visit budget ends it: not valid, so the reply stays content (this test finishing is the proof)."""
    import kvserve.structured.schema_validate as validate

    schema = {"anyOf": [{"type": "array", "items": {"$ref": "#"}}, {"type": "array", "items": {"$ref": "#"}}]}
    deep = json.loads("[" * 40 + "1" + "]" * 40)
    assert is_valid(json.loads("[[[]]]"), schema) is True
    assert is_valid(deep, schema) is False
    monkeypatch.setattr(validate, "MAX_VISITS", 10)
    assert is_valid(json.loads("[[[[[[[[[[[]]]]]]]]]]]"), schema) is False  # valid, but past this budget
    assert MAX_VISITS == 100_000


@pytest.mark.parametrize("keyword", ["not", "if", "patternProperties", "uniqueItems", "dependentRequired"])
def test_a_strict_tool_whose_schema_cannot_be_checked_is_refused(keyword):
    parameters = {"type": "object", "properties": {"a": {"type": "string", keyword: {}}}}
    assert unchecked_keyword(parameters) == ("/properties/a", keyword)
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters, "strict": True}}
    with pytest.raises(ValueError, match=rf"tools\[0\]\.function\.parameters: .*'{keyword}'"):
        parse_tools([tool])
    parse_tools([{**tool, "function": {**tool["function"], "strict": False}}])  # without strict: as before
    with pytest.raises(ValueError, match="strict must be true or false"):
        parse_tools([{**tool, "function": {**tool["function"], "strict": "yes"}}])


@pytest.mark.parametrize(
    "text", ["NaN", "[Infinity]", '{"a": -Infinity}', "1e999", '{"a": 1, "a": 2}', '"\\ud800"', "[1,]", "{'a': 1}"]
)
def test_strict_json_refuses_what_parsers_disagree_on(text):
    with pytest.raises(ValueError):
        strict_json(text)


def test_strict_json_object_wants_one_object():
    assert strict_json_object(' {"a": [1, 2.5, "\\ud83d\\ude00"]} ') == {"a": [1, 2.5, "\U0001f600"]}
    assert strict_json_object("[]") is None and strict_json_object('{"a": 1} {"b": 2}') is None


def test_strict_functions_validate_their_calls():
    """#43 item 11: with `strict` set, a call whose arguments the schema refuses is content, in both parsers."""
    strict = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER, "strict": True}}
    lax = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
    offered = OfferedTools.of_functions(parse_tools([strict, lax]))
    assert offered.arguments("get_weather", ' {"city": "Paris", "days": 2} ') == '{"city": "Paris", "days": 2}'
    assert offered.arguments("get_weather", '{"city": "Berlin", "days": 2}') is None
    assert offered.arguments("now", '{"anything": [1]}') == '{"anything": [1]}'
    assert offered.arguments("later", "{}") is None
    good = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}</tool_call>'
    bad = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "days": 9}}</tool_call>'
    assert extract_all(HermesExtractor(offered), good).calls == [ToolCall("get_weather", '{"city": "Rome", "days": 1}')]
    assert extract_all(HermesExtractor(offered), bad).content == bad
    assert extract_all(PythonicExtractor(offered), '[get_weather(city="Rome", days=0)]').calls == []
