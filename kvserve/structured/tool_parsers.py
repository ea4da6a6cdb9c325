"""Tool calls out of generated text, as it streams: the `auto` parsers (vLLM's names) and the forced formats.

Each extractor reads the text one character at a time as it arrives and reports content, call starts and argument
pieces (tool_calls.py: why, and the pieces they share), so that a stream put together equals the whole reply.

Formats:
- `hermes` (vLLM's name): Hermes and Qwen models, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, text
  outside the blocks being content;
- `pythonic` (vLLM's name; `gemma3` is kvserve's alias for it): Gemma 3's documented function-calling style and
  Llama 3.2's, a Python list of calls with keyword arguments, `[get_weather(city="Paris"), now()]`, whose literal
  values become JSON; output that does not start as such a list is content;
- `qwen3_coder` (vLLM's name): Qwen3-Coder's and Qwen3.5's XML, `<tool_call><function=NAME><parameter=KEY>VALUE
  </parameter></function></tool_call>`, each value typed by its parameter's schema;
- `lfm2` (SGLang's name): LFM2's and LFM2.5's pythonic list between special tokens,
  `<|tool_call_start|>[get_weather(city="Paris")]<|tool_call_end|>` (or a JSON list of `{"name", "arguments"}` there,
  which the models write when their system prompt asks for JSON), text outside the markers being content;
- the forced formats of tool_choice `required` (vLLM's JSON array of `{"name", "parameters"}`) and of a named
  function (the output is the arguments object).

Each parser comes with its prompt style (tool_prompts.py): how a chat template without tool support gets tools,
calls and results written into the prompt in the same format.

The parsers of free text (hermes, pythonic, qwen3_coder, lfm2) report a call whole, once it closes, and only after
the check every such parser shares (kvserve.structured.call_arguments): the function is one the request offered, its
`arguments` are one JSON object a strict parser reads (valid for its schema when the function is `strict`). Anything
else, a call cut by max_tokens included, stays content. `arguments` is the JSON text the model wrote for them (leading
and trailing whitespace dropped); pythonic arguments are built as JSON from the keywords. A forced call (its grammar is
its check) streams its arguments in pieces; cut short by max_tokens, it keeps what was generated, with finish_reason
"length" telling the client so.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from kvserve.model.chat_template import JSONToolStyle, ToolPromptStyle
from kvserve.structured.call_arguments import OfferedTools, strict_json_object
from kvserve.structured.tool_calls import (
    NAME_KEY,
    CallNumbering,
    CallObjectScanner,
    ContentText,
    Marker,
    ParsedDelta,
    StrippedText,
    ToolCallExtractor,
    extract_all,
    report_call_object,
)
from kvserve.structured.tool_prompts import (
    HERMES_END,
    HERMES_START,
    LFM2_CALL_END,
    LFM2_CALL_START,
    HermesStyle,
    LFM2Style,
    PythonicStyle,
    Qwen3XMLStyle,
)

# -- hermes -----------------------------------------------------------------------------------------------------


class HermesExtractor:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks; the text outside them is content.

    Two rules of kvserve's own (docs/AGENTS.md):
    - a call is reported whole (name and arguments in one piece), once its block closes: the JSON object, then
      `</tool_call>` (or the end of the reply), so that a stream never carries half a call: a block that is
      malformed (not strict JSON, arguments that are no object, a second object or other text after the call
      before its `</tool_call>`), names a function the request did not offer, or is cut by max_tokens inside its
      object is content, its markers included, streamed or not (vLLM returns a cut call as content too, but reads
      any name and Python's lax JSON);
    - given the request's tool names, a reply that *opens* with a bare call object (`{"name": "get_weather",
      "arguments": {...}}`) or with one in a ```json fence is read as calls as well, when the name is one of the
      request's tools; several such objects in a row (bare, or one after another in one fence) are parallel calls.
      Qwen2.5-Coder-0.5B-Instruct writes its calls that way: the `<tool_call>` token is about e^-23 likely after its
      own template's prompt (HF transformers agrees), so vLLM's hermes parser returns its calls as content.
    """

    argument_keys = ("arguments", "parameters")

    def __init__(self, tools: OfferedTools | Collection[str] = ()) -> None:
        self._tools = OfferedTools.of(tools)
        self._content = ContentText()
        self._calls = CallNumbering()
        self._start = Marker(HERMES_START)
        self._end = Marker(HERMES_END)
        self._fence_end = Marker(_FENCE)
        # lead (nothing but whitespace yet, or only calls: a bare or fenced call may open), outside, fence_open,
        # object (a call object being read), after_tag (before </tool_call>), after_fence (before the closing ```)
        self._state = "lead" if self._tools.names else "outside"
        self._form = ""  # the open call's wrapping: tag, bare, fence
        self._object: CallObjectScanner | None = None
        self._raw: list[str] = []  # the open call's text, content if it turns out not to be a call
        self._object_text: list[str] = []  # the call object's own text (its wrapping left out)
        self._closed_call: tuple[str, str] | None = None  # a tag's call (name, arguments), until its </tool_call>

    def feed(self, text: str) -> ParsedDelta:
        for c in text:
            self._char(c)
        return self._take()

    def finish(self) -> ParsedDelta:
        if self._state in ("object", "fence_open"):
            self._give_back()
        elif self._state == "outside":
            self._start.flush(self._content.char)
        elif self._state == "after_tag":  # the reply ended after a whole call: its `</tool_call>` may be left out
            self._report_tag_call()
        self._calls.close()
        return self._take()

    def _take(self) -> ParsedDelta:
        return ParsedDelta(self._content.take(), self._calls.take())

    def _char(self, c: str) -> None:
        state = self._state
        if state == "object":
            self._object_char(c)
        elif state == "outside":
            if self._start.char(c, self._content.char):
                self._content.drop_held()
                self._open("tag", HERMES_START)
        elif state == "lead":
            self._lead_char(c)
        elif state == "fence_open":
            self._fence_open_char(c)
        elif state == "after_tag":
            self._after_tag_char(c)
        else:  # after_fence
            self._after_call_char(c, self._fence_end)

    def _lead_char(self, c: str) -> None:
        if c.isspace():
            return
        if c == "{":
            self._open("bare", "")
            self._object_char(c)
        elif c == "`":
            self._state, self._raw = "fence_open", [c]
        else:
            self._state = "outside"
            self._char(c)

    def _fence_open_char(self, c: str) -> None:
        """```, an optional `json` tag, whitespace, then the object's `{`; anything else is content."""
        self._raw.append(c)
        opening = "".join(self._raw)
        ticks = len(_FENCE)
        if len(opening) <= ticks:
            if c != "`":
                self._give_back()
        elif c == "{":
            if opening[ticks:-1].strip().lower() not in ("", "json"):
                self._give_back()
                return
            raw = self._raw
            self._open("fence", "")
            self._raw = raw[:-1]
            self._object_char(c)
        elif not (c.isspace() or _FENCE_TAG.startswith(opening[ticks:].lower())):
            self._give_back()

    def _open(self, form: str, raw: str) -> None:
        self._state, self._form = "object", form
        self._object = CallObjectScanner(self.argument_keys)
        self._raw = [raw] if raw else []
        self._object_text = []

    def _object_char(self, c: str) -> None:
        obj = self._object
        assert obj is not None
        self._raw.append(c)
        self._object_text.append(c)
        obj.char(c)
        if obj.invalid or (self._form != "tag" and not self._may_be_call(obj)):
            self._give_back()
        elif obj.done:
            arguments = self._checked_arguments(obj)
            if obj.name is None or arguments is None:
                self._give_back()
                return
            if self._form == "tag":  # reported when its </tool_call> comes: a tag holds one call and nothing else
                self._closed_call = (obj.name, arguments)
                self._state = "after_tag"
                return
            self._calls.start(obj.name, arguments)
            self._calls.close()
            self._state = "after_fence" if self._form == "fence" else "lead"
            self._raw = []

    def _after_tag_char(self, c: str) -> None:
        """Whitespace, then `</tool_call>`: the tag's call is reported. Anything else (a second object, text): the
        whole block so far is content, and what broke it is read again from outside a block."""
        self._raw.append(c)
        end = self._end
        if end.pending == "" and c.isspace():
            return
        leftover: list[str] = []
        if end.char(c, leftover.append):
            self._report_tag_call()
            self._state = "lead" if self._tools.names else "outside"
            return
        if leftover:
            again = leftover + list(end.pending)
            end.pending = ""
            self._closed_call = None
            self._raw = self._raw[: len(self._raw) - len(again)]
            self._give_back()
            for x in again:
                self._char(x)

    def _report_tag_call(self) -> None:
        assert self._closed_call is not None
        name, arguments = self._closed_call
        self._closed_call = None
        self._raw = []
        self._end.pending = ""
        self._calls.start(name, arguments)
        self._calls.close()

    def _checked_arguments(self, obj: CallObjectScanner) -> str | None:
        """The closed call's arguments if it is one to report (the shared check, OfferedTools.arguments, after the
        call object itself is strict JSON: one `name`, no NaN beside the arguments), else None."""
        if obj.name is None or strict_json_object("".join(self._object_text)) is None:
            return None
        return self._tools.arguments(obj.name, obj.take_arguments() if obj.saw_arguments else "{}")

    def _may_be_call(self, obj: CallObjectScanner) -> bool:
        """A bare or fenced object stays a candidate while its keys are a call's and its name a requested tool's."""
        if obj.name is not None and obj.name not in self._tools.names:
            return False
        return obj.state not in ("colon", "value") or obj.key in (NAME_KEY, *self.argument_keys)

    def _after_call_char(self, c: str, end: Marker) -> None:
        """Whitespace, then the call's closing marker; anything else is content again (a missing marker). Inside a
        fence another call object may follow first: the model's parallel calls, one per line in one fence."""
        if end.pending == "" and c.isspace():
            return
        if end.pending == "" and c == "{" and self._state == "after_fence":
            self._open("fence", "")
            self._object_char(c)
            return
        leftover: list[str] = []
        if end.char(c, leftover.append):
            self._state = "lead" if self._tools.names else "outside"
            return
        if leftover:
            self._state = "outside"
            end.pending = ""
            for x in leftover:
                self._char(x)

    def _give_back(self) -> None:
        """The open text names no call after all: it is content (the marker included)."""
        self._state = "outside"
        self._object = None
        raw, self._raw = self._raw, []
        self._content.text("".join(raw))


