"""Bounds on the shape of JSON request bodies (nesting depth, containers, values), checked before parsing.

Why: parsing and validation cost grows with the number of JSON values, not with the number of bytes. An
8 MiB body of 2.8 million empty lists takes seconds to `json.loads` and tens of seconds for pydantic to
reject item by item (one error object per item), all of it holding the GIL and so the event loop. Within
these bounds the worst body costs a small fraction of that. The measurement never builds Python objects:
a few byte replacements and numpy passes (which release the GIL) over the raw bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from kvserve.server.errors import bad_request
from kvserve.units import MiB

_QUOTE, _COMMA = ord('"'), ord(",")
_OPENS, _CLOSES = (ord("["), ord("{")), (ord("]"), ord("}"))
_CHUNK_BYTES = MiB  # bounds the scan's temporary arrays whatever the body size
_DEFAULT_MAX_VALUES = 1 << 17


@dataclass(frozen=True, slots=True)
class JSONShape:
    """Upper bounds of a JSON text's structure; strings are skipped, so their content never counts."""

    depth: int  # deepest nesting of arrays and objects
    containers: int  # arrays and objects
    values: int  # array items and object members, plus the containers themselves (>= the real count)


@dataclass(frozen=True, slots=True)
class JSONLimits:
    """The largest body shape a route is handed. Requests need far less: a batch of token-id prompts is one
    container per prompt and one value per token; a chat is a few containers per message."""

    max_depth: int = 64
    max_containers: int = 1 << 14
    max_values: int = _DEFAULT_MAX_VALUES

    def __post_init__(self) -> None:
        for name in ("max_depth", "max_containers", "max_values"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def for_context(cls, max_model_len: int) -> JSONLimits:
        """The defaults, with room for two prompts of max-model-len token ids whatever the context length."""
        return cls(max_values=max(_DEFAULT_MAX_VALUES, 2 * max_model_len + 1024))

    def check(self, body: bytes) -> None:
        """Raise a 400 naming the limit that `body` exceeds; stops reading at the first chunk that does."""
        if self._surely_within(body):
            return
        shape = measure_json(body, stop_over=self)
        for got, limit, what in (
            (shape.containers, self.max_containers, "number of arrays and objects"),
            (shape.values, self.max_values, "number of JSON values (array items, object members, arrays and objects)"),
            (shape.depth, self.max_depth, "nesting depth of arrays and objects"),
        ):
            if got > limit:
                raise bad_request(
                    f"The request body is too complex to parse: its {what} exceeds the limit "
                    f"of {limit}. Split the request or simplify its JSON."
                )

    def _surely_within(self, body: bytes) -> bool:
        """Counting brackets and commas inside strings too overestimates every figure, at memchr speed: the
        common body (text prompts, short chats) is cleared without the exact scan."""
        containers = body.count(b"[") + body.count(b"{")
        return (
            max(containers, body.count(b"]") + body.count(b"}")) <= min(self.max_depth, self.max_containers)
            and containers + body.count(b",") + 1 <= self.max_values
        )


def measure_json(body: bytes, stop_over: JSONLimits | None = None) -> JSONShape:
    """The shape of `body` read as JSON (invalid JSON gets some shape too; the parser rejects it later).

    With `stop_over`, counting stops after the first 1 MiB chunk that takes the containers or values over
    those limits (the counts returned are then partial, but over the limit) and the depth is not measured.
    """
    containers, commas, steps = 0, 0, []
    for opened, separators, chunk_steps in _scan(body):
        containers, commas = containers + opened, commas + separators
        steps.append(chunk_steps)
        values = commas + containers + 1
        if stop_over is not None and (containers > stop_over.max_containers or values > stop_over.max_values):
            return JSONShape(depth=0, containers=containers, values=values)
    if not steps:
        return JSONShape(depth=0, containers=0, values=0)
    depths = np.cumsum(np.concatenate(steps), dtype=np.int64)
    return JSONShape(depth=int(depths.max(initial=0)), containers=containers, values=commas + containers + 1)


def _scan(body: bytes) -> Iterator[tuple[int, int, np.ndarray]]:
    """Per chunk: the arrays and objects it opens, its commas and the +1/-1 steps of its brackets, all
    outside strings.

    Escapes are removed first, left to right as JSON reads them (escaped backslashes, then escaped quotes),
    so every quote left opens or closes a string; the running parity of quotes tells what is inside one.
    """
    text = body.replace(b"\\\\", b"").replace(b'\\"', b"") if b"\\" in body else body
    in_string = False
    for start in range(0, len(text), _CHUNK_BYTES):
        chunk = np.frombuffer(text, dtype=np.uint8, count=min(_CHUNK_BYTES, len(text) - start), offset=start)
        inside = np.logical_xor.accumulate(chunk == _QUOTE)
        if in_string:
            np.logical_not(inside, out=inside)
        in_string = bool(inside[-1])
        outside = ~inside
        opens = ((chunk == _OPENS[0]) | (chunk == _OPENS[1])) & outside
        closes = ((chunk == _CLOSES[0]) | (chunk == _CLOSES[1])) & outside
        brackets = opens | closes
        yield (
            int(np.count_nonzero(opens)),
            int(np.count_nonzero((chunk == _COMMA) & outside)),
            (opens.view(np.int8) - closes.view(np.int8))[brackets],
        )
