"""Stop strings: the automaton agrees with a brute-force reference, the detokenizer keeps its semantics (hold-back,
include_stop_str_in_output, the earliest stop wins, min_tokens), the work per token does not grow with the stop
list, and SamplingParams bounds the list."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.engine import detokenizer as detokenizer_module
from kvserve.engine import stop_strings as stop_strings_module
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.stop_strings import StopMatch, StopStringMatcher
from kvserve.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, SamplingParams

ALPHABET = "ab c"  # few letters, so that stop strings overlap, repeat and share prefixes often
stops_st = st.lists(st.text(ALPHABET, min_size=1, max_size=5), min_size=1, max_size=6)
chunks_st = st.lists(st.text(ALPHABET, max_size=6), max_size=12)


# -- brute-force references ---------------------------------------------------------------------------------


def brute_hold(text: str, stops: Sequence[str]) -> int:
    """Longest suffix of `text` that is a proper prefix of some stop string."""
    return max((n for s in stops for n in range(len(s)) if text.endswith(s[:n])), default=0)


def brute_match(text: str, old_len: int, stops: Sequence[str]) -> StopMatch | None:
    """The earliest-starting stop string that ends after `old_len` (ties: first in the list)."""
    found = [
        (i, k)
        for k, s in enumerate(stops)
        for i in range(len(text) - len(s) + 1)
        if text.startswith(s, i) and i + len(s) > old_len
    ]
    if not found:
        return None
    start, index = min(found)
    return StopMatch(start, stops[index])


@dataclass
class ReferenceStream:
    """The detokenizer's stop semantics written out plainly, for one piece of text per token."""

    stops: list[str]
    include: bool
    min_tokens: int
    text: str = ""
    emitted: int = 0
    tokens: int = 0
    stopped_on: str | None = None
    deltas: list[str] = field(default_factory=list)

    def append(self, piece: str) -> None:
        self.tokens += 1
        old = len(self.text)
        self.text += piece
        match = brute_match(self.text, old, self.stops) if self.tokens > self.min_tokens else None
        if match is not None:
            self.text = self.text[: match.start + (len(match.stop) if self.include else 0)]
            self.stopped_on = match.stop
            end = len(self.text)
        else:
            end = len(self.text) - (0 if self.include else brute_hold(self.text, self.stops))
        end = max(end, self.emitted)
        self.deltas.append(self.text[self.emitted : end])
        self.emitted = end

    def finish(self) -> None:
        self.deltas.append(self.text[self.emitted :])
        self.emitted = len(self.text)


class PieceTokenizer:
    """Token id i decodes to PIECES[i]: enough of kvserve's Tokenizer for the detokenizer, with no byte tokens."""

    PIECES = ("a", "b", " ", "c", "ab", "ba", "abc", " a", "cc", "bab")
    special_ids: frozenset[int] = frozenset()

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.PIECES[i] for i in ids)

    def id_to_token(self, token_id: int) -> str:
        return self.PIECES[token_id]