_FENCE = "```"
_FENCE_TAG = "json"


# -- qwen3_coder (Qwen3.5's XML calls) --------------------------------------------------------------------------


class _MarkedBlocks:
    """Calls in blocks between a start and an end marker, the text outside them content (the qwen3_coder and lfm2
    parsers): a block is read once it closes (or the reply ends inside it), its calls reported whole, all of them or
    none; a block that does not read (`_read` gives no call) is content, its markers included."""

    start_marker = ""
    end_marker = ""

    def __init__(self, tools: OfferedTools | Collection[str] = ()) -> None:
        self._tools = OfferedTools.of(tools)
        self._content = ContentText()
        self._calls = CallNumbering()
        self._start = Marker(self.start_marker)
        self._end = Marker(self.end_marker)
        self._inside = False
        self._raw: list[str] = []  # the open block's text after its start marker

    def _read(self, body: str) -> list[tuple[str, str]]:
        """(name, arguments JSON) of every call a block's text holds, each passing the shared check; [] if not."""
        raise NotImplementedError

    def feed(self, text: str) -> ParsedDelta:
        for c in text:
            self._char(c)
        return self._take()

    def finish(self) -> ParsedDelta:
        if self._inside:
            self._close(ended=True)
        else:
            self._start.flush(self._content.char)
        self._calls.close()
        return self._take()

    def _take(self) -> ParsedDelta:
        return ParsedDelta(self._content.take(), self._calls.take())

    def _char(self, c: str) -> None:
        if not self._inside:
            if self._start.char(c, self._content.char):
                self._content.drop_held()
                self._inside, self._raw = True, []
            return
        if self._end.char(c, self._raw.append):
            self._close(ended=False)

    def _close(self, ended: bool) -> None:
        """The block closed (or the reply ended inside it): its calls if it reads as them, else content."""
        self._end.flush(self._raw.append)
        self._inside = False
        body = "".join(self._raw)
        calls = self._read(body)
        if not calls:
            self._content.text(self.start_marker + body + ("" if ended else self.end_marker))
            return
        for name, arguments in calls:
            self._calls.start(name, arguments)
            self._calls.close()


