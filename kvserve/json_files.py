"""Reading a JSON object from a file (a checkpoint's config.json, a safetensors index) with one error shape.
Pure Python, so that `kvserve estimate` (which imports neither torch nor transformers) can use it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; ValueError naming the file when it is missing, unreadable, not JSON or not an
    object."""
    if not path.is_file():
        raise ValueError(f"{path}: file is missing")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data
