"""Tool-call extraction from text fixtures: vLLM's hermes and pythonic formats and the forced formats, whole and
streamed (any cut of the text gives the same calls, and the pieces put together equal the whole), and the prompt
styles and template fallback that ask a model for calls."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex

from kvserve.model.chat_template import (
    GEMMA_CHAT_TEMPLATE,
    JSONToolStyle,
    TemplateToolSupport,
    tool_fallback_messages,
    tool_support,
)
from kvserve.structured.call_arguments import OfferedTools
from kvserve.structured.tool_calls import ToolCall, ToolCallAccumulator, extract_all
from kvserve.structured.tool_parsers import (
    HermesExtractor,
    LFM2Extractor,
    NamedFunctionExtractor,
    PythonicExtractor,
    Qwen3XMLExtractor,
    RequiredExtractor,
    tool_parser,
)

HERMES_TWO_CALLS = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n'
    '</tool_call>\n<tool_call>\n{"arguments": {}, "name": "now"}\n</tool_call>'
)


OFFERED = ("get_weather", "now", "f")  # the functions the requests below offer


def WEATHER():  # extractor factories, named like the classes beside them
    return HermesExtractor(("get_weather", "now"))


def HERMES():
    return HermesExtractor(OFFERED)


def PYTHONIC():
    return PythonicExtractor(OFFERED)


# Qwen3.5's XML calls type their text by the parameters' schemas.
SCHEMAS = {
    "get_weather": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "array"}, "metric": {"type": "boolean"}},
    },
    "now": {"type": "object", "properties": {}},
    "f": {"type": "object", "properties": {"n": {"type": "integer"}, "x": {"type": ["number", "null"]}}},
}


def XML():
    return Qwen3XMLExtractor(OfferedTools(frozenset(OFFERED), schemas=SCHEMAS))


def LFM2():
    return LFM2Extractor(OFFERED)


LFM2_WEATHER = '<|tool_call_start|>[get_weather(city="Paris", days=[1, 2])]<|tool_call_end|>'

XML_WEATHER = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n[1, 2]\n"
    "</parameter>\n</function>\n</tool_call>"
)


# (extractor factory, text, expected content, expected calls)
CASES = [
    (HERMES, "Just text, no call.", "Just text, no call.", []),
    (
        HERMES,
        HERMES_TWO_CALLS,
        None,
        [ToolCall("get_weather", '{"city": "Paris", "days": [1, 2]}'), ToolCall("now", "{}")],
    ),
    (
        HERMES,
        'Let me check.\n\n<tool_call>{"name": "f", "arguments": {"q": "a}b\\"c"}}</tool_call>',
        "Let me check.",
        [ToolCall("f", '{"q": "a}b\\"c"}')],
    ),
    (HERMES, '<tool_call>{"name": "f"}</tool_call>', None, [ToolCall("f", "{}")]),
    (
        HERMES,
        '<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>',
        None,
        [ToolCall("f", '{"x": 1}')],
    ),
    (  # arguments are one JSON object, never a number (#43 item 11)
        HERMES,
        '<tool_call>{"name": "f", "arguments": 5, "extra": null}</tool_call> ok',
        '<tool_call>{"name": "f", "arguments": 5, "extra": null}</tool_call> ok',
        [],
    ),
    (HERMES, "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    (HERMES, "a <tool_c b <toolbox> <tool_call", "a <tool_c b <toolbox> <tool_call", []),
    (HERMES, '<tool_call>{"name": "f", "arguments": {"a": 1}}', None, [ToolCall("f", '{"a": 1}')]),
    # a tag holds one call: two objects in a row (or anything but its closing marker after the call) are content
    # (whitespace before markup is never content)
    (
        HERMES,
        '<tool_call>{"name": "f", "arguments": {}}{"name": "now", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {}}{"name": "now", "arguments": {}}</tool_call>',
        [],
    ),
    (
        HERMES,
        'Two: <tool_call>{"name": "f", "arguments": {}}\n{"name": "now"}</tool_call> done',
        'Two:<tool_call>{"name": "f", "arguments": {}}\n{"name": "now"}</tool_call> done',
        [],
    ),
    (
        HERMES,
        '<tool_call>{"name": "f", "arguments": {}} </tool_c x<tool_call>{"name": "now"}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {}} </tool_c x',
        [ToolCall("now", "{}")],
    ),
    # cut by max_tokens, or malformed after the name: content, markers included (a call is reported whole)
    (
        HERMES,
        '<tool_call>{"name": "f", "arguments": {"a": [1, {"b"',
        '<tool_call>{"name": "f", "arguments": {"a": [1, {"b"',
        [],
    ),
    (
        HERMES,
        '<tool_call>{"name": "f", "arguments": {}, oops}</tool_call>after',
        '<tool_call>{"name": "f", "arguments": {}, oops}</tool_call>after',
        [],
    ),
    # Qwen2.5-Coder's bare and fenced calls, read when they name one of the request's tools
    (
        WEATHER,
        '{"name": "get_weather", "arguments": {"city": "Paris"}}',
        None,
        [ToolCall("get_weather", '{"city": "Paris"}')],
    ),
    (
        WEATHER,
        '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Tokyo"\n  }\n}\n```',
        None,
        [ToolCall("get_weather", '{\n    "city": "Tokyo"\n  }')],
    ),
    (
        WEATHER,
        '{"name": "get_weather", "arguments": {"city": "A"}}\n{"name": "now", "arguments": {}} Checking both.',
        "Checking both.",
        [ToolCall("get_weather", '{"city": "A"}'), ToolCall("now", "{}")],
    ),
    # parallel calls one per line in one fence (the model's sampled reply); a second object that is no call is content
    (
        WEATHER,
        '```json\n{"name": "get_weather", "arguments": {"city": "A"}}\n{"name": "now", "arguments": {}}\n```',
        None,
        [ToolCall("get_weather", '{"city": "A"}'), ToolCall("now", "{}")],
    ),
    (
        WEATHER,
        '```json\n{"name": "now", "arguments": {}}\n{"city": "B"}\n```',
        '{"city": "B"}\n```',
        [ToolCall("now", "{}")],
    ),
    (
        WEATHER,
        '```json\n{"name": "reverse_string", "arguments": {"s": "x"}}\n```',
        '```json\n{"name": "reverse_string", "arguments": {"s": "x"}}\n```',
        [],
    ),
    (WEATHER, '{"city": "Paris", "name": "get_weather"}', '{"city": "Paris", "name": "get_weather"}', []),
    (WEATHER, "```python\ndef f(): pass\n```", "```python\ndef f(): pass\n```", []),
    (WEATHER, '{"name": "get_weather", "arguments": {"ci', '{"name": "get_weather", "arguments": {"ci', []),
    (WEATHER, 'It is {"name": "get_weather"} maybe', 'It is {"name": "get_weather"} maybe', []),
    (HermesExtractor, '{"name": "get_weather", "arguments": {}}', '{"name": "get_weather", "arguments": {}}', []),
    (
        PYTHONIC,
        '[get_weather(city="Paris", days=[1, 2], metric=True), now()]',
        None,
        [ToolCall("get_weather", '{"city": "Paris", "days": [1, 2], "metric": true}'), ToolCall("now", "{}")],
    ),
    (
        PYTHONIC,
        " [f(a='x,)', b={'k': None}, c=(1, 2))]\n",
        None,
        [ToolCall("f", '{"a": "x,)", "b": {"k": null}, "c": [1, 2]}')],
    ),
    (PYTHONIC, "The answer is 4.", "The answer is 4.", []),
    (PYTHONIC, "[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
    (PYTHONIC, "[ref] see above", "[ref] see above", []),
    (PYTHONIC, "[f(x=1)] Done.", "Done.", [ToolCall("f", '{"x": 1}')]),
    # a call that is not read whole is content, never a call with what it had (#43 item 11)
    (PYTHONIC, "[f(x=1, y=unknown_name)]", "[f(x=1, y=unknown_name)]", []),
    (PYTHONIC, '[f(x=1, y="cut', '[f(x=1, y="cut', []),
    (PYTHONIC, "[f", "[f", []),
    (PYTHONIC, "[now(), f(x=1, x=2)]", "f(x=1, x=2)]", [ToolCall("now", "{}")]),
    (
        RequiredExtractor,
        '[{"name": "f", "parameters": {"a": "]}"}}, {"name": "g", "parameters": {}}]',
        None,
        [ToolCall("f", '{"a": "]}"}'), ToolCall("g", "{}")],
    ),
    (RequiredExtractor, '[{"name": "f", "parameters": {"a": 1', None, [ToolCall("f", '{"a": 1')]),
    (lambda: NamedFunctionExtractor("f"), '  {"a": "x y "} \n', None, [ToolCall("f", '{"a": "x y "}')]),
    (lambda: NamedFunctionExtractor("f"), "", None, [ToolCall("f", "")]),
]


# #43 item 11: a call's arguments are one JSON object that a strict parser reads; anything else stays content, whole
# or streamed. The instruct model writes the first of these unforced.
NOT_JSON_ARGUMENTS = [
    '{"city": Paris}',
    '{"city": "Paris",}',
    "{'city': 'Paris'}",
    '{"x": NaN}',
    '{"x": Infinity}',
    '{"x": -Infinity}',
    '{"x": 1e999}',
    '"Paris"',
    "[1, 2]",
    "null",
    '{"city": "Paris"}{"city": "Rome"}',
    '{"city": "Paris", "city": "Rome"}',
    '{"city": "\\ud800"}',
    "[" * 3000 + "]" * 3000,
]
for _arguments in NOT_JSON_ARGUMENTS:
    _text = f'<tool_call>{{"name": "get_weather", "arguments": {_arguments}}}</tool_call>'
    CASES.append((HERMES, _text, _text, []))
CASES += [
    (  # the call object itself is strict JSON too
        HERMES,
        '<tool_call>{"name": "f", "arguments": {}, "x": NaN}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {}, "x": NaN}</tool_call>',
        [],
    ),
    (
        HERMES,
        '<tool_call>{"name": "f", "name": "now", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "name": "now", "arguments": {}}</tool_call>',
        [],
    ),
    (PYTHONIC, "[f(x=1e999)]", "[f(x=1e999)]", []),
    (PYTHONIC, "[f(x=1, x=2)]", "[f(x=1, x=2)]", []),
    (PYTHONIC, '[f("Paris")]', '[f("Paris")]', []),  # positional: it used to be a call with arguments {}
    (PYTHONIC, '[f(x=float("nan"))]', '[f(x=float("nan"))]', []),
]
# #43 item 12: only the functions the request offers become calls; a call to any other is content.
NOT_OFFERED = [
    '<tool_call>{"name": "delete_all_files", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "../../etc/passwd", "arguments": {"mode": "r"}}</tool_call>',
    '```json\n{"name": "delete_all_files", "arguments": {}}\n```',
]
CASES += [(HERMES, text, text, []) for text in NOT_OFFERED]
CASES += [
    (  # no tools offered
        HermesExtractor,
        '<tool_call>{"name": "f", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {}}</tool_call>',
        [],
    ),
    (
        HERMES,
        '<tool_call>{"name": "now"}</tool_call><tool_call>{"name": "rm", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "rm", "arguments": {}}</tool_call>',
        [ToolCall("now", "{}")],
    ),
    (PYTHONIC, "[delete_all_files()]", "[delete_all_files()]", []),
    (XML, "Just text, no call.", "Just text, no call.", []),
    (XML, "Checking.\n" + XML_WEATHER, "Checking.", [ToolCall("get_weather", '{"city": "Paris", "days": [1, 2]}')]),
    (
        XML,
        XML_WEATHER + "\n<tool_call>\n<function=now>\n</function>\n</tool_call>",
        None,
        [ToolCall("get_weather", '{"city": "Paris", "days": [1, 2]}'), ToolCall("now", "{}")],
    ),
    (  # typed by the schema: an integer, a number or null; a string stays as written, lines and all
        XML,
        "<tool_call><function=f><parameter=n>\n3\n</parameter><parameter=x>null</parameter></function></tool_call>",
        None,
        [ToolCall("f", '{"n": 3, "x": null}')],
    ),
    (
        XML,
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\nnorth\n</parameter>\n<parameter=metric>\ntrue"
        "\n</parameter>\n</function>\n</tool_call>",
        None,
        [ToolCall("get_weather", '{"city": "42\\nnorth", "metric": true}')],
    ),
    (  # the reply ended after </function>: still a call
        XML,
        "<tool_call>\n<function=now>\n</function>\n",
        None,
        [ToolCall("now", "{}")],
    ),
    (
        XML,
        "<tool_call>\n<function=rm>\n</function>\n</tool_call>",
        "<tool_call>\n<function=rm>\n</function>\n</tool_call>",
        [],
    ),
    (  # cut by max_tokens: content
        XML,
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
        [],
    ),
    (  # text between parameters: not a call
        XML,
        "<tool_call><function=now>oops</function></tool_call>",
        "<tool_call><function=now>oops</function></tool_call>",
        [],
    ),
    (PYTHONIC, '[now(), rm(path="/")]', 'rm(path="/")]', [ToolCall("now", "{}")]),
    # LFM2: a pythonic (or JSON) list between special tokens, text around it content
    (LFM2, "No call here.", "No call here.", []),
    (LFM2, LFM2_WEATHER, None, [ToolCall("get_weather", '{"city": "Paris", "days": [1, 2]}')]),
    (
        LFM2,
        "Let me check." + LFM2_WEATHER + "Checking the weather now.",
        "Let me check.Checking the weather now.",
        [ToolCall("get_weather", '{"city": "Paris", "days": [1, 2]}')],
    ),
    (
        LFM2,
        "<|tool_call_start|>[get_weather(city='Oslo'), now()]<|tool_call_end|>",
        None,
        [ToolCall("get_weather", '{"city": "Oslo"}'), ToolCall("now", "{}")],
    ),
    (  # the JSON form the models write when their system prompt asks for JSON
        LFM2,
        '<|tool_call_start|>[{"name": "f", "arguments": {"n": 3}}, {"name": "now"}]<|tool_call_end|>',
        None,
        [ToolCall("f", '{"n": 3}'), ToolCall("now", "{}")],
    ),
    (  # the reply ended after the list, before the end marker: still calls
        LFM2,
        "<|tool_call_start|>[now()]",
        None,
        [ToolCall("now", "{}")],
    ),
    (  # all of a block's calls or none: one not offered makes the whole block content
        LFM2,
        '<|tool_call_start|>[now(), rm(path="/")]<|tool_call_end|>',
        '<|tool_call_start|>[now(), rm(path="/")]<|tool_call_end|>',
        [],
    ),
    (  # cut by max_tokens
        LFM2,
        '<|tool_call_start|>[get_weather(city="Pa',
        '<|tool_call_start|>[get_weather(city="Pa',
        [],
    ),
    (LFM2, "<|tool_call_start|>[f(1)]<|tool_call_end|>", "<|tool_call_start|>[f(1)]<|tool_call_end|>", []),
    (
        LFM2,
        '<|tool_call_start|>[{"name": "f", "arguments": "n=3"}]<|tool_call_end|>',
        '<|tool_call_start|>[{"name": "f", "arguments": "n=3"}]<|tool_call_end|>',
        [],
    ),
    (LFM2, "a <|tool_call_sta", "a <|tool_call_sta", []),
]


CASE_IDS = [f"{make.__name__}:{text[:48]}" for make, text, _, _ in CASES]  # short: one text is 6,000 brackets


@pytest.mark.parametrize("make,text,content,calls", CASES, ids=CASE_IDS)
def test_whole_text(make, text, content, calls):
    result = extract_all(make(), text)
    assert result.content == content
    assert result.calls == calls


def _streamed(make, text: str, cuts: list[int]) -> tuple[ToolCallAccumulator, list]:
    """Feed `text` cut at `cuts`; return the accumulated result and every piece (checked as a client would)."""
    extractor, acc, pieces = make(), ToolCallAccumulator(), []
    bounds = [0, *sorted(set(cuts)), len(text)]
    for start, end in zip(bounds, bounds[1:]):
        delta = extractor.feed(text[start:end])
        acc.add(delta)
        pieces.extend(delta.calls)
    delta = extractor.finish()
    acc.add(delta)
    pieces.extend(delta.calls)
    return acc, pieces


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(CASES), data=st.data())
def test_any_cut_gives_the_whole(case, data):
    """However the text streams, the pieces put together equal the whole, the name comes first and only once."""
    make, text, _, _ = case
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    acc, pieces = _streamed(make, text, cuts)
    assert acc.result() == extract_all(make(), text)
    seen: set[int] = set()
    for piece in pieces:
        assert (piece.name is not None) == (piece.index not in seen), "the name is in the first piece only"
        seen.add(piece.index)


def test_hermes_holds_a_call_until_its_json_closes():
    """A hermes call is one piece, sent when its object closes: a stream never carries half a call, so a call that
    max_tokens cuts is content in a stream as in a whole reply (docs/AGENTS.md)."""
    text = '<tool_call>{"name": "f", "arguments": {"text": "' + "word " * 20 + '"}}</tool_call>'
    cuts = list(range(0, len(text), 7))
    _, pieces = _streamed(HERMES, text, cuts)
    assert [(p.name, json.loads(p.arguments)) for p in pieces] == [("f", {"text": "word " * 20})]
    acc, pieces = _streamed(HERMES, text[:-20], cuts)
    assert pieces == [] and acc.result().content == text[:-20].rstrip()  # trailing whitespace is never content


def test_a_pythonic_call_is_reported_whole():
    """Like a hermes call, a pythonic one is one piece, sent when its `)` closes and its arguments are checked (#43
    item 11: it used to stream keyword by keyword, so a call that then broke off had already been sent)."""
    text = '[f(a=1, b="two", c=[3]), now()]'
    _, pieces = _streamed(PYTHONIC, text, list(range(len(text))))
    assert [(p.name, p.arguments) for p in pieces] == [("f", '{"a": 1, "b": "two", "c": [3]}'), ("now", "{}")]


def test_plain_text_streams_without_waiting():
    """Content that cannot be markup is released as it comes (only a possible `<tool_call>` prefix is held)."""
    extractor = HermesExtractor()
    assert extractor.feed("Hello wor").content == "Hello wor"
    assert extractor.feed("ld <tool").content == "ld"
    assert extractor.feed("s> done").content == " <tools> done"


def test_parser_names_follow_vllm():
    assert tool_parser("hermes").name == "hermes"
    assert tool_parser("pythonic").name == "pythonic"
    assert tool_parser("gemma3").name == "pythonic"
    assert tool_parser("qwen3_coder").name == "qwen3_coder"
    assert tool_parser("lfm2").name == "lfm2"  # SGLang's name
    assert [n for n in ("hermes", "pythonic", "qwen3_coder", "lfm2") if tool_parser(n).special_markers] == ["lfm2"]
    with pytest.raises(ValueError, match="hermes"):
        tool_parser("mistral")


# -- asking for calls: styles and the template fallback ---------------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather now",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    {"role": "user", "content": "Thanks. And Rome?"},
]


@pytest.mark.parametrize("name", ["hermes", "pythonic", "qwen3_coder", "lfm2"])
def test_a_style_writes_calls_its_parser_reads(name):
    """The calls written into a past turn are read back as the same calls by the same format's parser."""
    spec = tool_parser(name)
    text = spec.style.render_calls([("get_weather", {"city": "Paris", "days": [1, 2]}), ("now", {})])
    result = extract_all(spec.extractor(OfferedTools(frozenset(("get_weather", "now")), schemas=SCHEMAS)), text)
    assert [(c.name, json.loads(c.arguments)) for c in result.calls] == [
        ("get_weather", {"city": "Paris", "days": [1, 2]}),
        ("now", {}),
    ]


