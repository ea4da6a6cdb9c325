"""The JSON shape measured from raw bytes (kvserve/server/json_limits.py) agrees with the parsed document:
exact depth and container count, values never undercounted, whatever strings, escapes and chunk borders
hold; and the limits name what a body exceeds."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.server import json_limits
from kvserve.server.errors import APIError
from kvserve.server.json_limits import JSONLimits, measure_json

# Strings full of what the scan must not count: brackets, commas, quotes and backslashes, escaped or not.
TRICKY = st.text(alphabet=st.sampled_from(list('[]{},"\\ab\n\u00e9\u4e2d')), max_size=12)
DOCUMENTS = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TRICKY,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(TRICKY, inner, max_size=5),
    max_leaves=40,
)


def parsed_shape(doc: Any, depth: int = 0) -> tuple[int, int, int]:
    """(depth, containers, values) of a parsed document: the truth the byte scan is held to."""
    if isinstance(doc, (list, dict)):
        items = list(doc.values()) if isinstance(doc, dict) else doc
        subs = [parsed_shape(item, depth + 1) for item in items]
        return (max([depth + 1, *(s[0] for s in subs)]), 1 + sum(s[1] for s in subs), 1 + sum(s[2] for s in subs))
    return depth, 0, 1


@settings(max_examples=300, deadline=None)
@given(doc=DOCUMENTS, ascii_only=st.booleans())
def test_measured_shape_matches_the_parsed_document(doc, ascii_only):
    body = json.dumps(doc, ensure_ascii=ascii_only).encode()
    shape = measure_json(body)
    depth, containers, values = parsed_shape(doc)
    assert (shape.depth, shape.containers) == (depth, containers), body
    assert shape.values >= values, body


@settings(max_examples=50, deadline=None)
@given(doc=DOCUMENTS)
def test_chunk_borders_do_not_change_the_shape(doc):
    """With 7-byte chunks, strings, escapes and brackets straddle the borders."""
    body = json.dumps(doc).encode()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(json_limits, "_CHUNK_BYTES", 7)
        small_chunks = measure_json(body)
    assert small_chunks == measure_json(body)


def refusal(body: bytes) -> str:
    with pytest.raises(APIError) as info:
        JSONLimits().check(body)
    assert info.value.status == 400 and info.value.param is None
    return info.value.message


def test_limits_name_what_the_body_exceeds():
    assert "nesting depth" in refusal(b"[" * 65 + b"]" * 65) and "64" in refusal(b"[" * 65 + b"]" * 65)
    assert "arrays and objects" in refusal(b"[" + b"[]," * 20_000 + b"[]]")
    assert "JSON values" in refusal(b'{"prompt": [' + b"1," * 200_000 + b"1]}")
    JSONLimits().check(b"[" * 64 + b"]" * 64)  # at the limit: accepted
    JSONLimits().check(json.dumps({"prompt": "[" * 10_000 + "," * 300_000}).encode())  # inside a string


def test_an_eight_mebibyte_body_of_empty_lists_is_refused_from_its_first_chunk():
    """Counting stops at the first 1 MiB chunk over a limit: the rest of the body is never looked at."""
    body = b'{"prompt": [' + b"[]," * ((8 << 20) // 3) + b"[]]}"
    shape = measure_json(body, stop_over=JSONLimits())
    assert JSONLimits().max_containers < shape.containers <= (1 << 20) // 3 + 1
    assert "arrays and objects" in refusal(body)


def test_a_prompt_of_max_model_len_token_ids_always_fits():
    limits = JSONLimits.for_context(1 << 20)
    limits.check(json.dumps({"prompt": [7] * (1 << 20), "stop_token_ids": [1, 2]}).encode())