class Qwen3XMLExtractor(_MarkedBlocks):
    """`<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>` blocks (Qwen3-Coder's
    and Qwen3.5's format; vLLM's `qwen3_coder` parser); the text outside them is content.

    A value is text: it becomes the JSON its parameter's schema asks for (a number, a boolean, null, an object or an
    array, read as JSON), else a string (a value that does not read as its schema's type stays the string, as in
    vLLM). A call is reported whole once its block closes, and only if it passes the shared check (an offered
    function; a strict one's schema); a block that is malformed, names another function, or is cut by max_tokens is
    content, its markers included. A block whose `</function>` came but whose `</tool_call>` did not (the reply
    ended) is still a call."""

    start_marker = HERMES_START
    end_marker = HERMES_END

    def _read(self, body: str) -> list[tuple[str, str]]:
        call = _xml_call(body, self._tools)
        return [] if call is None else [call]


_XML_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.DOTALL)
_XML_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def _xml_call(body: str, tools: OfferedTools) -> tuple[str, str] | None:
    """(name, arguments JSON) of one block's text, if it is one call of an offered function whose arguments pass
    the shared check; else None."""
    match = _XML_FUNCTION.fullmatch(body)
    if match is None:
        return None
    name, inner = match.group(1).strip(), match.group(2)
    arguments: dict[str, Any] = {}
    at = 0
    for parameter in _XML_PARAMETER.finditer(inner):
        if inner[at : parameter.start()].strip():
            return None
        key = parameter.group(1).strip()
        if key in arguments:
            return None
        arguments[key] = _xml_value(_strip_newline(parameter.group(2)), tools.schemas.get(name, {}), key)
        at = parameter.end()
    if inner[at:].strip():
        return None
    checked = tools.arguments(name, json.dumps(arguments, ensure_ascii=False))
    return None if checked is None else (name, checked)


