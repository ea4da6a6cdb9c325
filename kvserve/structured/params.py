"""What a request constrains its output to: vLLM's `StructuredOutputsParams`, validated, with a cache key.

Why vLLM's shape: users pass `structured_outputs={"json": ...}` (and the older `guided_*` fields, which map onto
the same five constraints) to vLLM today, and their code must work unchanged here. Exactly one constraint is
set; a bad value raises ValueError naming the field, which the server turns into a 400.
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

_FIELD_PREFIX = "structured_outputs"


class ConstraintKind(enum.Enum):
    """The one kind of constraint a request carries (vLLM's StructuredOutputOptions, minus structural tags)."""

    JSON = "json"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"


@dataclass(frozen=True, slots=True, eq=False)
class StructuredOutputsParams:
    """One request's output constraint, immutable once built (so that its key can be cached with it).

    json: a JSON schema (dict or JSON text); json_object: any JSON object; regex; choice: one of these strings; grammar:
    GBNF/EBNF (`::=` rules) or Lark, both backends. The options shape JSON output: disable_any_whitespace (compact JSON,
    which keeps a small model from wandering in whitespace; None, the default: the server's
    `--structured-outputs-config` disable_any_whitespace, true unless lifted, a difference from vLLM) and
    whitespace_pattern (llguidance only; it lifts the compact default). disable_additional_properties is accepted for
    vLLM's clients and changes nothing: both backends are strict already (an object takes only the properties its schema
    lists, unless the schema sets additionalProperties). `key` hashes everything that changes the compiled grammar;
    `source_bytes` is the size of that serialized constraint (what --structured-outputs-config's max_grammar_bytes
    bounds).
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    key: str = field(init=False, repr=False)
    kind: ConstraintKind = field(init=False, repr=False)
    source_bytes: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        kind = _the_one_constraint(self)
        _check_value(self, kind)
        object.__setattr__(self, "kind", kind)
        key, size = _key(self, kind)
        object.__setattr__(self, "key", key)
        object.__setattr__(self, "source_bytes", size)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StructuredOutputsParams) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    @property
    def schema(self) -> dict[str, Any]:
        """The JSON schema as a dict (json_object: {"type": "object"}, as vLLM compiles it)."""
        if self.kind is ConstraintKind.JSON_OBJECT:
            return {"type": "object"}
        if isinstance(self.json, dict):
            return self.json
        if isinstance(self.json, str):
            return json.loads(self.json)
        raise ValueError(f"{_FIELD_PREFIX}: a {self.kind.value} constraint has no JSON schema")

    @property
    def field_name(self) -> str:
        """The request field this constraint came from, for error messages ("structured_outputs.json")."""
        return f"{_FIELD_PREFIX}.{self.kind.value}"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StructuredOutputsParams:
        """From the request's `structured_outputs` object; unknown keys are a 400, not silently dropped."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{_FIELD_PREFIX} must be an object, got {type(data).__name__}")
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"{_FIELD_PREFIX}: unknown field(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})"
            )
        return cls(**dict(data))


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


def _the_one_constraint(p: StructuredOutputsParams) -> ConstraintKind:
    """Exactly one constraint; json_object=False counts as unset, as in vLLM."""
    present = [name for name in _CONSTRAINTS if getattr(p, name) not in (None, False)]
    if len(present) != 1:
        got = ", ".join(present) if present else "none"
        raise ValueError(f"{_FIELD_PREFIX}: exactly one of {', '.join(_CONSTRAINTS)} must be set (got: {got})")
    return ConstraintKind(present[0])


def _check_value(p: StructuredOutputsParams, kind: ConstraintKind) -> None:
    """Types and shapes a grammar compiler would otherwise reject with a less helpful message."""
    name = f"{_FIELD_PREFIX}.{kind.value}"
    if kind is ConstraintKind.JSON:
        _check_schema_value(name, p.json)
    elif kind is ConstraintKind.JSON_OBJECT and p.json_object is not True:
        raise ValueError(f"{name} must be true or absent, got {p.json_object!r}")
    elif kind in (ConstraintKind.REGEX, ConstraintKind.GRAMMAR):
        value = p.regex if kind is ConstraintKind.REGEX else p.grammar
        if not isinstance(value, str) or not value:
            raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    elif kind is ConstraintKind.CHOICE:
        _check_choice(name, p.choice)
    if p.disable_any_whitespace is not None and not isinstance(p.disable_any_whitespace, bool):
        raise ValueError(f"{_FIELD_PREFIX}.disable_any_whitespace must be a boolean, got {p.disable_any_whitespace!r}")
    for option in ("disable_additional_properties",):
        if not isinstance(getattr(p, option), bool):
            raise ValueError(f"{_FIELD_PREFIX}.{option} must be a boolean, got {getattr(p, option)!r}")
    if p.whitespace_pattern is not None and (not isinstance(p.whitespace_pattern, str) or not p.whitespace_pattern):
        raise ValueError(f"{_FIELD_PREFIX}.whitespace_pattern must be a non-empty string, got {p.whitespace_pattern!r}")


def _check_schema_value(name: str, value: object) -> None:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name}: not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON schema object, got {type(value).__name__}")
    try:
        json.dumps(value)
    except (TypeError, ValueError) as e:  # a dict built in Python may hold sets or other objects
        raise ValueError(f"{name}: not serializable as JSON: {e}") from e


def _check_choice(name: str, choice: object) -> None:
    if not isinstance(choice, Sequence) or isinstance(choice, str) or not choice:
        raise ValueError(f"{name} must be a non-empty list of strings, got {choice!r}")
    for i, option in enumerate(choice):
        if not isinstance(option, str):
            raise ValueError(f"{name}[{i}] must be a string, got {option!r}")


def _key(p: StructuredOutputsParams, kind: ConstraintKind) -> tuple[str, int]:
    """A stable hash of everything that shapes the compiled grammar, and the size in bytes of what it hashes.

    The schema is serialized without sorting keys: property order decides the order in which the grammar emits
    fields, so two schemas that differ only in order must not share a compiled grammar."""
    value: object = getattr(p, kind.value)
    if kind is ConstraintKind.JSON and isinstance(value, str):
        value = json.loads(value)
    if kind is ConstraintKind.CHOICE:
        value = list(value)  # type: ignore[call-overload]
    payload = [kind.value, value, p.disable_any_whitespace, p.whitespace_pattern]  # not the no-op option
    data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return hashlib.sha256(data).hexdigest(), len(data)


def with_whitespace_default(params: StructuredOutputsParams, compact: bool) -> StructuredOutputsParams:
    """`params` with disable_any_whitespace decided: its own value if it set one, else False under a
    whitespace_pattern (the pattern rules whitespace), else the server's default `compact`."""
    if params.disable_any_whitespace is not None:
        return params
    return replace(params, disable_any_whitespace=compact and params.whitespace_pattern is None)
