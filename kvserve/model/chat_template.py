"""Chat templates: the built-in Gemma turn template, `--chat-template` resolution, and the fallback for tools.

Why a built-in template: GGUF files of Gemma 3 carry no `tokenizer.chat_template`, yet chat requests
must be formatted exactly as Gemma was trained (turn markers, BOS first, system text folded into the
first user turn, since Gemma has no system role).

Why a fallback for system messages past the first: clients send them mid-conversation (Claude Code puts its agent
and skill lists in one after the first user turn), and templates differ: Qwen's renders a system turn anywhere,
Gemma's has no system role at all (it folds a leading system message into the first user turn and refuses any
other). A conversation is rendered as sent when the template has a system turn of its own (system_turn_probe: a leading
system message is not folded into the user turn after it) and renders every system message in it; otherwise each
system message past the first is merged into the user turn next to it, as the template does its leading system text
(folded_system_messages).

Why a fallback for tools: many templates (Gemma's among them) render no `tools`, no `tool` role and no assistant
`tool_calls`, and some refuse them (Gemma's requires user/assistant turns to alternate). A request that carries
them must still work, as in vLLM with a template that ignores them, but without the tools silently vanishing from
the prompt: what the template lacks is written as text (tool_fallback_messages), in the format the server's tool
parser reads (a ToolPromptStyle):
- tools: their description appended to the system message (one is added if there is none);
- an assistant message's tool_calls: the calls written into its content;
- a `tool` message: a user message with the result, merged with the user messages next to it (so that turns
  still alternate).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

# Written for kvserve; renders the same text as Gemma's published turn format:
#   <bos><start_of_turn>user\n{system}\n\n{user}<end_of_turn>\n<start_of_turn>model\n{reply}<end_of_turn>\n...
GEMMA_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- set ns = namespace(prefix='') -%}"
    "{%- set turns = messages -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set ns.prefix = messages[0]['content'] ~ '\\n\\n' -%}"
    "{%- set turns = messages[1:] -%}"
    "{%- endif -%}"
    "{%- for m in turns -%}"
    "{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{- raise_exception('Gemma chat: roles must alternate user/assistant/user/..., "
    "after an optional system message') -}}"
    "{%- endif -%}"
    "{%- set role = 'model' if m['role'] == 'assistant' else m['role'] -%}"
    "{{- '<start_of_turn>' ~ role ~ '\\n' -}}"
    "{%- if loop.first -%}{{- ns.prefix -}}{%- endif -%}"
    "{{- m['content'] | trim -}}"
    "{{- '<end_of_turn>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)

# Model families (GGUF `general.architecture` / HF `model_type`) whose files may lack a template.
_BUILTIN_TEMPLATES = {"gemma3": GEMMA_CHAT_TEMPLATE, "gemma3_text": GEMMA_CHAT_TEMPLATE}


def builtin_chat_template(architecture: str) -> str | None:
    """The template kvserve supplies for a family whose checkpoints may ship without one."""
    return _BUILTIN_TEMPLATES.get(architecture)


def resolve_chat_template(value: str) -> str:
    """`--chat-template` value -> template text: an existing file's contents, else a jinja2 string.

    Like vLLM: a path that exists is read; a string that looks like jinja2 is used as is; anything else
    is an error (most likely a mistyped path), rather than a template that prints the path.
    """
    path = Path(value).expanduser()
    try:
        is_file = len(value) < 4096 and path.is_file()
    except OSError:
        is_file = False
    if is_file:
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"chat template file {path}: cannot read it: {e}") from e
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r}: no such file, and not a jinja2 template string (no '{{{{' or '{{%')")


# -- tools ---------------------------------------------------------------------------------------------------------


class ToolPromptStyle(Protocol):
    """How tools, calls and results are written as text for a template that does not render them."""

    def system_text(self, tools: Sequence[Mapping[str, Any]]) -> str:
        """The tools' description and how to call them, for the system message."""
        ...

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        """An assistant's past calls, (name, arguments object) each, as the model would have written them."""
        ...

    def render_result(self, content: str, name: str | None) -> str:
        """One tool result, as the text of a user turn."""
        ...


