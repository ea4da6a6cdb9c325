"""What a JSON schema asks for that a backend cannot enforce exactly: found before compiling, so that the request
gets a 400 (or the other backend) instead of output the schema does not constrain.

Why: xgrammar compiles some keywords into a grammar that ignores them (the hostile run: `allOf` of a string and
an integer was accepted and emitted integers), and a `$ref` to a document elsewhere was only logged while the
output went unconstrained. vLLM refuses what its backend does not support; kvserve does the same, per backend:
xgrammar refuses the keywords below (so `auto` hands the schema to llguidance, whose converter either enforces a
keyword or errors), and neither follows a reference out of the schema (kvserve downloads nothing)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

# Keywords whose subschemas are schemas keyed by name (their keys are names, not keywords).
_NAMED_SCHEMAS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# Keywords whose values are a schema, or a list of schemas.
_SUBSCHEMAS = (
    "items",
    "prefixItems",
    "additionalProperties",
    "additionalItems",
    "contains",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
    "allOf",
    "anyOf",
    "oneOf",
    "unevaluatedProperties",
    "unevaluatedItems",
)
# What xgrammar's JSON-schema converter does not enforce (it compiles them as if absent).
XGRAMMAR_UNSUPPORTED = frozenset(
    {
        "allOf",
        "not",
        "if",
        "then",
        "else",
        "dependentSchemas",
        "dependentRequired",
        "multipleOf",
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "patternProperties",
        "propertyNames",
        "minProperties",
        "maxProperties",
        "unevaluatedProperties",
        "unevaluatedItems",
    }
)


def keywords(schema: Any, path: str = "") -> Iterator[tuple[str, str, Any]]:
    """(path, keyword, value) of every keyword in the schema and all of its subschemas."""
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        yield path, key, value
        where = f"{path}/{key}"
        if key in _NAMED_SCHEMAS and isinstance(value, dict):
            for name, sub in value.items():
                yield from keywords(sub, f"{where}/{name}")
        elif key in _SUBSCHEMAS:
            subs = value if isinstance(value, list) else [value]
            for i, sub in enumerate(subs):
                yield from keywords(sub, f"{where}/{i}" if isinstance(value, list) else where)


def outside_reference(schema: Any) -> tuple[str, str] | None:
    """(path, reference) of the first `$ref` that does not point inside the schema (`#...`), else None."""
    for path, key, value in keywords(schema):
        if key == "$ref" and not (isinstance(value, str) and value.startswith("#")):
            return path or "/", str(value)
    return None


def first_unsupported(schema: Any, unsupported: frozenset[str]) -> tuple[str, str] | None:
    """(path, keyword) of the first keyword in `unsupported` the schema uses, else None."""
    for path, key, _ in keywords(schema):
        if key in unsupported:
            return path or "/", key
    return None


def used_keywords(schema: Any, among: frozenset[str]) -> tuple[str, ...]:
    """The keywords of `among` the schema uses anywhere, in the order first met."""
    return tuple(dict.fromkeys(key for _, key, _ in keywords(schema) if key in among))


def without_keywords(schema: Any, dropped: frozenset[str]) -> Any:
    """A copy of `schema` in which no subschema has the keywords of `dropped` (property names that happen to be
    spelled like one stay: only keywords go)."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in dropped:
            continue
        if key in _NAMED_SCHEMAS and isinstance(value, dict):
            out[key] = {name: without_keywords(sub, dropped) for name, sub in value.items()}
        elif key in _SUBSCHEMAS:
            out[key] = (
                [without_keywords(sub, dropped) for sub in value]
                if isinstance(value, list)
                else without_keywords(value, dropped)
            )
        else:
            out[key] = value
    return out
