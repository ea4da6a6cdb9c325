"""Tool calls read from text as it streams: what an extractor reports, and the scanners the extractors share.

Why a character-at-a-time design: OpenAI streams a tool call as pieces (the call's name first, then its `arguments`
JSON in parts), and the concatenated stream must equal the non-streamed response. An extractor (tool_parsers.py)
takes the text as it arrives (`feed`) and reports what is new: content text, a call's start (its name) and pieces of
its arguments. It reads one character at a time and holds back only what may still turn out to be markup (a
partial `<tool_call>`, whitespace before one), so its output does not depend on how the text was cut; a
non-streamed response runs the same machine over the whole text (`extract_all`). Each character is read once.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(slots=True)
class CallPiece:
    """New text of one tool call: its name with its first piece (None after), and the next part of its arguments."""

    index: int  # the call's position among this output's calls
    name: str | None
    arguments: str


@dataclass(slots=True)
class ParsedDelta:
    """What one feed produced: new content text and new call pieces (at most one per call, in call order)."""

    content: str = ""
    calls: list[CallPiece] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)

    def extend(self, other: ParsedDelta) -> ParsedDelta:
        self.content += other.content
        for piece in other.calls:
            _merge_piece(self.calls, piece)
        return self


def _merge_piece(pieces: list[CallPiece], piece: CallPiece) -> None:
    """Add `piece`, joined to the last one if it is for the same call (one piece per call per delta)."""
    if pieces and pieces[-1].index == piece.index:
        last = pieces[-1]
        last.name = last.name if last.name is not None else piece.name
        last.arguments += piece.arguments
    else:
        pieces.append(CallPiece(piece.index, piece.name, piece.arguments))


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One whole call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ExtractedToolCalls:
    """A whole output, parsed: its content (None when empty) and its calls."""

    content: str | None
    calls: list[ToolCall]


class ToolCallExtractor(Protocol):
    """One output's incremental parser (one per choice)."""

    def feed(self, text: str) -> ParsedDelta:
        """Take the next piece of the output; return what it completes."""
        ...

    def finish(self) -> ParsedDelta:
        """The output has ended: release what was held back."""
        ...


class ToolCallAccumulator:
    """Puts deltas back together: the non-streamed response, and the test oracle for streams."""

    def __init__(self) -> None:
        self._content: list[str] = []
        self._names: list[str] = []
        self._arguments: list[list[str]] = []

    def add(self, delta: ParsedDelta) -> None:
        self._content.append(delta.content)
        for piece in delta.calls:
            if piece.index == len(self._names):
                self._names.append(piece.name or "")
                self._arguments.append([])
            self._arguments[piece.index].append(piece.arguments)

    @property
    def num_calls(self) -> int:
        return len(self._names)

    def result(self) -> ExtractedToolCalls:
        content = "".join(self._content)
        calls = [ToolCall(name, "".join(args)) for name, args in zip(self._names, self._arguments)]
        return ExtractedToolCalls(content or None, calls)


def extract_all(extractor: ToolCallExtractor, text: str) -> ExtractedToolCalls:
    """A whole output through `extractor` (a fresh one)."""
    acc = ToolCallAccumulator()
    acc.add(extractor.feed(text))
    acc.add(extractor.finish())
    return acc.result()


def feed_in_order(extractor: ToolCallExtractor, text: str, finished: bool) -> list[ParsedDelta]:
    """`text` through `extractor` a character at a time (then its finish, when `finished`): what it reports, as parts
    in the order the text has them, each content only or call pieces only (neighbours of a kind joined). A delta puts
    its content before its calls whatever the text did (a call closed, then text, within one piece): the Messages API
    gives its blocks in the order written."""
    parts: list[ParsedDelta] = []

    def add(delta: ParsedDelta) -> None:
        if delta.content:
            if parts and parts[-1].content:
                parts[-1].content += delta.content
            else:
                parts.append(ParsedDelta(delta.content))
        if delta.calls:
            if parts and parts[-1].calls:
                parts[-1].extend(ParsedDelta("", delta.calls))
            else:
                parts.append(ParsedDelta("", [CallPiece(p.index, p.name, p.arguments) for p in delta.calls]))

    for c in text:
        add(extractor.feed(c))
    if finished:
        add(extractor.finish())
    return parts


