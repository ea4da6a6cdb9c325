"""Both grammar backends (and auto) on the tiny character tokenizer with a padded logits width: constrained random
walks always produce valid output, rollback and refusals leave the state right, errors are clear ValueErrors."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
import torch
from structured_support import TINY_LOGITS_WIDTH, allowed_ids, walk

from kvserve.structured.backend import (
    GrammarBackend,
    GrammarCache,
    GrammarCompileError,
    GuidanceBackend,
    XgrammarBackend,
    make_backend,
)
from kvserve.structured.matcher import validate_tokens
from kvserve.structured.params import StructuredOutputsParams

BACKENDS = ("xgrammar", "guidance")
EOS = 1
STR: dict[str, Any] = {"type": "string", "maxLength": 6}

SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {"name": STR, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "kind": {"enum": ["cat", "dog", "bird"]},
            "tag": {"const": "v1"},
            "ok": {"type": "boolean"},
            "none": {"type": "null"},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["kind", "tag", "ok", "none", "score"],
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {"type": "integer", "minimum": -5, "maximum": 5},
                "minItems": 2,
                "maxItems": 4,
            },
            "inner": {
                "type": "object",
                "properties": {"x": STR, "y": {"type": "array", "items": STR, "maxItems": 2}},
                "required": ["x", "y"],
                "additionalProperties": False,
            },
        },
        "required": ["items", "inner"],
    },
    {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": 0, "maximum": 9},
                    "y": {"type": "integer", "minimum": 0, "maximum": 9},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
        "required": ["a", "b"],
    },
    {
        "type": "object",
        "properties": {
            "value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, STR]},
            "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
            "opt": STR,
        },
        "required": ["value", "code"],
    },
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["id"],
        },
        "minItems": 1,
        "maxItems": 3,
    },
]


def text(backend: GrammarBackend, tokens: list[int]) -> str:
    return "".join(backend.vocab.raw.id_to_token(t) or "" for t in tokens)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("index", range(len(SCHEMAS)))
@pytest.mark.parametrize("compact", [True, False])
def test_json_schema_walk_always_validates(tiny_backends: dict, name: str, index: int, compact: bool) -> None:
    backend = tiny_backends[name]
    schema = SCHEMAS[index]
    grammar = backend.compile(StructuredOutputsParams(json=schema, disable_any_whitespace=compact))
    for seed in range(3):
        tokens, done, _ = walk(backend, grammar, seed)
        assert done, text(backend, tokens)
        jsonschema.validate(json.loads(text(backend, tokens)), schema)


@pytest.mark.parametrize("name", BACKENDS)
def test_json_object_means_any_object(tiny_backends: dict, tiny_tokenizer, name: str) -> None:
    backend = tiny_backends[name]
    grammar = backend.compile(StructuredOutputsParams(json_object=True, disable_any_whitespace=True))
    matcher = backend.matcher(grammar)
    assert allowed_ids(matcher, TINY_LOGITS_WIDTH) == {tiny_tokenizer.token_to_id("{")}
    for ch in '{"k": [1, {"x": null}], "':  # compact output keeps json.dumps' separators
        assert matcher.accept_token(tiny_tokenizer.token_to_id(ch)), ch  # keys and values of any kind
    for seed in range(3):
        tokens, done, _ = walk(backend, grammar, seed)
        assert done and isinstance(json.loads(text(backend, tokens)), dict)


@pytest.mark.parametrize("name", BACKENDS)
def test_properties_in_anyof_branches_stay_satisfiable(tiny_backends: dict, name: str) -> None:
    schema = {
        "type": "object",
        "anyOf": [
            {"properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]},
            {"properties": {"b": {"type": "boolean"}}, "required": ["b"]},
        ],
    }
    backend = tiny_backends[name]
    grammar = backend.compile(StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    for seed in range(3):
        tokens, done, _ = walk(backend, grammar, seed)
        assert done
        jsonschema.validate(json.loads(text(backend, tokens)), schema)


@pytest.mark.parametrize("name", BACKENDS)
def test_regex_and_choice_walks(tiny_backends: dict, name: str) -> None:
    backend = tiny_backends[name]
    regex = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[a-z]{1,4}"
    choices = ['say "hi"', "back\\slash", "naïve", "two\nlines", "say"]
    for seed in range(4):
        tokens, done, _ = walk(backend, backend.compile(StructuredOutputsParams(regex=regex)), seed)
        assert done and re.fullmatch(regex, text(backend, tokens))
        tokens, done, _ = walk(backend, backend.compile(StructuredOutputsParams(choice=choices)), seed)
        assert done and text(backend, tokens) in choices


@pytest.mark.parametrize("name", BACKENDS)
def test_gbnf_grammar_walk(tiny_backends: dict, name: str) -> None:
    backend = tiny_backends[name]
    gbnf = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    for seed in range(3):
        tokens, done, _ = walk(backend, backend.compile(StructuredOutputsParams(grammar=gbnf)), seed)
        assert done and re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", text(backend, tokens))


@pytest.mark.parametrize("name", BACKENDS)
def test_lark_grammar_walk(tiny_backends: dict, name: str) -> None:
    backend = tiny_backends[name]
    lark = 'start: "<" WORD ">"\nWORD: /[a-c]{1,3}/'
    tokens, done, _ = walk(backend, backend.compile(StructuredOutputsParams(grammar=lark)), 0)
    assert done and re.fullmatch(r"<[a-c]{1,3}>", text(backend, tokens))


@pytest.mark.parametrize("name", BACKENDS)
def test_rollback_restores_masks_and_termination(tiny_backends: dict, name: str) -> None:
    backend = tiny_backends[name]
    grammar = backend.compile(StructuredOutputsParams(json=SCHEMAS[0], disable_any_whitespace=True))
    tokens, done, matcher = walk(backend, grammar, seed=5)
    assert done and matcher.num_accepted == len(tokens) + 1
    replay = backend.matcher(grammar)
    masks = []
    for token in tokens:
        masks.append(allowed_ids(replay, TINY_LOGITS_WIDTH))
        assert replay.accept_token(token)
    masks.append(allowed_ids(replay, TINY_LOGITS_WIDTH))
    assert masks[-1] == {EOS}  # complete: only the stop token
    # Roll the terminated walk back across its stop token, then step by step.
    matcher.rollback(1)
    assert not matcher.is_terminated() and allowed_ids(matcher, TINY_LOGITS_WIDTH) == masks[-1]
    for back in (3, 5):
        matcher.rollback(back)
        position = matcher.num_accepted
        assert allowed_ids(matcher, TINY_LOGITS_WIDTH) == masks[position]
    # And forward again to the same end.
    for token in tokens[matcher.num_accepted :]:
        assert matcher.accept_token(token)
    assert matcher.accept_token(EOS) and matcher.is_terminated()
    matcher.reset()
    assert matcher.num_accepted == 0 and allowed_ids(matcher, TINY_LOGITS_WIDTH) == masks[0]
    with pytest.raises(ValueError, match="cannot roll back 1 tokens"):
        matcher.rollback(1)


@pytest.mark.parametrize("name", BACKENDS)
def test_refused_token_leaves_the_matcher_unchanged(tiny_backends: dict, tiny_tokenizer, name: str) -> None:
    backend = tiny_backends[name]
    matcher = backend.matcher(backend.compile(StructuredOutputsParams(regex="ab?c")))
    a, b, c, x = (tiny_tokenizer.token_to_id(ch) for ch in "abcx")
    assert not matcher.accept_token(x)
    assert not matcher.accept_token(EOS)  # the grammar is not complete yet
    assert matcher.accept_token(a) and matcher.num_accepted == 1
    assert allowed_ids(matcher, TINY_LOGITS_WIDTH) == {b, c}
    assert not matcher.accept_token(a)
    assert allowed_ids(matcher, TINY_LOGITS_WIDTH) == {b, c}
    assert matcher.accept_token(c) and not matcher.is_terminated()
    assert matcher.accept_token(EOS) and matcher.is_terminated()
    assert not matcher.accept_token(a)  # nothing after the stop token
    assert allowed_ids(matcher, TINY_LOGITS_WIDTH) == {EOS}


@pytest.mark.parametrize("name", BACKENDS)
def test_specials_and_padding_are_never_allowed(tiny_backends: dict, tiny_tokenizer, name: str) -> None:
    backend = tiny_backends[name]
    matcher = backend.matcher(backend.compile(StructuredOutputsParams(json={"type": "string"})))
    assert matcher.accept_token(tiny_tokenizer.token_to_id('"'))
    allowed = allowed_ids(matcher, TINY_LOGITS_WIDTH)  # inside a string: almost anything
    assert len(allowed) > 200
    assert not allowed & {0, 1, 2, 3} and not allowed & set(range(256, TINY_LOGITS_WIDTH))


@pytest.mark.parametrize("name", BACKENDS)
def test_validate_tokens_counts_the_accepted_prefix(tiny_backends: dict, tiny_tokenizer, name: str) -> None:
    backend = tiny_backends[name]
    matcher = backend.matcher(backend.compile(StructuredOutputsParams(regex="abc")))
    ids = [tiny_tokenizer.token_to_id(ch) for ch in "abx"]
    assert validate_tokens(matcher, ids) == 2 and matcher.num_accepted == 0


@pytest.mark.parametrize("name", BACKENDS)
def test_validate_tokens_stops_before_a_token_that_completes_the_grammar(
    tiny_backends: dict, tiny_tokenizer, name: str
) -> None:
    """Speculative drafts end before the grammar would complete: every verified position needs a live state."""
    backend = tiny_backends[name]
    matcher = backend.matcher(backend.compile(StructuredOutputsParams(regex="abc")))
    eos = tiny_tokenizer.eos_token_id
    ids = [tiny_tokenizer.token_to_id(ch) for ch in "abc"] + [eos]
    assert validate_tokens(matcher, ids) == 3 and matcher.num_accepted == 0 and not matcher.is_terminated()


@pytest.mark.parametrize("name", BACKENDS)
def test_draft_masks_are_each_positions_state(tiny_backends: dict, tiny_tokenizer, name: str) -> None:
    """Position i's mask is the grammar's after the drafts before it; the matcher ends as it started."""
    from kvserve.structured.matcher import allocate_token_bitmask, draft_masks

    backend = tiny_backends[name]
    matcher = backend.matcher(backend.compile(StructuredOutputsParams(regex="(ab|cd)+e")))
    draft = [tiny_tokenizer.token_to_id(ch) for ch in "abc"]
    masks = draft_masks(matcher, draft, TINY_LOGITS_WIDTH)
    assert len(masks) == 4 and matcher.num_accepted == 0
    for i, mask in enumerate(masks):
        fresh = backend.matcher(backend.compile(StructuredOutputsParams(regex="(ab|cd)+e")))
        for token in draft[:i]:
            assert fresh.accept_token(token)
        want = allocate_token_bitmask(1, TINY_LOGITS_WIDTH)
        fresh.fill_bitmask(want, 0)
        got = allocate_token_bitmask(1, TINY_LOGITS_WIDTH)
        mask.fill_bitmask(got, 0)
        assert torch.equal(got, want), i
    assert not torch.equal(masks[1].words, masks[2].words)  # after "a" only "b"; after "ab": a, c or e
    with pytest.raises(ValueError, match="not allowed by the grammar"):
        draft_masks(matcher, [tiny_tokenizer.token_to_id("x")], TINY_LOGITS_WIDTH)
    assert matcher.num_accepted == 0


BAD = [
    ({"json": {"type": "no-such-type"}}, "structured_outputs.json: invalid JSON schema: "),
    ({"regex": "[a-"}, "structured_outputs.regex: invalid regex: "),
    ({"grammar": 'root ::= undefined_rule "x"'}, "structured_outputs.grammar: invalid grammar: "),
    ({"grammar": "start: undefined_rule"}, "structured_outputs.grammar: invalid grammar: "),
]


@pytest.mark.parametrize("name", ("xgrammar", "guidance", "auto"))
@pytest.mark.parametrize("kwargs, prefix", BAD)
def test_compile_errors_are_value_errors_naming_field_and_reason(
    tiny_backends: dict, name: str, kwargs: dict, prefix: str
) -> None:
    with pytest.raises(ValueError) as e:
        tiny_backends[name].compile(StructuredOutputsParams(**kwargs))
    assert isinstance(e.value, GrammarCompileError)
    message = str(e.value)
    assert message.startswith(prefix) and len(message) > len(prefix) + 5
    assert "\n" not in message and ".cc:" not in message  # one line, without the library's source location
    assert "undefined_rule" in message or "no-such-type" in message or "[a-" in message or "Unclosed" in message


def test_whitespace_pattern_needs_guidance(tiny_backends: dict) -> None:
    params = StructuredOutputsParams(
        json={"type": "object", "properties": {"a": STR}, "required": ["a"]}, whitespace_pattern="[ ]?"
    )
    with pytest.raises(GrammarCompileError, match="whitespace_pattern: not supported by xgrammar"):
        tiny_backends["xgrammar"].compile(params)
    grammar = tiny_backends["auto"].compile(params)  # auto falls back to llguidance
    assert grammar.backend == "guidance"
    tokens, done, _ = walk(tiny_backends["auto"], grammar, 0)
    assert done and set(json.loads(text(tiny_backends["auto"], tokens))) == {"a"}


@pytest.mark.parametrize("name", ("xgrammar", "guidance", "auto"))
def test_cache_returns_the_same_compiled_object(tiny_backends: dict, name: str) -> None:
    backend = tiny_backends[name]
    first = backend.compile(StructuredOutputsParams(json=SCHEMAS[1]))
    assert backend.compile(StructuredOutputsParams(json=json.dumps(SCHEMAS[1]))) is first
    assert backend.compile(StructuredOutputsParams(json=SCHEMAS[1], disable_any_whitespace=True)) is not first


def test_cache_is_lru_bounded(tiny_vocab) -> None:
    backend = XgrammarBackend(tiny_vocab, cache_size=2)
    a, b, c = (StructuredOutputsParams(regex=r) for r in ("a", "b", "c"))
    ga = backend.compile(a)
    gb = backend.compile(b)
    assert backend.compile(a) is ga  # a is now the most recent
    backend.compile(c)  # evicts b
    assert backend.compile(a) is ga and backend.compile(b) is not gb
    with pytest.raises(ValueError, match="cache size must be >= 1"):
        GrammarCache(0)


def test_cache_is_byte_bounded(tiny_vocab) -> None:
    from kvserve.structured.backend import CompiledGrammar
    from kvserve.structured.params import ConstraintKind

    cache = GrammarCache(max_size=10, max_bytes=250, size_of=lambda g: int(g.handle))
    made = {k: CompiledGrammar(k, "test", ConstraintKind.REGEX, 100) for k in "abcd"}
    for k in "abc":
        assert cache.get_or_compile(k, lambda k=k: made[k]) is made[k]
    assert len(cache) == 2 and cache.nbytes == 200  # a went when c came
    assert cache.get_or_compile("b", lambda: made["d"]) is made["b"]  # a hit, not a compile
    huge = CompiledGrammar("h", "test", ConstraintKind.REGEX, 1000)
    assert cache.get_or_compile("h", lambda: huge) is huge and len(cache) == 1  # kept alone: it is in use


def test_matchers_are_independent(tiny_backends: dict, tiny_tokenizer) -> None:
    for name in BACKENDS:
        backend = tiny_backends[name]
        grammar = backend.compile(StructuredOutputsParams(regex="ab|ac"))
        one, two = backend.matcher(grammar), backend.matcher(grammar)
        assert one.accept_token(tiny_tokenizer.token_to_id("a"))
        assert two.num_accepted == 0 and allowed_ids(two, TINY_LOGITS_WIDTH) == {tiny_tokenizer.token_to_id("a")}


def test_a_grammar_runs_only_on_its_backend(tiny_backends: dict) -> None:
    grammar = tiny_backends["xgrammar"].compile(StructuredOutputsParams(regex="a"))
    with pytest.raises(ValueError, match="compiled by xgrammar cannot run on the guidance backend"):
        tiny_backends["guidance"].matcher(grammar)


def test_backend_names(tiny_vocab) -> None:
    assert isinstance(make_backend("guidance", tiny_vocab), GuidanceBackend)
    with pytest.raises(ValueError, match="must be one of auto, xgrammar, guidance, got 'outlines'"):
        make_backend("outlines", tiny_vocab)


def test_a_guidance_matcher_in_error_allows_only_stop_tokens(tiny_backends: dict, tiny_tokenizer) -> None:
    """A parser error mid-output (e.g. a limit) must end the request, not raise on the engine thread."""
    from kvserve.structured.matcher import GuidanceMatcher

    backend = tiny_backends["guidance"]
    grammar = backend.compile(StructuredOutputsParams(regex="abc"))
    inner = grammar.handle.deep_copy()
    matcher = GuidanceMatcher(inner, backend.vocab.stop_token_ids, backend.ll_tokenizer.vocab_size)
    assert matcher.error() is None
    inner.consume_token(tiny_tokenizer.token_to_id("x"))  # straight into llguidance's error state
    assert "doesn't satisfy the grammar" in (matcher.error() or "")
    assert allowed_ids(matcher, TINY_LOGITS_WIDTH) == {EOS}
    assert (
        tiny_backends["xgrammar"]
        .matcher(tiny_backends["xgrammar"].compile(StructuredOutputsParams(regex="abc")))
        .error()
        is None
    )
