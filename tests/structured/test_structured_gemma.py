"""Both backends on the default model's Gemma 3 tokenizer (262,144 tokens, byte fallback, 6k special tokens)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from structured_support import allowed_ids, walk

from kvserve.structured.params import StructuredOutputsParams
from kvserve.structured.tool_schemas import compile_tool_choice, parse_forced_tool_calls

pytestmark = pytest.mark.real_model
BACKENDS = ("xgrammar", "guidance")
WIDTH = 262_144
STOPS = {1, 106}  # <eos>, <end_of_turn>

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "status": {"enum": ["active", "inactive", "pending"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
        },
        "verified": {"type": "boolean"},
    },
    "required": ["name", "age", "status", "tags", "address", "verified"],
}


@pytest.mark.parametrize("name", BACKENDS)
def test_schema_walk_validates(gemma_backends: dict, gemma_tokenizer, name: str) -> None:
    backend = gemma_backends[name]
    grammar = backend.compile(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    for seed in range(2):
        tokens, done, _ = walk(backend, grammar, seed)
        text = gemma_tokenizer.decode(tokens)
        assert done, text
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("name", BACKENDS)
def test_special_tokens_never_allowed_and_stop_only_at_the_end(
    gemma_backends: dict, gemma_tokenizer, name: str
) -> None:
    backend = gemma_backends[name]
    schema = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}
    matcher = backend.matcher(backend.compile(StructuredOutputsParams(json=schema, disable_any_whitespace=True)))
    for token in gemma_tokenizer.encode('{"s": "', add_special_tokens=False):
        assert matcher.accept_token(token)
    inside = allowed_ids(matcher, WIDTH)  # inside a free string: most of the vocabulary
    assert len(inside) > 200_000
    assert not inside & gemma_tokenizer.special_ids  # not <start_of_turn>, <unused…>, <eos> …
    for token in gemma_tokenizer.encode('x"}', add_special_tokens=False):
        assert matcher.accept_token(token)
    assert allowed_ids(matcher, WIDTH) == STOPS
    assert matcher.accept_token(106) and matcher.is_terminated()


@pytest.mark.parametrize("name", BACKENDS)
def test_regex_choice_and_rollback(gemma_backends: dict, gemma_tokenizer, name: str) -> None:
    backend = gemma_backends[name]
    regex = r"[A-Z][a-z]{2,6} [0-9]{1,3}"
    choices = ["Paris", "Tōkyō", 'the "quoted" one']
    for seed in range(2):
        tokens, done, _ = walk(backend, backend.compile(StructuredOutputsParams(regex=regex)), seed)
        assert done and re.fullmatch(regex, gemma_tokenizer.decode(tokens))
        tokens, done, matcher = walk(backend, backend.compile(StructuredOutputsParams(choice=choices)), seed)
        assert done and gemma_tokenizer.decode(tokens) in choices
        matcher.rollback(matcher.num_accepted)
        assert matcher.num_accepted == 0 and not matcher.is_terminated()
        for token in tokens:
            assert matcher.accept_token(token)
        assert allowed_ids(matcher, WIDTH) == STOPS


def test_forced_tool_call_on_gemma(gemma_backends: dict, gemma_tokenizer) -> None:
    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}}]
    backend = gemma_backends["xgrammar"]
    grammar = compile_tool_choice(backend, tools, "required", parallel_tool_calls=False, disable_any_whitespace=True)
    assert grammar is not None
    tokens, done, _ = walk(backend, grammar, 0)
    assert done
    calls = parse_forced_tool_calls(gemma_tokenizer.decode(tokens), "required")
    assert [c.name for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0].arguments), params)