# -- shared pieces ---------------------------------------------------------------------------------------------


class ContentText:
    """Content text with its whitespace rules: none before the first visible character, none held before markup or
    the end (whitespace is released only when a visible character follows it)."""

    def __init__(self) -> None:
        self.out: list[str] = []
        self._held: list[str] = []
        self._started = False

    def char(self, c: str) -> None:
        if c.isspace():
            if self._started:
                self._held.append(c)
            return
        if self._held:
            self.out.extend(self._held)
            self._held.clear()
        self.out.append(c)
        self._started = True

    def text(self, s: str) -> None:
        for c in s:
            self.char(c)

    def drop_held(self) -> None:
        """Markup follows: the whitespace before it is not content."""
        self._held.clear()

    def take(self) -> str:
        s = "".join(self.out)
        self.out.clear()
        return s


class StrippedText:
    """Text with leading and trailing whitespace dropped, as it streams (trailing runs held until text follows)."""

    def __init__(self) -> None:
        self._held: list[str] = []
        self._started = False

    def feed(self, text: str) -> str:
        out: list[str] = []
        for c in text:
            if c.isspace():
                if self._started:
                    self._held.append(c)
                continue
            out.extend(self._held)
            self._held.clear()
            out.append(c)
            self._started = True
        return "".join(out)


class Marker:
    """Matches a fixed marker (`<tool_call>`) in a character stream, holding back a partial match."""

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self.pending = ""

    def char(self, c: str, emit: Callable[[str], None]) -> bool:
        """Take `c`; characters that cannot start the marker go to `emit`; True when the marker is complete."""
        self.pending += c
        while self.pending and not self.marker.startswith(self.pending):
            emit(self.pending[0])
            self.pending = self.pending[1:]
        if self.pending == self.marker:
            self.pending = ""
            return True
        return False

    def flush(self, emit: Callable[[str], None]) -> None:
        for c in self.pending:
            emit(c)
        self.pending = ""


# -- one JSON call object, {"name": "f", "arguments": {...}} -----------------------------------------------------