def test_json_style_writes_the_required_format():
    text = JSONToolStyle().render_calls([("f", {"a": 1})])
    assert extract_all(RequiredExtractor(), text).calls == [ToolCall("f", '{"a": 1}')]


def test_gemma_template_gets_the_fallback():
    """Gemma's template renders no tools and requires alternating turns: tools go to the system text, calls into
    the assistant's content, the tool result into a user turn merged with the next user message."""
    support = tool_support(GEMMA_CHAT_TEMPLATE)
    assert support == TemplateToolSupport(tools=False, tool_role=False, tool_calls=False)
    messages, tools = tool_fallback_messages(CONVERSATION, TOOLS, support, tool_parser("pythonic").style)
    assert tools is None
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\nYou have access to functions.")
    assert '"name": "get_weather"' in messages[0]["content"]
    assert messages[2]["content"] == '[get_weather(city="Paris")]'
    assert messages[3]["content"] == "```tool_output\n18C\n```\n\nThanks. And Rome?"


def test_a_template_with_tools_gets_them_natively():
    template = (
        "{% for t in tools %}{{ t.function.name }}{% endfor %}{% for m in messages %}{% if m.role == 'tool' %}"
        "{% endif %}{% for c in m.tool_calls or [] %}{{ c.function.arguments.city }}{% endfor %}{% endfor %}"
    )
    support = tool_support(template)
    assert support == TemplateToolSupport(tools=True, tool_role=True, tool_calls=True)
    messages, tools = tool_fallback_messages(CONVERSATION, TOOLS, support, JSONToolStyle())
    assert tools == TOOLS
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # an object, as vLLM passes it
    assert messages[3] == CONVERSATION[3]