def stream(ids: Sequence[int], **params: object) -> tuple[list[str], str | None, IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(PieceTokenizer(), [], SamplingParams(max_tokens=None, **params))  # type: ignore[arg-type]
    deltas: list[str] = []
    for t in ids:
        result = detok.append(t)
        deltas.append(result.delta_text)
        if result.stopped_on is not None:
            return deltas, result.stopped_on, detok
    final = detok.finish()
    return deltas + [final.delta_text], final.stopped_on, detok


# -- the automaton against the reference --------------------------------------------------------------------


@settings(max_examples=400, deadline=None)
@given(stops=stops_st, chunks=chunks_st, data=st.data())
def test_matcher_equals_brute_force(stops, chunks, data):
    matcher = StopStringMatcher(stops)
    text = ""
    for chunk in chunks:
        detect = data.draw(st.booleans())
        old = len(text)
        text += chunk
        got = matcher.feed(chunk, detect)
        assert got == (brute_match(text, old, stops) if detect else None)
        if got is not None:
            break  # a match ends the sequence: the matcher is not fed again
        assert matcher.held_back == brute_hold(text, stops)


@pytest.mark.parametrize("include", [False, True])
@settings(max_examples=300, deadline=None)
@given(
    stops=stops_st,
    ids=st.lists(st.integers(0, len(PieceTokenizer.PIECES) - 1), max_size=20),
    min_tokens=st.integers(0, 4),
)
def test_detokenizer_equals_reference_stream(include, stops, ids, min_tokens):
    deltas, stopped, detok = stream(ids, stop=stops, include_stop_str_in_output=include, min_tokens=min_tokens)
    ref = ReferenceStream(stops, include, min_tokens)
    for t in ids[: len(deltas)]:
        ref.append(PieceTokenizer.PIECES[t])
        if ref.stopped_on is not None:
            break
    else:
        ref.finish()
    assert (deltas, stopped) == (ref.deltas, ref.stopped_on)
    assert ref.text == "".join(deltas)


def test_semantics_by_example():
    # two stop strings end in the same token ("c" then "abc"): the one that starts first wins, whatever the order
    assert stream([3, 6], stop=["bc", "cab"])[:2] == (["", ""], "cab")
    # same start: the first in the list (include_stop_str_in_output shows which one was cut)
    assert stream([3, 6], stop=["cab", "ca"], include_stop_str_in_output=True)[:2] == (["c", "ab"], "cab")
    assert stream([3, 6], stop=["ca", "cab"], include_stop_str_in_output=True)[:2] == (["c", "a"], "ca")
    # include_stop_str_in_output: nothing is held back, the stop string ends the text
    ids = [0, 1, 2, 3, 0, 1, 3]  # "ab cabc"
    assert stream(ids, stop=["ca"], include_stop_str_in_output=True)[:2] == (["a", "b", " ", "c", "a"], "ca")
    assert stream(ids, stop=["bc", "cab"])[:2] == (["a", "", "b ", "", "", ""], "cab")
    # a partial stop is held back, then released when it cannot grow any more, or at the end
    assert stream([0, 1, 1], stop=["abc"])[0] == ["", "", "abb", ""]
    assert stream([0, 1], stop=["abc"])[0] == ["", "", "ab"]
    # min_tokens: the first "ab" (tokens 1-2) does not count, the second one does
    assert stream([0, 1, 2, 0, 1], stop=["ab"], min_tokens=2)[:2] == (["", "ab", " ", "", ""], "ab")


# -- the work per token is bounded --------------------------------------------------------------------------


@contextmanager
def count_lines(*modules: object) -> Iterator[list[int]]:
    """Counts Python lines executed in `modules`: the work done there, whether in loops or in calls."""
    files = {Path(m.__file__).resolve() for m in modules}  # type: ignore[attr-defined]
    count = [0]

    def local(frame, event, arg):
        if event == "line":
            count[0] += 1
        return local

    def tracer(frame, event, arg):
        return local if Path(frame.f_code.co_filename).resolve() in files else None

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        yield count
    finally:
        sys.settrace(previous)


def lines_per_token(stops: list[str], num_tokens: int) -> float:
    """Lines run in the detokenizer and the matcher per appended token (one "a" each) under `stops`."""
    detok = IncrementalDetokenizer(PieceTokenizer(), [], SamplingParams(stop=stops, max_tokens=None))
    for _ in range(50):  # warm up: the matcher reaches its deepest state
        detok.append(0)
    with count_lines(detokenizer_module, stop_strings_module) as count:
        for _ in range(num_tokens):
            assert detok.append(0).stopped_on is None
    return count[0] / num_tokens


def test_work_per_token_does_not_grow_with_the_stop_list():
    # The worst case for a per-stop scan: every stop string is a long run of "a" (a prefix of the text at every
    # step, so the hold-back check would test every prefix of every stop string) ending in a letter never seen.
    many = ["a" * (MAX_STOP_STRING_CHARS - 1) + chr(ord("d") + i) for i in range(MAX_STOP_STRINGS)]
    one = ["ad"]
    assert lines_per_token(many, 400) <= 1.2 * lines_per_token(one, 400)


def test_automaton_steps_are_linear_in_the_text():
    many = ["a" * (MAX_STOP_STRING_CHARS - 1) + chr(ord("d") + i) for i in range(MAX_STOP_STRINGS)]
    matcher = StopStringMatcher(many)
    text = ("a" * 300 + "b") * 10
    for i in range(0, len(text), 3):
        assert matcher.feed(text[i : i + 3]) is None
    assert matcher.steps <= 2 * len(text)  # one transition per character plus failure hops paid for by them


# -- bounds -------------------------------------------------------------------------------------------------


def test_stop_list_is_bounded():
    SamplingParams(stop=["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS)  # the bounds themselves are fine
    with pytest.raises(ValueError, match=r"^stop must hold at most 64 strings, got 65"):
        SamplingParams(stop=["x"] * (MAX_STOP_STRINGS + 1))
    with pytest.raises(ValueError, match=r"^stop must hold strings of at most 256 characters, got one of 257"):
        SamplingParams(stop=["ok", "x" * (MAX_STOP_STRING_CHARS + 1)])
    with pytest.raises(ValueError, match=r"^stop must hold at most 64"):  # the hostile request
        SamplingParams(stop=["y" * 4000] * 2000)