def _strip_newline(text: str) -> str:
    """A value without the one newline the format puts after its opening tag and before its closing one."""
    text = text[1:] if text.startswith("\n") else text
    return text[:-1] if text.endswith("\n") else text


def _xml_value(text: str, schema: Mapping[str, Any], key: str) -> Any:
    """A parameter's text as its schema's type asks: a string parameter's (or one the schema does not describe) as
    written, any other type's as the JSON it reads as (text that does not read stays the string, as in vLLM)."""
    properties = schema.get("properties")
    spec = properties.get(key) if isinstance(properties, Mapping) else None
    kind = spec.get("type") if isinstance(spec, Mapping) else None
    kinds = set(kind) if isinstance(kind, list) else {kind}
    if kind is None or "string" in kinds:
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


# -- pythonic ---------------------------------------------------------------------------------------------------


def _is_name_char(c: str) -> bool:
    return c.isalnum() or c in "_.-"


class _PythonLiteral:
    """The extent of one Python literal argument: it ends at a `,` or `)` outside brackets and strings."""

    def __init__(self) -> None:
        self.chars: list[str] = []
        self.depth = 0
        self.quote = ""
        self.escape = False

    def char(self, c: str) -> bool:
        """Take `c`; False when `c` ends the literal (not consumed)."""
        if self.quote:
            if self.escape:
                self.escape = False
            elif c == "\\":
                self.escape = True
            elif c == self.quote:
                self.quote = ""
        elif c in "'\"":
            self.quote = c
        elif c in "([{":
            self.depth += 1
        elif c in ")]}":
            if self.depth == 0:
                return False
            self.depth -= 1
        elif c == "," and self.depth == 0:
            return False
        self.chars.append(c)
        return True

    def json(self) -> str | None:
        """The literal as JSON text, None if it is not a literal JSON can hold."""
        try:
            value = ast.literal_eval("".join(self.chars).strip())
            return json.dumps(_jsonable(value), ensure_ascii=False)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None


def _jsonable(value: Any) -> Any:
    """Tuples as lists, sets refused, dict keys kept only if they are strings (as JSON requires)."""
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError("dict keys must be strings")
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset, bytes, complex)):
        raise TypeError(f"{type(value).__name__} has no JSON form")
    return value


