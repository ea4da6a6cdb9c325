"""A JSON value checked against a JSON schema: what a `strict` function's call arguments must pass when they come
from free text (kvserve.structured.call_arguments), where no grammar forced them.

Why not the `jsonschema` package: it is no dependency of kvserve's, and this runs on the event loop for every call
read, so it must be bounded: the keywords OpenAI's strict mode takes (plus a few as simple), every visit counted
against a budget (an `anyOf` nested in itself cannot make it exponential: past the budget the value counts as
invalid, and the reply stays content). A strict tool whose schema uses anything else is a 400 when the request
arrives (`unchecked_keyword`), so that a check is never silently partial. `pattern` and `format` are read and not
checked: a client's regular expression run on the event loop could hold it for minutes (catastrophic
backtracking); where a call is forced, the grammar enforces `pattern`.
"""

from __future__ import annotations

from typing import Any

from kvserve.structured.schema_check import keywords

# Checked here; with the annotations below, all a strict tool's schema may use.
CHECKED_KEYWORDS = frozenset(
    {
        "type",
        "enum",
        "const",
        "properties",
        "required",
        "additionalProperties",
        "minProperties",
        "maxProperties",
        "items",
        "prefixItems",
        "minItems",
        "maxItems",
        "minLength",
        "maxLength",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
        "anyOf",
        "oneOf",
        "allOf",
        "$ref",
        "$defs",
        "definitions",
    }
)
# Read and not checked (what they say constrains no value, or, `pattern`, cannot be checked safely here).
ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$schema",
        "$id",
        "$comment",
        "deprecated",
        "readOnly",
        "writeOnly",
        "format",
        "pattern",
    }
)
MAX_VISITS = 100_000  # (value, schema) pairs checked per call: far above any real tool's arguments

_TYPES: dict[str, Any] = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer()),
}


def unchecked_keyword(schema: Any) -> tuple[str, str] | None:
    """(path, keyword) of the first keyword `is_valid` would not check, else None."""
    for path, key, _ in keywords(schema):
        if key not in CHECKED_KEYWORDS and key not in ANNOTATIONS:
            return path or "/", key
    return None


def is_valid(value: Any, schema: Any) -> bool:
    """Whether `value` (parsed JSON) satisfies `schema`; False also past MAX_VISITS, or at a reference that does not
    resolve inside the schema."""
    try:
        return _Check(schema).valid(value, schema)
    except (_OverBudget, RecursionError, TypeError, ValueError):  # a malformed keyword's value fails, never raises
        return False


class _OverBudget(Exception):
    pass


def json_equal(a: Any, b: Any) -> bool:
    """JSON's equality: true is not 1, 1 is 1.0, objects compare by members."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, dict)) or isinstance(b, (list, dict)):
        return False
    return bool(a == b)


class _Check:
    """One check against one root schema (the target of `#` references), with its visit budget."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.visits = 0

    def valid(self, value: Any, schema: Any) -> bool:
        self.visits += 1
        if self.visits > MAX_VISITS:
            raise _OverBudget
        if isinstance(schema, bool):
            return schema
        if not isinstance(schema, dict):
            return False
        if "$ref" in schema:
            target = self._resolve(schema["$ref"])
            if target is None or not self.valid(value, target):
                return False
        checks = (self._type, self._values, self._combined, self._object, self._array, self._string, self._number)
        return all(check(value, schema) for check in checks)

    def _resolve(self, ref: Any) -> Any:
        """The subschema a local reference (`#`, `#/$defs/X`) points at, None if it points nowhere."""
        if not isinstance(ref, str) or not ref.startswith("#"):
            return None
        node = self.root
        for part in filter(None, ref[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node

    def _type(self, value: Any, schema: dict[str, Any]) -> bool:
        kinds = schema.get("type")
        if kinds is None:
            return True
        names = kinds if isinstance(kinds, list) else [kinds]
        return any(name in _TYPES and _TYPES[name](value) for name in names)

    def _values(self, value: Any, schema: dict[str, Any]) -> bool:
        if "const" in schema and not json_equal(value, schema["const"]):
            return False
        enum = schema.get("enum")
        return enum is None or (isinstance(enum, list) and any(json_equal(value, e) for e in enum))

    def _combined(self, value: Any, schema: dict[str, Any]) -> bool:
        if not all(self.valid(value, s) for s in schema.get("allOf", [])):
            return False
        if "anyOf" in schema and not any(self.valid(value, s) for s in schema["anyOf"]):
            return False
        return "oneOf" not in schema or sum(self.valid(value, s) for s in schema["oneOf"]) == 1

    def _object(self, value: Any, schema: dict[str, Any]) -> bool:
        if not isinstance(value, dict):
            return True
        properties = schema.get("properties", {})
        if any(key not in value for key in schema.get("required", [])):
            return False
        if not schema.get("minProperties", 0) <= len(value) <= schema.get("maxProperties", len(value)):
            return False
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            if not self.valid(item, properties[key] if key in properties else extra):
                return False
        return True

    def _array(self, value: Any, schema: dict[str, Any]) -> bool:
        if not isinstance(value, list):
            return True
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)):
            return False
        items = schema.get("items", True)
        prefix = schema.get("prefixItems", items if isinstance(items, list) else [])
        rest = True if isinstance(items, list) else items
        return all(self.valid(item, prefix[i] if i < len(prefix) else rest) for i, item in enumerate(value))

    def _string(self, value: Any, schema: dict[str, Any]) -> bool:
        if not isinstance(value, str):
            return True
        return bool(schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value)))

    def _number(self, value: Any, schema: dict[str, Any]) -> bool:
        if not _TYPES["number"](value):
            return True
        try:
            if "minimum" in schema and value < schema["minimum"]:
                return False
            if "maximum" in schema and value > schema["maximum"]:
                return False
            if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
                return False
            if "exclusiveMaximum" in schema and value >= schema["exclusiveMaximum"]:
                return False
            step = schema.get("multipleOf")
            if step is not None:
                quotient = value / step
                return bool(int(quotient) == quotient)
        except (TypeError, ZeroDivisionError, OverflowError, ValueError):
            return False
        return True
