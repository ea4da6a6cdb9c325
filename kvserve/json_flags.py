"""vLLM's JSON-object flags (--speculative-config, --kv-events-config): read once, the same way, into a config
dataclass. Pure Python."""

from __future__ import annotations

import json
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