class PythonicExtractor:
    """`[f(a=1, b="x"), g()]`: the whole output one Python list of calls with keyword arguments (as vLLM's pythonic
    parser); anything else is content. Each call is reported whole once its `)` closes: its keywords built as one
    JSON object (`{"a": 1, "b": "x"}`) and checked as every free-text parser's are (OfferedTools.arguments: an offered
    function, strict JSON, so no Infinity and no keyword given twice). A call that is not read whole (a positional
    argument, a value that is no literal, max_tokens) or fails the check is content from its name on, with the rest
    of the output (the list's `[` too when it is the first)."""

    def __init__(self, tools: OfferedTools | Collection[str] = ()) -> None:
        self._tools = OfferedTools.of(tools)
        self._content = ContentText()
        self._calls = CallNumbering()
        self._state = "lead"  # lead, name, open_paren, key, equals, value, between, tail, content
        self._raw: list[str] = []  # the text since the last reported call: content if the next one fails
        self._name: list[str] = []
        self._key: list[str] = []
        self._value: _PythonLiteral | None = None
        self._members: list[str] = []  # the open call's arguments, as JSON object members

    def feed(self, text: str) -> ParsedDelta:
        for c in text:
            self._char(c)
        return self._take()

    def finish(self) -> ParsedDelta:
        self._give_back()  # a call still open (cut by max_tokens), or the lone `[`
        return self._take()

    def _take(self) -> ParsedDelta:
        return ParsedDelta(self._content.take(), self._calls.take())

    def _char(self, c: str) -> None:
        state = self._state
        if state == "content":
            self._content.char(c)
        elif state == "tail":
            if not c.isspace():
                self._state = "content"
                self._content.char(c)
        else:
            self._raw.append(c)
            if not self._list_char(c):
                self._give_back()

    def _list_char(self, c: str) -> bool:
        """Take `c` inside the list; False when it cannot belong to a call list there."""
        state = self._state
        if state == "lead":
            if c == "[":
                self._state = "name"
            return c == "[" or c.isspace()
        if state in ("name", "open_paren"):
            return self._name_char(c)
        if state == "key":
            return self._key_char(c)
        if state == "equals":
            if c == "=":
                self._state, self._value = "value", _PythonLiteral()
            return c == "=" or c.isspace()
        if state == "value":
            return self._value_char(c)
        return self._between_char(c)

    def _name_char(self, c: str) -> bool:
        """The name of a call and its `(`."""
        if self._state == "name":
            if _is_name_char(c) and (self._name or c.isalpha() or c == "_"):
                self._name.append(c)
                return True
            if c.isspace() and not self._name:
                return True
            if not self._name:
                return False
            self._state = "open_paren"
        if c == "(":
            self._state, self._members = "key", []
        return c == "(" or c.isspace()

    def _key_char(self, c: str) -> bool:
        if _is_name_char(c) and c not in ".-":
            self._key.append(c)
        elif c == ")" and not self._key:
            return self._close_call()
        elif c == "=" and self._key:
            self._state, self._value = "value", _PythonLiteral()
        elif not c.isspace():
            return False
        elif self._key:
            self._state = "equals"
        return True

    def _value_char(self, c: str) -> bool:
        value = self._value
        assert value is not None
        if value.char(c):
            return True
        literal = value.json()
        if literal is None:
            return False
        self._members.append(f"{json.dumps(''.join(self._key), ensure_ascii=False)}: {literal}")
        self._key, self._value = [], None
        if c == ",":
            self._state = "key"
            return True
        return self._close_call()  # `)`

    def _close_call(self) -> bool:
        """The call's `)`: reported if it passes the shared check; False (content) otherwise."""
        name = "".join(self._name)
        arguments = self._tools.arguments(name, "{" + ", ".join(self._members) + "}")
        if arguments is None:
            return False
        self._calls.start(name, arguments)
        self._calls.close()
        self._state, self._name, self._members, self._raw = "between", [], [], []
        return True

    def _between_char(self, c: str) -> bool:
        """After a call's `)`: `,` and the next call, or the list's `]`."""
        if c in ",]":
            self._state, self._raw = ("name" if c == "," else "tail"), []
        return c in ",]" or c.isspace()

    def _give_back(self) -> None:
        """What was held is no call after all: it is content, and so is the rest of the output."""
        self._state = "content"
        raw, self._raw = "".join(self._raw), []
        self._content.text(raw)


# -- lfm2 -------------------------------------------------------------------------------------------------------


class LFM2Extractor(_MarkedBlocks):
    """`<|tool_call_start|>[f(a=1), g()]<|tool_call_end|>` blocks (LFM2's format; SGLang's `lfm2` detector); the
    text outside them is content. A block holds a pythonic call list (read as the `pythonic` parser reads one) or a
    JSON list of `{"name": ..., "arguments": {...}}` objects. Its calls are reported once the block closes, all of
    them or none: a block with a call that fails the shared check (an offered function, strict JSON arguments), a
    malformed one, or one cut by max_tokens is content, its markers included. A block whose list closed but whose end
    marker did not come (the reply ended) is still read."""

    start_marker = LFM2_CALL_START
    end_marker = LFM2_CALL_END

    def _read(self, body: str) -> list[tuple[str, str]]:
        return _listed_calls(body, self._tools)


def _listed_calls(body: str, tools: OfferedTools) -> list[tuple[str, str]]:
    """(name, arguments JSON) of every call a block lists, pythonic or JSON; [] unless all of them pass the check."""
    if body.lstrip().startswith("[{"):
        return _json_calls(body, tools)
    read = extract_all(PythonicExtractor(tools), body)
    if read.content:
        return []
    return [(call.name, call.arguments) for call in read.calls]