def functions_json(tools: Sequence[Mapping[str, Any]]) -> str:
    """One function per line, compact: the description costs prompt tokens on every turn."""
    return "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)


class JSONToolStyle:
    """The default (no parser, or tool_choice "required"): calls as the forced JSON array."""

    def system_text(self, tools: Sequence[Mapping[str, Any]]) -> str:
        return (
            "You can call these functions. To call functions, reply with only a JSON array of calls, each "
            '{"name": <function name>, "parameters": <arguments object>}.\n' + functions_json(tools)
        )

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        return json.dumps([{"name": n, "parameters": a} for n, a in calls], ensure_ascii=False)

    def render_result(self, content: str, name: str | None) -> str:
        return f"Result of {name}: {content}" if name else f"Function result: {content}"


@dataclass(frozen=True, slots=True)
class TemplateToolSupport:
    """What a template renders of tool calling, read from its source (what it refers to)."""

    tools: bool  # a `tools` list
    tool_role: bool  # messages with role "tool"
    tool_calls: bool  # an assistant message's `tool_calls`


_TOOLS_RE = re.compile(r"\btools\b")
_TOOL_ROLE_RE = re.compile(r"""(['"])tool\1""")
_TOOL_CALLS_RE = re.compile(r"\btool_calls\b")


def tool_support(template: str) -> TemplateToolSupport:
    return TemplateToolSupport(
        bool(_TOOLS_RE.search(template)), bool(_TOOL_ROLE_RE.search(template)), bool(_TOOL_CALLS_RE.search(template))
    )


