"""Where a cache_control mark ends in a prompt's tokens (kvserve/server/cache_control.py breakpoint_positions), on a
template that writes the system text inside the first user turn, as Gemma 3's does: a mark on the system blocks
rendered as a BOS token alone and pinned nothing (kv_cache.pins empty, cache_creation_input_tokens 0, silently);
with a placeholder turn after the mark it ends where the system text does. A mark that cannot be placed is 0 and
logged."""

from __future__ import annotations

import logging
from typing import Any

from kvserve.server.cache_control import breakpoint_positions
from kvserve.server.prepare import ChatRender

BOS, START, END = -1, -2, -3


class GemmaLike:
    """tokenize_messages of a Gemma-3-like template: the system text, if any, opens the first user turn; every other
    message is a turn of its own; characters are tokens."""

    def __init__(self, refuse_partial: bool = False) -> None:
        self.refuse_partial = refuse_partial

    def tokenize_messages(self, messages: list[dict[str, Any]], render: ChatRender) -> list[int]:
        if self.refuse_partial and not render.add_generation_prompt:
            raise ValueError("this template renders whole conversations only")
        system = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
        out = [BOS]
        for m in messages[1:] if system is not None else messages:
            text = m["content"]
            if m["role"] == "user" and system is not None:
                text, system = f"{system}\n\n{text}", None
            out += [START, *map(ord, f"{'model' if m['role'] == 'assistant' else 'user'}\n{text}"), END]
        if render.add_generation_prompt:
            out += [START, *map(ord, "model\n")]
        return out


SYSTEM = "You are a careful assistant. Answer in one line, never use tools."
WHOLE = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "hello there"},
    {"role": "assistant", "content": "hi"},
    {"role": "user", "content": "what is 2+2?"},
]


def test_a_mark_on_the_system_text_ends_where_it_does():
    prep = GemmaLike()
    (end,) = breakpoint_positions(prep, WHOLE, [("system[0]", WHOLE[:1])], ChatRender())
    whole = prep.tokenize_messages(WHOLE, ChatRender())
    assert end == len([BOS, START, *map(ord, f"user\n{SYSTEM}\n\n")])
    assert "".join(chr(t) for t in whole[2:end]) == f"user\n{SYSTEM}\n\n"


def test_a_mark_on_a_message_ends_after_its_turn():
    prep = GemmaLike()
    (end,) = breakpoint_positions(prep, WHOLE, [("messages[1].content[0]", WHOLE[:3])], ChatRender())
    whole = prep.tokenize_messages(WHOLE, ChatRender())
    assert whole[end - 3 : end] == [*map(ord, "hi"), END] and whole[end] == START


def test_a_mark_a_template_cannot_render_is_not_placed(caplog):
    with caplog.at_level(logging.WARNING, logger="kvserve.server.cache_control"):
        assert breakpoint_positions(
            GemmaLike(refuse_partial=True), WHOLE, [("system[0]", WHOLE[:1])], ChatRender()
        ) == [0]
    assert "could not be placed" in caplog.text