def _json_calls(body: str, tools: OfferedTools) -> list[tuple[str, str]]:
    try:
        items = json.loads(body)
    except ValueError:
        return []
    calls = []
    for item in items if isinstance(items, list) else [None]:
        if not isinstance(item, dict) or set(item) - {NAME_KEY, "arguments"} or not isinstance(item.get(NAME_KEY), str):
            return []
        arguments = tools.arguments(item[NAME_KEY], json.dumps(item.get("arguments", {}), ensure_ascii=False))
        if arguments is None:
            return []
        calls.append((item[NAME_KEY], arguments))
    return calls


# -- the forced formats -----------------------------------------------------------------------------------------


class NamedFunctionExtractor:
    """tool_choice naming a function: the whole output is that function's arguments."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._calls = CallNumbering()
        self._text = StrippedText()

    def feed(self, text: str) -> ParsedDelta:
        if self._calls.count == 0:
            self._calls.start(self._name)
        self._calls.arguments(self._text.feed(text))
        return ParsedDelta("", self._calls.take())

    def finish(self) -> ParsedDelta:
        return self.feed("")


class RequiredExtractor:
    """tool_choice "required": a JSON array of {"name": ..., "parameters": {...}} (vLLM's forced shape)."""

    argument_keys = ("parameters", "arguments")

    def __init__(self) -> None:
        self._calls = CallNumbering()
        self._state = "start"  # start, item, call, between, done
        self._object: CallObjectScanner | None = None
        self._started = False

    def feed(self, text: str) -> ParsedDelta:
        for c in text:
            self._char(c)
        self._report()
        return ParsedDelta("", self._calls.take())

    def finish(self) -> ParsedDelta:
        self._calls.close()
        return ParsedDelta("", self._calls.take())

    def _char(self, c: str) -> None:
        state = self._state
        if state == "call":
            assert self._object is not None
            self._object.char(c)
            if self._object.done or self._object.invalid:
                self._report()
                self._calls.close()
                self._state = "between" if self._object.done else "done"
            return
        if c.isspace() or state == "done":
            return
        if state == "start":
            self._state = "item" if c == "[" else "done"
        elif state == "item" and c == "{":
            self._object, self._started, self._state = CallObjectScanner(self.argument_keys), False, "call"
            self._object.char(c)
        elif state == "between":
            self._state = "item" if c == "," else "done"
        else:
            self._state = "done"

    def _report(self) -> None:
        if self._state == "call" and self._object is not None:
            self._started = report_call_object(self._object, self._calls, self._started)


# -- the parsers by name --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ToolParserSpec:
    """One `--tool-call-parser`: how to read its calls and how to ask for them."""

    name: str
    extractor: Callable[[OfferedTools], ToolCallExtractor]  # given the request's functions
    style: ToolPromptStyle
    whole_calls: bool  # calls are reported only once complete (a cut one is content), so "tool_calls" even at length
    # Its markers are special tokens of the models that write it: a reply read with it is decoded keeping special
    # tokens (skip_special_tokens false), as vLLM's parsers of such formats adjust the request, else they vanish.
    special_markers: bool = False


TOOL_PARSERS: Mapping[str, ToolParserSpec] = MappingProxyType(
    {
        "hermes": ToolParserSpec("hermes", HermesExtractor, HermesStyle(), whole_calls=True),
        "pythonic": ToolParserSpec("pythonic", PythonicExtractor, PythonicStyle(), whole_calls=True),
        "qwen3_coder": ToolParserSpec("qwen3_coder", Qwen3XMLExtractor, Qwen3XMLStyle(), whole_calls=True),
        "lfm2": ToolParserSpec("lfm2", LFM2Extractor, LFM2Style(), whole_calls=True, special_markers=True),
    }
)
# kvserve's own name for the parser that reads Gemma 3's style (not a vLLM name)
TOOL_PARSER_ALIASES: Mapping[str, str] = MappingProxyType({"gemma3": "pythonic"})
TOOL_PARSER_NAMES = (*TOOL_PARSERS, *TOOL_PARSER_ALIASES)
DEFAULT_STYLE: ToolPromptStyle = JSONToolStyle()


def tool_parser(name: str) -> ToolParserSpec:
    """The parser `--tool-call-parser NAME` selects; ValueError naming the known ones."""
    spec = TOOL_PARSERS.get(TOOL_PARSER_ALIASES.get(name, name))
    if spec is None:
        raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_PARSER_NAMES)}, got {name!r}")
    return spec