def test_tool_messages_render_through_the_gemma_template(tiny_tokenizer):
    """Rendering never fails on tool turns with a template that lacks them (here Gemma's, which would raise on the
    tool role's broken alternation)."""
    text = tiny_tokenizer.apply_chat_template(
        CONVERSATION, chat_template=GEMMA_CHAT_TEMPLATE, tools=TOOLS, tool_style=tool_parser("pythonic").style
    )
    assert text.count("<start_of_turn>user") == 2 and text.count("<start_of_turn>model") == 2
    assert '[get_weather(city="Paris")]' in text and "```tool_output\n18C\n```" in text


def test_lfm2_markers_are_special_tokens_kept_in_the_reply(tmp_path):
    """LFM2's tokenizer marks `<|tool_call_start|>` and `<|tool_call_end|>` special, so the default
    skip_special_tokens would drop them and leave a bare list the parser reads as content: an `lfm2` server decodes a
    reply to a request with tools keeping special tokens (vLLM's parsers of such formats adjust the request so)."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    from kvserve.engine.detokenizer import IncrementalDetokenizer
    from kvserve.model.tokenizer import Tokenizer
    from kvserve.sampling_params import SamplingParams
    from kvserve.server.context import ServerSettings
    from kvserve.server.protocol import ChatCompletionRequest
    from kvserve.server.tools import plan_tools

    markers = ["<|tool_call_start|>", "<|tool_call_end|>"]
    chars = [chr(c) for c in range(32, 127)]
    raw = RawTokenizer(models.WordLevel({t: i for i, t in enumerate(["<unk>", *markers, *chars])}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    raw.decoder = decoders.Fuse()
    raw.add_special_tokens(["<unk>", *markers])
    tokenizer = Tokenizer(raw, {"unk_token": "<unk>"})
    reply = 'ok.<|tool_call_start|>[get_weather(city="Paris"), now()]<|tool_call_end|>'
    ids = tokenizer.encode(reply, add_special_tokens=False)

    def decoded(skip: bool) -> str:
        detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=skip))
        return "".join(detok.append(i).delta_text for i in ids) + detok.finish().delta_text

    assert decoded(skip=True) == reply.replace(markers[0], "").replace(markers[1], "")
    assert decoded(skip=False) == reply
    result = extract_all(LFM2Extractor(OFFERED), decoded(skip=False))
    assert result.content == "ok." and result.calls == [
        ToolCall("get_weather", '{"city": "Paris"}'),
        ToolCall("now", "{}"),
    ]

    request = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    )
    for parser, kept in (("lfm2", True), ("hermes", False)):
        settings = ServerSettings(("m",), enable_auto_tool_choice=True, tool_call_parser=parser)
        assert plan_tools(request, settings).keep_special_tokens is kept
    forced = request.model_copy(update={"tool_choice": "required"})
    assert (
        plan_tools(
            forced, ServerSettings(("m",), enable_auto_tool_choice=True, tool_call_parser="lfm2")
        ).keep_special_tokens
        is False
    )
