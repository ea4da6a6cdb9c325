"""A tool call's arguments cut by max_tokens, read as far as they go (kvserve/structured/partial_json.py): the Messages
API's partial tool_use block."""

from __future__ import annotations

import pytest

from kvserve.structured.partial_json import partial_object


@pytest.mark.parametrize(
    "cut,said",
    [
        ('{"city": "Par', {"city": "Par"}),
        ('{"city": "Paris", "da', {"city": "Paris"}),
        ('{"city": "Paris", "days": ', {"city": "Paris"}),
        ('{"days": [1, 2', {"days": [1, 2]}),
        ('{"a": {"b": "x\\', {"a": {"b": "x"}}),
        ('{"note": "a, {b}', {"note": "a, {b}"}),
        ('{"ok": tr', {}),
        ('{"ci', {}),
        ("", {}),
        ("[1, 2", {}),  # not an object: arguments are one
        ('{"city": "Paris"}', {"city": "Paris"}),
    ],
)
def test_a_cut_object_says_what_it_said_so_far(cut, said):
    assert partial_object(cut) == said
