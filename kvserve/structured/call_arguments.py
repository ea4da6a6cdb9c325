"""What a tool call read out of free text may be: a call to a function the request offered, whose `arguments` are one
JSON object that a strict parser reads (and, for a function marked `strict`, valid for its parameters schema).

Why one place: every parser of unforced text (hermes, pythonic; kvserve.structured.tool_parsers) asks the same two
questions before it reports a call, and a client must be able to trust the answer whatever the format. The model's
text is not trusted: it writes `{"city": Paris}` unforced, a tag can name `delete_all_files` or `../../etc/passwd`,
and Python's own `json` module reads `NaN`, `Infinity`, `1e999` (as inf) and duplicate keys that JavaScript's,
Go's or Rust's parsers refuse or read differently. What fails stays content, so the client sees what the model wrote.
Forced calls (tool_choice required or a named function) need no check: their grammar already is one.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from kvserve.structured.schema_validate import is_valid

if TYPE_CHECKING:
    from kvserve.structured.tool_schemas import FunctionTool


class _DuplicateKey(ValueError):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's members; a key given twice is an error (Python keeps the last, other parsers the first)."""
    value = dict(pairs)
    if len(value) != len(pairs):
        raise _DuplicateKey("duplicate key")
    return value


def strict_json(text: str) -> Any:
    """The JSON value `text` holds, read as RFC 8259 says and every parser agrees: no NaN or Infinity (nor a number
    too large for a double, which Python reads as inf), no duplicate keys, no lone surrogates; ValueError otherwise."""
    try:
        value = json.loads(text, object_pairs_hook=_no_duplicate_keys)
        # allow_nan=False refuses NaN, Infinity and overflowed numbers; encoding refuses a lone surrogate (\ud800)
        json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (ValueError, UnicodeEncodeError, RecursionError) as e:
        raise ValueError(f"not strict JSON: {e}") from None
    return value


def strict_json_object(text: str) -> dict[str, Any] | None:
    """The object `text` holds if it is one JSON object under strict_json, else None."""
    try:
        value = strict_json(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


@dataclass(frozen=True, slots=True)
class OfferedTools:
    """The functions one request offers: their names (only these become calls) and the parameters schemas of those
    marked `strict`, which a call's arguments must satisfy."""

    names: frozenset[str] = frozenset()
    strict_schemas: Mapping[str, dict[str, Any]] = field(default_factory=lambda: MappingProxyType({}))
    # Every function's parameters schema: how a format that writes arguments as text (Qwen3.5's XML) types them.
    schemas: Mapping[str, dict[str, Any]] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def of(cls, tools: OfferedTools | Collection[str]) -> OfferedTools:
        """`tools` as given: already OfferedTools, or bare names (no schema checked)."""
        return tools if isinstance(tools, OfferedTools) else cls(frozenset(tools))

    @classmethod
    def of_functions(cls, functions: Iterable[FunctionTool]) -> OfferedTools:
        """A request's checked `tools` (the last of one name wins, as vLLM's lookup does)."""
        last = {f.name: f for f in functions}
        strict = {name: f.parameters for name, f in last.items() if f.strict}
        schemas = {name: f.parameters for name, f in last.items()}
        return cls(frozenset(last), MappingProxyType(strict), MappingProxyType(schemas))

    def arguments(self, name: str, arguments: str) -> str | None:
        """`arguments` (whitespace stripped) if a call to `name` with them is one to return, else None: the function
        was not offered, the text is not one strict JSON object, or a strict function's schema refuses it."""
        if name not in self.names:
            return None
        value = strict_json_object(arguments)
        if value is None:
            return None
        schema = self.strict_schemas.get(name)
        if schema is not None and not is_valid(value, schema):
            return None
        return arguments.strip()
