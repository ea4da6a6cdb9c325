"""The tool list of a Messages or Responses request as chat's, and what the translation has to remember: where each
chat tool came from (so that an error names the field the client sent), which hosted tools were left out, and which
functions came from a namespace (so that a call is named as the client expects).

Why one place: both APIs are translations onto the chat path (kvserve.server.messages, kvserve.server.responses),
and both get tool lists from coding agents that hold more than functions: Codex sends a `{"type": "namespace"}` tool
(a group of functions) and the hosted `web_search`; Claude Code's SDK users may send Anthropic's server tools. A
hosted tool runs on the provider's servers, which kvserve is not: without --ignore-unsupported-tools it is a 400
naming the flag; with it, it is dropped from the prompt with a warning and named in the X-Kvserve-Ignored-Tools
header (the model cannot call what it is not offered, and the client runs only what the model calls).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any

from kvserve.server.errors import APIError, bad_request

logger = logging.getLogger(__name__)

IGNORE_UNSUPPORTED_TOOLS_FLAG = "--ignore-unsupported-tools"
IGNORED_TOOLS_HEADER = "X-Kvserve-Ignored-Tools"
NAMESPACE_SEPARATOR = "__"  # a namespaced function's name in the prompt: Codex's own flat form, `namespace__name`

_CHAT_TOOL_FIELD = re.compile(r"\btools\[(\d+)\](\.function)?(\.parameters|\.name)?")


@dataclass(frozen=True, slots=True)
class ChatTools:
    """A request's tools as chat's `tools` (None: none), each with the field it came from ("tools[3]",
    "tools[4].tools[1]"), the hosted tools left out ("tools[9] (web_search)"), and the functions that came from a
    namespace: prompt name -> (namespace, name)."""

    tools: list[dict[str, Any]] | None = None
    origin: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)

    def call_name(self, prompt_name: str) -> tuple[str | None, str]:
        """(namespace, name) of a call the model wrote as `prompt_name` (no namespace for a plain function)."""
        found = self.namespaced.get(prompt_name)
        return found if found is not None else (None, prompt_name)

    def renamed(self, error: APIError, schema_field: str) -> APIError:
        """A chat-path error as the client's: chat's `tools[k].function.parameters` becomes the field tool k came
        from, with the API's name for its schema (`input_schema`, `parameters`)."""

        def rename(text: str) -> str:
            def one(m: re.Match[str]) -> str:
                k = int(m.group(1))
                where = self.origin[k] if k < len(self.origin) else f"tools[{k}]"
                leaf = {".parameters": "." + schema_field, ".name": ".name"}.get(m.group(3) or "", "")
                return where + leaf

            return _CHAT_TOOL_FIELD.sub(one, text)

        param = rename(error.param) if error.param is not None else None
        return APIError(error.status, rename(error.message), param=param, code=error.code)

    def headers(self) -> dict[str, str]:
        """The reply's header naming the hosted tools left out (none: {})."""
        if not self.dropped:
            return {}
        return {IGNORED_TOOLS_HEADER: ", ".join(self.dropped).encode("ascii", "backslashreplace").decode("ascii")}


def unsupported_tool(where: str, kind: object, ignore: bool, what: str) -> str:
    """A tool the server cannot run (`what` says which the API supports): with --ignore-unsupported-tools the text
    naming it for the header (after a warning), else a 400 naming the flag."""
    if not ignore:
        raise bad_request(
            f"{where}: {kind!r} tools run on the provider's servers and kvserve cannot run them ({what}); start the "
            f"server with {IGNORE_UNSUPPORTED_TOOLS_FLAG} to leave such tools out of the prompt",
            param=f"{where}.type",
        )
    logger.warning("%s: %r tool left out of the prompt (%s)", where, kind, IGNORE_UNSUPPORTED_TOOLS_FLAG)
    return f"{where} ({kind})"
