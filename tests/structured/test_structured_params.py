"""StructuredOutputsParams: exactly one constraint, clear ValueErrors, and a key that is stable where it should be."""

from __future__ import annotations

import json

import pytest

from kvserve.structured.params import ConstraintKind, StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a"]}


@pytest.mark.parametrize(
    "kwargs, kind",
    [
        ({"json": SCHEMA}, ConstraintKind.JSON),
        ({"json": json.dumps(SCHEMA)}, ConstraintKind.JSON),
        ({"regex": "[a-z]+"}, ConstraintKind.REGEX),
        ({"choice": ["yes", "no"]}, ConstraintKind.CHOICE),
        ({"grammar": 'root ::= "x"'}, ConstraintKind.GRAMMAR),
        ({"json_object": True}, ConstraintKind.JSON_OBJECT),
        ({"json_object": False, "regex": "x"}, ConstraintKind.REGEX),  # False counts as unset, as in vLLM
    ],
)
def test_one_constraint_gives_its_kind(kwargs: dict, kind: ConstraintKind) -> None:
    params = StructuredOutputsParams(**kwargs)
    assert params.kind is kind
    assert params.field_name == f"structured_outputs.{kind.value}"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "exactly one of json, regex, choice, grammar, json_object must be set (got: none)"),
        ({"json": SCHEMA, "regex": "x"}, "(got: json, regex)"),
        ({"json": "{not json"}, "structured_outputs.json: not valid JSON"),
        ({"json": "[1, 2]"}, "structured_outputs.json must be a JSON schema object"),
        ({"json": {"type": {1, 2}}}, "structured_outputs.json: not serializable as JSON"),
        ({"regex": ""}, "structured_outputs.regex must be a non-empty string"),
        ({"choice": []}, "structured_outputs.choice must be a non-empty list of strings"),
        ({"choice": "yes"}, "structured_outputs.choice must be a non-empty list of strings"),
        ({"choice": ["a", 3]}, "structured_outputs.choice[1] must be a string"),
        ({"grammar": 7}, "structured_outputs.grammar must be a non-empty string"),
        ({"json_object": "yes"}, "structured_outputs.json_object must be true or absent"),
        ({"regex": "x", "disable_any_whitespace": "no"}, "structured_outputs.disable_any_whitespace must be a boolean"),
        ({"regex": "x", "whitespace_pattern": ""}, "structured_outputs.whitespace_pattern must be a non-empty string"),
    ],
)
def test_bad_values_are_value_errors_naming_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as e:
        StructuredOutputsParams(**kwargs)
    assert message in str(e.value)


def test_from_dict_rejects_unknown_fields() -> None:
    assert StructuredOutputsParams.from_dict({"regex": "a+"}).regex == "a+"
    with pytest.raises(ValueError, match=r"unknown field\(s\) jsn"):
        StructuredOutputsParams.from_dict({"jsn": SCHEMA})
    with pytest.raises(ValueError, match="must be an object"):
        StructuredOutputsParams.from_dict(["regex"])  # type: ignore[arg-type]


def test_key_is_stable_across_spellings_of_the_same_constraint() -> None:
    a = StructuredOutputsParams(json=SCHEMA)
    b = StructuredOutputsParams(json=json.dumps(SCHEMA, indent=4))
    assert a.key == b.key and a == b and hash(a) == hash(b)
    assert StructuredOutputsParams(choice=["x", "y"]).key == StructuredOutputsParams(choice=("x", "y")).key  # type: ignore[arg-type]


def test_key_changes_with_anything_that_shapes_the_grammar() -> None:
    base = StructuredOutputsParams(json=SCHEMA)
    reordered = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}, "required": ["a"]}
    variants = [
        StructuredOutputsParams(json=reordered),  # property order decides the output's field order
        StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
        StructuredOutputsParams(json=SCHEMA, whitespace_pattern=" ?"),
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(regex=json.dumps(SCHEMA)),
    ]
    keys = {base.key, *(v.key for v in variants)}
    assert len(keys) == len(variants) + 1
    # disable_additional_properties changes nothing (both backends are strict), so it shares the compiled grammar
    assert StructuredOutputsParams(json=SCHEMA, disable_additional_properties=True).key == base.key


def test_schema_property() -> None:
    assert StructuredOutputsParams(json=json.dumps(SCHEMA)).schema == SCHEMA
    assert StructuredOutputsParams(json_object=True).schema == {"type": "object"}
    with pytest.raises(ValueError, match="no JSON schema"):
        StructuredOutputsParams(regex="a").schema  # noqa: B018


def test_params_are_immutable() -> None:
    params = StructuredOutputsParams(regex="a")
    with pytest.raises(AttributeError):
        params.regex = "b"  # type: ignore[misc]


def test_json_is_compact_unless_a_request_or_the_server_lifts_it():
    """kvserve's default (a difference from vLLM): a request that leaves disable_any_whitespace open gets the
    server's --structured-outputs-config value, true unless lifted; a request's own value or a whitespace_pattern
    wins. The decided params are what the compile cache is keyed by."""
    from kvserve.structured.config import StructuredOutputsConfig, parse_structured_outputs_config
    from kvserve.structured.params import with_whitespace_default

    assert StructuredOutputsConfig().disable_any_whitespace is True
    assert parse_structured_outputs_config('{"disable_any_whitespace": false}').disable_any_whitespace is False
    open_ = StructuredOutputsParams(json=SCHEMA)
    assert open_.disable_any_whitespace is None
    assert with_whitespace_default(open_, True).disable_any_whitespace is True
    assert with_whitespace_default(open_, False).disable_any_whitespace is False
    assert (
        with_whitespace_default(open_, True).key
        == StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True).key
    )
    explicit = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=False)
    assert with_whitespace_default(explicit, True) is explicit
    pattern = StructuredOutputsParams(json=SCHEMA, whitespace_pattern=r"[ ]?")
    assert with_whitespace_default(pattern, True).disable_any_whitespace is False
