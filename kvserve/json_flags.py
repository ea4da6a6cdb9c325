"""vLLM's JSON-object flags (--speculative-config, --kv-events-config): read once, the same way, into a config
dataclass. Pure Python."""

from __future__ import annotations

import json
import math
import types
import typing
from dataclasses import fields
from typing import Any, TypeVar

ConfigT = TypeVar("ConfigT")


def config_from_json_flag(
    value: str | dict[str, Any] | ConfigT | None, cls: type[ConfigT], name: str, required: tuple[str, ...] = ()
) -> ConfigT | None:
    """`value` as a `cls`: the flag's JSON text, a dict (the offline API) or a `cls` already; None (the default)
    means off. ValueError naming the flag for text that is not a JSON object, unknown keys or missing `required`
    ones; the dataclass's own checks run on construction."""
    if value is None or isinstance(value, cls):
        return value
    flag = "--" + name.replace("_", "-")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, got {type(value).__name__}")
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"unknown {name} keys {unknown}; known: {sorted(known)}")
    for key in required:
        if key not in value:
            raise ValueError(f"{name} needs a {key!r}")
    return cls(**value)


def check_field_types(config: Any, name: str) -> None:
    """ValueError naming the flag and the key for the first field of the dataclass `config` whose value is not of
    its annotated type: each config dataclass calls it first in __post_init__, so a config built from the flag's
    JSON, a dict or directly is checked the same way (`name`: the config's flag name, e.g. speculative_config)."""
    flag = "--" + name.replace("_", "-")
    hints = typing.get_type_hints(type(config))
    for field in fields(config):
        _check_type(flag, field.name, getattr(config, field.name), hints[field.name])


def _check_type(flag: str, key: str, value: Any, annotation: Any) -> None:
    """ValueError naming the flag and key unless `value` is of the field's type: JSON's true is no integer here
    (Python's bool is an int), a float field takes integers but not NaN or infinity (1e400 parses as infinity),
    an integer field takes no float, and `X | None` takes null."""
    options = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else ()
    allowed = [a for a in options if a is not type(None)] if options else [annotation]
    if value is None and type(None) in options:
        return
    for kind in allowed:
        if kind is bool and isinstance(value, bool):
            return
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ValueError(f"{flag}: {key} must be a finite number, got {value!r}")
            return
        if kind is str and isinstance(value, str):
            return
        if kind not in (bool, int, float, str) and isinstance(value, kind):
            return
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "null"}
    kinds = [*allowed, type(None)] if type(None) in options else allowed
    expected = " or ".join(names.get(k, getattr(k, "__name__", str(k))) for k in kinds)
    shown = json.dumps(value) if _jsonable(value) else repr(value)
    raise ValueError(f"{flag}: {key} must be {expected}, got {shown}")


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True