def tool_fallback_messages(
    messages: list[dict[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    support: TemplateToolSupport,
    style: ToolPromptStyle,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) as the template will see them: what it renders natively passed through (tool-call
    arguments as objects, as templates written for transformers expect), what it lacks written as text.
    `messages` are normalized (string content)."""
    out: list[dict[str, Any]] = []
    from_tool: list[bool] = []  # per message of `out`: a tool result turned into a user message
    names: dict[str, str] = {}  # tool_call_id -> the function it called, for results that do not name it
    for message in messages:
        message = _with_argument_objects(message)
        names.update(_call_names(message))
        converted = False
        if message.get("role") == "tool" and not support.tool_role:
            name = message.get("name") or names.get(str(message.get("tool_call_id")))
            message = {"role": "user", "content": style.render_result(message.get("content") or "", name)}
            converted = True
        elif message.get("tool_calls") and not support.tool_calls:
            message = _calls_as_content(message, style)
        if out and message["role"] == "user" and out[-1].get("role") == "user" and (converted or from_tool[-1]):
            out[-1] = {**out[-1], "content": f"{out[-1].get('content') or ''}\n\n{message['content']}"}
            from_tool[-1] = True
            continue
        out.append(message)
        from_tool.append(converted)
    if not tools:
        return out, None
    if support.tools:
        return out, [dict(t) for t in tools]
    return _with_system_text(out, style.system_text(tools)), None


def _with_argument_objects(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message whose calls' arguments are JSON text gets them as objects (vLLM does the same)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    fixed = []
    for call in calls:
        function = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(function, Mapping) and isinstance(function.get("arguments"), str):
            try:
                arguments = json.loads(function["arguments"] or "{}")
            except json.JSONDecodeError:
                arguments = function["arguments"]  # kept as the text it is
            call = {**call, "function": {**function, "arguments": arguments}}
        fixed.append(call)
    return {**message, "tool_calls": fixed}


def _call_names(message: dict[str, Any]) -> dict[str, str]:
    names = {}
    for call in message.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(function, Mapping) and call.get("id"):
            names[str(call["id"])] = str(function.get("name", ""))
    return names


def _calls_as_content(message: dict[str, Any], style: ToolPromptStyle) -> dict[str, Any]:
    calls = []
    for call in message["tool_calls"]:
        function = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(function, Mapping):
            calls.append((str(function.get("name", "")), function.get("arguments", {})))
    text = style.render_calls(calls)
    content = message.get("content") or ""
    rest = {k: v for k, v in message.items() if k != "tool_calls"}
    return {**rest, "content": f"{content}\n{text}" if content else text}


def _with_system_text(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    if messages and messages[0].get("role") == "system":
        first = messages[0]
        content = first.get("content") or ""
        return [{**first, "content": f"{content}\n\n{text}" if content else text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


# -- system messages past the first ------------------------------------------------------------------------------


_SYSTEM_PROBE = "kvserve-probe-system-text"
_USER_PROBE = "kvserve-probe-user-text"
SYSTEM_TURN_PROBE = [{"role": "system", "content": _SYSTEM_PROBE}, {"role": "user", "content": _USER_PROBE}]


def has_system_turn(probe_rendered: str) -> bool:
    """Whether a template has a system turn of its own, from its rendering of SYSTEM_TURN_PROBE: the system text is
    there and something other than whitespace (a turn's end and the next one's start) separates it from the user's.
    Gemma's writes `{system}\n\n{user}` in one user turn: no system turn; Qwen's ends a system turn between them."""
    start = probe_rendered.find(_SYSTEM_PROBE)
    end = probe_rendered.find(_USER_PROBE)
    if start < 0 or end < 0 or end < start:
        return False
    return bool(probe_rendered[start + len(_SYSTEM_PROBE) : end].strip())


def has_inner_system(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether a system message comes after the first message (a mid-conversation instruction)."""
    return any(m.get("role") == "system" for m in messages[1:])


def renders_inner_system(messages: Sequence[Mapping[str, Any]], rendered: str) -> bool:
    """Whether every system message past the first reached the rendered prompt (its text, as templates trim it)."""
    return all(str(m.get("content") or "").strip() in rendered for m in messages[1:] if m.get("role") == "system")


def folded_system_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The conversation for a template that has no system turn past the first: the leading system messages joined
    into one (the template folds it into the first user turn), and each later one merged into the user turn next to
    it: appended to the user message just before it (it stays before the reply it precedes), else put before the user
    message just after it (as a leading system text is), else a user message of its own; user messages that end up
    adjacent are joined, so that turns still alternate. Texts are joined with a blank line."""
    out: list[dict[str, Any]] = []
    pending: list[str] = []  # system texts waiting for the next user message
    leading = True
    for message in messages:
        role = message.get("role")
        text = str(message.get("content") or "")
        if role == "system" and leading:
            if out:
                out[0] = {**out[0], "content": _joined(out[0].get("content"), text)}
            else:
                out.append(dict(message))
            continue
        leading = False
        if role == "system":
            if out and out[-1].get("role") == "user" and not pending:
                out[-1] = {**out[-1], "content": _joined(out[-1].get("content"), text)}
            else:
                pending.append(text)
            continue
        if role == "user" and pending:
            message = {**message, "content": _joined(*pending, message.get("content"))}
            pending.clear()
        elif pending:  # an assistant (or other) turn follows: the waiting texts become a user turn before it
            out.append({"role": "user", "content": _joined(*pending)})
            pending.clear()
        if role == "user" and out and out[-1].get("role") == "user":
            out[-1] = {**out[-1], "content": _joined(out[-1].get("content"), message.get("content"))}
            continue
        out.append(dict(message))
    if pending:
        if out and out[-1].get("role") == "user":
            out[-1] = {**out[-1], "content": _joined(out[-1].get("content"), *pending)}
        else:
            out.append({"role": "user", "content": _joined(*pending)})
    return out


def _joined(*texts: Any) -> str:
    return "\n\n".join(str(t) for t in texts if t)