class JSONValueScanner:
    """The extent of one JSON value, read a character at a time: done when it is complete. A scalar (number,
    true, null) ends at the first character that cannot be part of it, which is then not consumed."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.started = False
        self.scalar = False
        self.done = False

    def char(self, c: str) -> bool:
        """Take `c`; False when `c` is not part of the value (a scalar's terminator): the value is then done."""
        if not self.started:
            self.started = True
            if c in "{[":
                self.depth = 1
            elif c == '"':
                self.in_string = True
            else:
                self.scalar = True
            return True
        if self.scalar:
            if c in ",}] \t\r\n":
                self.done = True
                return False
            return True
        if self.in_string:
            if self.escape:
                self.escape = False
            elif c == "\\":
                self.escape = True
            elif c == '"':
                self.in_string = False
                self.done = self.depth == 0
            return True
        if c == '"':
            self.in_string = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            self.done = self.depth == 0
        return True


NAME_KEY = "name"  # the key of a call object that holds the function's name


class CallObjectScanner:
    """One JSON object naming a call, read as it arrives: its name (once the string is complete) and the raw text of
    its arguments value (under one of `argument_keys`), piece by piece. Other keys are skipped."""

    def __init__(self, argument_keys: Sequence[str]) -> None:
        self.argument_keys = tuple(argument_keys)
        self.state = "start"  # start, key_or_end, key, colon, value, after_value, done, invalid
        self.key_chars: list[str] = []
        self.key_escape = False
        self.key = ""
        self.value: JSONValueScanner | None = None
        self.name_chars: list[str] = []
        self.name: str | None = None
        self.arguments: list[str] = []  # argument text read but not yet taken
        self.saw_arguments = False

    @property
    def done(self) -> bool:
        return self.state == "done"

    @property
    def invalid(self) -> bool:
        return self.state == "invalid"

    def char(self, c: str) -> bool:
        """Take `c`; False if it is past the object (the object is done, or invalid)."""
        state = self.state
        if state in ("done", "invalid"):
            return False
        if state == "value":
            return self._value_char(c)
        if c.isspace() and state != "key":
            return True
        if state == "start":
            self.state = "key_or_end" if c == "{" else "invalid"
        elif state == "key_or_end":
            if c == '"':
                self.state, self.key_chars = "key", []
            else:
                self.state = "done" if c == "}" else "invalid"
        elif state == "key":
            self._key_char(c)
        elif state == "colon":
            self.state = "value" if c == ":" else "invalid"
            self.value = JSONValueScanner()
        elif state == "after_value":
            self.state = {",": "key_or_end", "}": "done"}.get(c, "invalid")
        return self.state != "invalid"

    def _key_char(self, c: str) -> None:
        if self.key_escape:
            self.key_escape = False
        elif c == "\\":
            self.key_escape = True
        elif c == '"':
            try:
                self.key = json.loads('"' + "".join(self.key_chars) + '"')
            except json.JSONDecodeError:
                self.state = "invalid"
                return
            self.state = "colon"
            if self.key in self.argument_keys:
                self.saw_arguments = True
            return
        self.key_chars.append(c)

    def _value_char(self, c: str) -> bool:
        value = self.value
        assert value is not None
        if not value.started and c.isspace():
            return True
        if not value.char(c):  # a scalar's terminator: the value ended before it
            self.state = "after_value"
            self._end_value()
            return self.char(c)
        self._keep(c)
        if value.done:
            self.state = "after_value"
            self._end_value()
        return True

    def _keep(self, c: str) -> None:
        if self.key == NAME_KEY:
            self.name_chars.append(c)
        elif self.key in self.argument_keys:
            self.arguments.append(c)

    def _end_value(self) -> None:
        if self.key != NAME_KEY or self.name is not None:
            return
        try:
            name = json.loads("".join(self.name_chars))
        except json.JSONDecodeError:
            name = None
        if isinstance(name, str) and name:
            self.name = name
        else:
            self.state = "invalid"

    def take_arguments(self) -> str:
        text = "".join(self.arguments)
        self.arguments.clear()
        return text


class CallNumbering:
    """The calls of one output, numbered, with what each has reported."""

    def __init__(self) -> None:
        self.count = 0
        self.open: int | None = None  # the call whose name has been reported and may still get arguments
        self.pieces: list[CallPiece] = []

    def start(self, name: str, arguments: str = "") -> None:
        self.open = self.count
        self.count += 1
        _merge_piece(self.pieces, CallPiece(self.open, name, arguments))

    def arguments(self, text: str) -> None:
        if text and self.open is not None:
            _merge_piece(self.pieces, CallPiece(self.open, None, text))

    def close(self) -> None:
        self.open = None

    def take(self) -> list[CallPiece]:
        pieces, self.pieces = self.pieces, []
        return pieces


def report_call_object(obj: CallObjectScanner, calls: CallNumbering, started: bool) -> bool:
    """Report what `obj` has for its call (the start once its name is known, then its arguments); True once the
    call has started. An object that completes without arguments gets "{}"."""
    if not started:
        if obj.name is None:
            return False
        calls.start(obj.name)
        started = True
    calls.arguments(obj.take_arguments())
    if obj.done and not obj.saw_arguments:
        calls.arguments("{}")
    return started


def drop_char(_: str) -> None:
    """Where characters go that nobody keeps."""
