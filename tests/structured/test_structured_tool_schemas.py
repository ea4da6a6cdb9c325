"""tools + tool_choice -> the forcing schema (vLLM's shapes), forced output -> calls, and clear errors."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from structured_support import walk

from kvserve.structured.backend import GrammarCompileError, GrammarCompileLimit
from kvserve.structured.params import StructuredOutputsParams
from kvserve.structured.schema_check import used_keywords, without_keywords
from kvserve.structured.tool_schemas import (
    ForcedGrammar,
    ForcedToolCall,
    compile_forced,
    compile_tool_choice,
    parse_forced_tool_calls,
    parse_tools,
    tool_choice_params,
    tool_choice_schema,
)

WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 5}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD: dict[str, Any] = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"$ref": "#/$defs/digit"}},
    "required": ["a", "b"],
    "$defs": {"digit": {"type": "integer", "minimum": 0, "maximum": 9}},
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
    {"type": "function", "function": {"name": "ping"}},  # no parameters: an empty object
]


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def test_none_and_auto_force_nothing() -> None:
    assert tool_choice_schema(TOOLS, "none") is None
    assert tool_choice_schema(TOOLS, "auto") is None
    assert tool_choice_schema(None, None) is None
    assert tool_choice_params(TOOLS, "auto") is None


def test_named_choice_forces_the_arguments_object() -> None:
    assert tool_choice_schema(TOOLS, named("get_weather")) == WEATHER
    assert tool_choice_schema(TOOLS, named("ping")) == {"type": "object", "properties": {}}
    params = tool_choice_params(TOOLS, named("add"), disable_any_whitespace=True)
    assert params == StructuredOutputsParams(json=ADD, disable_any_whitespace=True)


def test_required_schema_accepts_calls_and_rejects_others() -> None:
    schema = tool_choice_schema(TOOLS, "required")
    assert schema is not None and schema["minItems"] == 1 and "maxItems" not in schema
    assert schema["$defs"] == {"digit": ADD["$defs"]["digit"]}
    good = [
        {"name": "add", "parameters": {"a": 1, "b": 2}},
        {"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}},
        {"name": "ping", "parameters": {}},
    ]
    jsonschema.validate(good, schema)
    for bad in (
        [],
        [{"name": "add", "parameters": {"a": 1, "b": 20}}],
        [{"name": "nope", "parameters": {}}],
        [{"name": "add"}],
        [{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "k"}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = tool_choice_schema(TOOLS, "required", parallel_tool_calls=False)
    assert single is not None and single["maxItems"] == 1


def test_definitions_are_hoisted_and_conflicts_refused() -> None:
    draft7 = {
        "type": "object",
        "properties": {"p": {"$ref": "#/definitions/pt"}},
        "required": ["p"],
        "definitions": {"pt": {"type": "integer"}},
    }
    tools = [{"type": "function", "function": {"name": "f", "parameters": draft7}}]
    schema = tool_choice_schema(tools, "required")
    assert schema is not None
    jsonschema.validate([{"name": "f", "parameters": {"p": 3}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "f", "parameters": {"p": "x"}}], schema)
    clash = {"type": "object", "$defs": {"digit": {"type": "string"}}}
    tools = [*TOOLS, {"type": "function", "function": {"name": "g", "parameters": clash}}]
    with pytest.raises(ValueError, match=r"tools\[3\]\.function\.parameters\.\$defs\.digit: another tool defines"):
        tool_choice_schema(tools, "required")


@pytest.mark.parametrize(
    "tools, choice, message",
    [
        (TOOLS, named("missing"), "tool_choice: function 'missing' is not in tools (tools: get_weather, add, ping)"),
        (TOOLS, "sometimes", "tool_choice must be 'none', 'auto', 'required' or a named function"),
        (TOOLS, {"type": "function", "function": {}}, "tool_choice.function.name must be a non-empty string"),
        (TOOLS, {"type": "code"}, "tool_choice must be"),
        ([], "required", "tool_choice 'required' needs at least one tool"),
        ("tools", "auto", "tools must be a list"),
        ([{"type": "retrieval"}], "auto", "tools[0].type must be 'function'"),
        ([{"type": "function"}], "auto", "tools[0].function must be an object"),
        ([{"type": "function", "function": {"name": ""}}], "auto", "tools[0].function.name must be a non-empty string"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": "{}"}}],
            "auto",
            "tools[0].function.parameters must be a JSON schema object",
        ),
    ],
)
def test_bad_tools_and_choices_are_value_errors(tools: object, choice: object, message: str) -> None:
    with pytest.raises(ValueError) as e:
        tool_choice_schema(tools, choice)  # type: ignore[arg-type]
    assert message in str(e.value)


def test_parse_tools_keeps_order_and_defaults() -> None:
    parsed = parse_tools(TOOLS)
    assert [t.name for t in parsed] == ["get_weather", "add", "ping"]
    assert parsed[2].parameters == {"type": "object", "properties": {}} and parsed[1].field.startswith("tools[1]")


@pytest.mark.parametrize("name", ["xgrammar", "guidance"])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_walks_parse_into_valid_calls(tiny_backends: dict, name: str, choice: str) -> None:
    backend = tiny_backends[name]
    tool_choice = named("get_weather") if choice == "named" else "required"
    grammar = compile_tool_choice(backend, TOOLS, tool_choice, disable_any_whitespace=True)
    assert grammar is not None
    schemas = {"get_weather": WEATHER, "add": ADD, "ping": {"type": "object", "properties": {}}}
    for seed in range(4):
        tokens, done, _ = walk(backend, grammar, seed)
        text = "".join(backend.vocab.raw.id_to_token(t) or "" for t in tokens)
        assert done, text
        calls = parse_forced_tool_calls(text, tool_choice)
        assert calls and all(isinstance(c, ForcedToolCall) for c in calls)
        for call in calls:
            if choice == "named":
                assert call.name == "get_weather"
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def test_parse_forced_output_errors() -> None:
    with pytest.raises(ValueError, match="not complete JSON"):
        parse_forced_tool_calls('[{"name": "add", "param', "required")
    with pytest.raises(ValueError, match="not a JSON array"):
        parse_forced_tool_calls("{}", "required")
    with pytest.raises(ValueError, match="forces no tool call"):
        parse_forced_tool_calls("[]", "auto")
    assert parse_forced_tool_calls(' {"city": "x"} ', named("get_weather")) == [
        ForcedToolCall("get_weather", '{"city": "x"}')
    ]


@pytest.mark.parametrize("name", ["xgrammar", "guidance"])
def test_a_schema_the_backend_refuses_names_its_tool(tiny_backends: dict, name: str) -> None:
    broken = {"type": "object", "properties": {"x": {"type": "not-a-type"}}}
    tools = [*TOOLS, {"type": "function", "function": {"name": "broken", "parameters": broken}}]
    with pytest.raises(GrammarCompileError, match=r"^tools\[3\]\.function\.parameters: invalid JSON schema: "):
        compile_tool_choice(tiny_backends[name], tools, "required")
    with pytest.raises(GrammarCompileError, match=r"^tools\[3\]\.function\.parameters: "):
        compile_tool_choice(tiny_backends[name], tools, named("broken"))
    assert compile_tool_choice(tiny_backends[name], tools, "auto") is None


# -- a forced call's schema keywords the backend lacks --------------------------------------------------------------

RECORD: dict[str, Any] = {
    "type": "object",
    "properties": {
        # a property *named* like a keyword stays; the keyword goes, at every depth
        "propertyNames": {"type": "string"},
        "labels": {
            "type": "object",
            "propertyNames": {"pattern": "^[a-z]+$"},
            "additionalProperties": {"type": "integer"},
        },
        "list": {"type": "array", "items": {"type": "object", "propertyNames": {"type": "string"}}},
    },
    "required": ["labels"],
}


def test_without_keywords_drops_the_keyword_not_a_property_of_that_name() -> None:
    relaxed = without_keywords(RECORD, frozenset({"propertyNames"}))
    assert set(relaxed["properties"]) == {"propertyNames", "labels", "list"}
    assert relaxed["properties"]["labels"] == {"type": "object", "additionalProperties": {"type": "integer"}}
    assert relaxed["properties"]["list"]["items"] == {"type": "object"}
    assert RECORD["properties"]["labels"]["propertyNames"]  # the request's schema is not changed in place
    assert used_keywords(RECORD, frozenset({"propertyNames", "not"})) == ("propertyNames",)


def _accepts(backend: Any, grammar: Any, tokenizer: Any, value: object) -> bool:
    """Whether the grammar takes `value` as json.dumps writes it, to the end (the character tokenizer: one token a
    character)."""
    matcher = backend.matcher(grammar)
    for ch in json.dumps(value):
        if not matcher.accept_token(tokenizer.token_to_id(ch)):
            return False
    return bool(matcher.accept_token(tokenizer.eos_token_id))


@pytest.mark.parametrize("name", ["xgrammar", "guidance", "auto"])
def test_compile_forced_leaves_out_only_what_the_backend_lacks(tiny_backends: dict, tiny_tokenizer, name: str) -> None:
    """Each backend refuses `propertyNames` (xgrammar would not enforce it, llguidance has not implemented it):
    compile_forced compiles the schema without it and reports it; the rest (the integer values) is still enforced."""
    backend = tiny_backends[name]
    params = StructuredOutputsParams(json=RECORD, disable_any_whitespace=True)
    with pytest.raises(GrammarCompileError) as refused:
        backend.compile(params)
    assert "propertyNames" in refused.value.unsupported
    forced = compile_forced(backend.compile, params)
    assert forced.ignored == ("propertyNames",)
    grammar = backend.compile(forced.params)
    assert _accepts(backend, grammar, tiny_tokenizer, {"labels": {"a": 1}})
    assert not _accepts(backend, grammar, tiny_tokenizer, {"labels": {"a": "x"}})


def test_compile_forced_relaxes_nothing_else() -> None:
    """A refusal that names no missing keyword, or a budget, raises as it was; a constraint that compiles is kept."""
    params = StructuredOutputsParams(json=RECORD)
    calls: list[StructuredOutputsParams] = []

    def refuse(error: GrammarCompileError):
        def compile_one(p: StructuredOutputsParams) -> None:
            calls.append(p)
            raise error

        return compile_one

    with pytest.raises(GrammarCompileError, match="bad type"):
        compile_forced(refuse(GrammarCompileError("f", "invalid JSON schema", "bad type")), params)
    with pytest.raises(GrammarCompileLimit):
        compile_forced(refuse(GrammarCompileLimit("f", "too large", "x", ("propertyNames",))), params)
    assert len(calls) == 2
    assert compile_forced(lambda p: None, params) == ForcedGrammar(params, ())
