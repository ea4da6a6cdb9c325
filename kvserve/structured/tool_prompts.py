"""How tools, calls and tool results are written into a prompt whose chat template does not render them.

Why per format: a model asked in the format its parser reads answers in it. The `pythonic` style is Gemma 3's
documented function-calling prompt (the default model's family has no tool tokens or template of its own); `hermes`
is the Hermes / Qwen system prompt; the JSON style (no parser configured: chat_template.JSONToolStyle, the model layer's
default) asks for, and writes past calls as, the array that tool_choice "required" forces.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from kvserve.model.chat_template import functions_json

HERMES_START = "<tool_call>"
HERMES_END = "</tool_call>"
# LFM2's markers: special tokens of its tokenizer (a reply read with them is decoded keeping special tokens)
LFM2_CALL_START = "<|tool_call_start|>"
LFM2_CALL_END = "<|tool_call_end|>"


class HermesStyle:
    """Hermes / Qwen: `<tool_call>` blocks, tools listed in `<tools>`."""

    def system_text(self, tools: Sequence[Mapping[str, Any]]) -> str:
        return _tools_in_tags(tools) + (
            "return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        )

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        return "\n".join(
            f"{HERMES_START}\n{json.dumps({'name': n, 'arguments': a}, ensure_ascii=False)}\n{HERMES_END}"
            for n, a in calls
        )

    def render_result(self, content: str, name: str | None) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"


class Qwen3XMLStyle:
    """Qwen3-Coder / Qwen3.5: `<tool_call>` blocks holding `<function=NAME>` and a `<parameter=KEY>` per argument, tools
    listed in `<tools>`."""

    def system_text(self, tools: Sequence[Mapping[str, Any]]) -> str:
        return _tools_in_tags(tools) + (
            "write:\n<tool_call>\n<function=function-name>\n<parameter=parameter-name>\nvalue\n</parameter>\n"
            "</function>\n</tool_call>"
        )

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        return "\n".join(f"{HERMES_START}\n{_xml_call(n, a)}\n{HERMES_END}" for n, a in calls)

    def render_result(self, content: str, name: str | None) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"


def _tools_in_tags(tools: Sequence[Mapping[str, Any]]) -> str:
    """The Qwen family's tool listing (Hermes' and Qwen3.5's prompts share it), up to how a call is written."""
    listed = "\n".join(json.dumps(dict(t), ensure_ascii=False) for t in tools)
    return (
        "You may call one or more functions to assist with the user query.\n\nYou are provided with function "
        f"signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\nFor each function call, "
    )


def _xml_call(name: str, arguments: Any) -> str:
    """One call as Qwen3.5 writes it: strings as they are, other values as JSON."""
    parts = [f"<function={name}>"]
    for key, value in arguments.items() if isinstance(arguments, Mapping) else ():
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        parts.append(f"<parameter={key}>\n{text}\n</parameter>")
    parts.append("</function>")
    return "\n".join(parts)


class LFM2Style:
    """LFM2 / LFM2.5 (Liquid AI's chat template and model cards): tools as a JSON list between `<|tool_list_start|>`
    and `<|tool_list_end|>`, a call as a Python list between `<|tool_call_start|>` and `<|tool_call_end|>`, a result
    between `<|tool_response_start|>` and `<|tool_response_end|>`."""

    def system_text(self, tools: Sequence[Mapping[str, Any]]) -> str:
        listed = json.dumps([t.get("function", t) for t in tools], ensure_ascii=False)
        return f"List of tools: <|tool_list_start|>{listed}<|tool_list_end|>"

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        return LFM2_CALL_START + PythonicStyle().render_calls(calls) + LFM2_CALL_END

    def render_result(self, content: str, name: str | None) -> str:
        return f"<|tool_response_start|>{content}<|tool_response_end|>"


class PythonicStyle:
    """Gemma 3's documented function-calling prompt: a Python list of calls."""

    def system_text(self, tools: Sequence[Mapping[str, Any]]) -> str:
        return (
            "You have access to functions. If you decide to invoke any of the function(s), you MUST put it in the "
            "format of [func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]"
            "\nYou SHOULD NOT include any other text in the response if you call a function\n" + functions_json(tools)
        )

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        return "[" + ", ".join(f"{n}({_python_kwargs(a)})" for n, a in calls) + "]"

    def render_result(self, content: str, name: str | None) -> str:
        return f"```tool_output\n{content}\n```"


def _python_kwargs(arguments: Any) -> str:
    if not isinstance(arguments, Mapping):
        return ""
    return ", ".join(f"{k}={_python_literal(v)}" for k, v in arguments.items())


def _python_literal(value: Any) -> str:
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_python_literal(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_python_literal(k)}: {_python_literal(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)
