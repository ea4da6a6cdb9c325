"""The preparation thread's memo of rendered prompts' token ids (kvserve/server/prepare.py RenderedTokens): an agent's
request renders the same long text several times (each cache_control mark's render, then the whole prompt), and its
system prompt's renders are the same text every turn. A hit must give the same ids as encoding again, never another
tenant's entry (a hit is faster: timing would tell one client another's text), and the memo stays within its bound."""

from __future__ import annotations

from typing import Any

from kvserve.model.prefix_encoding import EncodedText, PrefixEncoder
from kvserve.server.cache_control import breakpoint_positions
from kvserve.server.prepare import ChatRender, RenderedTokens


class CountingEncoder(PrefixEncoder):
    """A PrefixEncoder's interface (none of its tokenizer): a character a token, every text encoded whole, recorded
    with the earlier renders it was offered."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.offered: list[list[str]] = []

    def extend(self, text: str, earlier: list[EncodedText]) -> EncodedText:
        self.calls.append(text)
        self.offered.append([e.text for e in earlier])
        return EncodedText(text, tuple(ord(c) for c in text), (), ())


def test_a_text_is_encoded_once_per_salt_and_a_hit_gives_a_fresh_copy():
    memo, encode = RenderedTokens(max_tokens=100), CountingEncoder()
    first = memo.get(None, "hello", encode)
    first.append(0)  # a caller's list is its own
    assert memo.get(None, "hello", encode) == [ord(c) for c in "hello"]
    assert encode.calls == ["hello"]
    assert memo.get("tenant-b", "hello", encode) == [ord(c) for c in "hello"]
    assert encode.calls == ["hello", "hello"]  # another salt never reads tenant None's entry
    memo.get("tenant-b", "hello!", encode)
    assert encode.offered[-1] == ["hello"]  # a new text is offered its own salt's renders only (tenant-b's "hello")


def test_the_memo_keeps_at_most_its_bound_least_recently_used_out_first():
    memo, encode = RenderedTokens(max_tokens=10), CountingEncoder()
    for text in ("aaaa", "bbbb"):
        memo.get(None, text, encode)
    memo.get(None, "aaaa", encode)  # used again: "bbbb" is now the oldest
    memo.get(None, "cccc", encode)  # 12 > 10: "bbbb" goes
    memo.get(None, "aaaa", encode)
    memo.get(None, "bbbb", encode)
    assert encode.calls == ["aaaa", "bbbb", "cccc", "bbbb"]
    memo.get(None, "x" * 11, encode)  # larger than the bound alone: encoded, never kept
    memo.get(None, "x" * 11, encode)
    assert encode.calls[-2:] == ["x" * 11, "x" * 11]


class RecordingPreparer:
    """tokenize_messages that records the salt of each render it is asked for."""

    def __init__(self) -> None:
        self.salts: list[str | None] = []

    def tokenize_messages(self, messages: list[dict[str, Any]], render: ChatRender) -> list[int]:
        self.salts.append(render.cache_salt)
        return [ord(c) for m in messages for c in m["content"]]


def test_the_marks_renders_are_made_under_the_requests_salt():
    prep = RecordingPreparer()
    whole = [{"role": "system", "content": "sys"}, {"role": "user", "content": "question"}]
    breakpoint_positions(prep, whole, [("system[0]", whole[:1])], ChatRender(cache_salt="tenant-a"))  # type: ignore[arg-type]
    assert prep.salts and set(prep.salts) == {"tenant-a"}
