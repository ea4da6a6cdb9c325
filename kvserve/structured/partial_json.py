"""What a JSON object cut short says so far: a tool call's arguments when max_tokens ended the reply inside them.

Why: Anthropic's Messages API answers a tool call cut by max_tokens with the partial `tool_use` block (stop_reason
`max_tokens`), whose `input` holds what the arguments said before the cut, as its streams' `input_json_delta` pieces
put together do; kvserve answered 500. The cut text is closed where it stops: an open string ends there, open arrays
and objects are closed, and a member that has no value yet (`{"city": ` or `{"ci`) is left out.

    {"city": "Par          -> {"city": "Par"}
    {"city": "Paris", "da  -> {"city": "Paris"}
    {"days": [1, 2         -> {"days": [1, 2]}
"""

from __future__ import annotations

import json
from typing import Any

MAX_TRIES = 8


def partial_object(text: str) -> dict[str, Any]:
    """The JSON object `text` begins, closed where it is cut (see the module docstring); {} when it says nothing yet,
    or does not begin an object."""
    for candidate in _closings(text):
        try:
            value = json.loads(candidate)
        except ValueError:
            continue
        return value if isinstance(value, dict) else {}
    return {}


def _closings(text: str) -> list[str]:
    """Ways to close `text`, best first: as cut (an open string ended), then at each earlier point where a member or
    element was whole, latest first. One pass over the text; each candidate is the prefix plus its closers."""
    stack: list[str] = []  # the closers of the open containers, innermost last
    in_string = escaped = False
    safe: list[tuple[int, str]] = []  # (prefix length, closers) where the prefix ends a whole member or element
    for i, c in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
            continue
        if c == '"':
            in_string = True
        elif c in "{[":
            stack.append("}" if c == "{" else "]")
            safe.append((i + 1, "".join(reversed(stack))))
        elif c in "}]" and stack:
            stack.pop()
            safe.append((i + 1, "".join(reversed(stack))))
        elif c == "," and stack:
            safe.append((i, "".join(reversed(stack))))
    closers = "".join(reversed(stack))
    as_cut = text[: len(text) - 1] if escaped else text  # a dangling backslash cannot end a string
    whole = [as_cut + ('"' if in_string else "") + closers]
    # The latest few only: text from a grammar is well formed up to the cut, so the latest whole member closes it, and
    # text that is not cannot cost a parse per comma.
    return whole + [text[:end] + tail for end, tail in reversed(safe[-MAX_TRIES:])]
