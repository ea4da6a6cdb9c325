"""Anthropic's `cache_control` marks: where they may be (checked as Anthropic checks them), where they fall in a
prompt's tokens, and the usage they give (cache read / cache creation / input), for the Messages API
(kvserve.server.messages) and the pins it asks the engine for (kv/pins.py).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from kvserve.kv.misses import common_prefix
from kvserve.server.errors import bad_request
from kvserve.server.prepare import ChatRender, PromptPreparer

if TYPE_CHECKING:
    from kvserve.server.messages import PromptBody

logger = logging.getLogger(__name__)

MAX_BREAKPOINTS = 4  # Anthropic's limit of cache_control blocks a request
TTLS = ("1h", "5m")  # longest first: a 1h breakpoint may not follow a 5m one
TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}


# -- the marks ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Breakpoint:
    """A `cache_control` mark: the block it ends with and its TTL."""

    where: str  # the field, for errors and the position search: "tools[2]", "system[0]", "messages[3].content[1]"
    ttl: str
    section: Literal["tools", "system", "messages"]
    message: int = -1  # messages[message].content[block], when section is "messages"
    block: int = -1  # its index in the system blocks, or in its message's content


def _ttl(mark: Any, param: str) -> str:
    """A cache_control mark's TTL, the mark checked (`param`: where it is)."""
    if not isinstance(mark, dict) or mark.get("type") != "ephemeral":
        raise bad_request(f"{param}.type must be 'ephemeral'", param=f"{param}.type")
    ttl = mark.get("ttl")
    if ttl is None:  # optional, and may be null
        ttl = "5m"
    if ttl not in TTLS:
        raise bad_request(f"{param}.ttl must be '5m' or '1h', got {ttl!r}", param=f"{param}.ttl")
    unknown = sorted(set(mark) - {"type", "ttl"})
    if unknown:
        raise bad_request(f"{param}: unknown field {unknown[0]!r}", param=f"{param}.{unknown[0]}")
    return str(ttl)


def _marked(block: Any) -> bool:
    """Whether a block carries a mark: `cache_control` present and not null (Anthropic's optional field may be)."""
    return isinstance(block, dict) and block.get("cache_control") is not None


def breakpoints(body: PromptBody) -> list[Breakpoint]:
    """The request's cache_control marks in prompt order (tools, system, messages), checked: a 400 naming the field
    for a bad mark, more than four, or a 1h mark after a 5m one (Anthropic's rules)."""
    found: list[Breakpoint] = []
    for i, tool in enumerate(body.tools or []):
        if _marked(tool):
            found.append(Breakpoint(f"tools[{i}]", _ttl(tool["cache_control"], f"tools[{i}].cache_control"), "tools"))
    if isinstance(body.system, list):
        for j, block in enumerate(body.system):
            if _marked(block):
                ttl = _ttl(block["cache_control"], f"system[{j}].cache_control")
                found.append(Breakpoint(f"system[{j}]", ttl, "system", block=j))
    for i, message in enumerate(body.messages):
        content = message.get("content") if isinstance(message, dict) else None
        for j, block in enumerate(content if isinstance(content, list) else []):
            if _marked(block):
                where = f"messages[{i}].content[{j}]"
                ttl = _ttl(block["cache_control"], f"{where}.cache_control")
                found.append(Breakpoint(where, ttl, "messages", i, j))
    if body.cache_control is not None and body.messages:
        # automatic caching: the mark goes on the last block of the last message (a string content is one block)
        i = len(body.messages) - 1
        content = body.messages[i].get("content") if isinstance(body.messages[i], dict) else None
        j = max(len(content) - 1, 0) if isinstance(content, list) else 0
        ttl = _ttl(body.cache_control, "cache_control")
        if not (found and found[-1].message == i and found[-1].block == j):
            found.append(Breakpoint(f"messages[{i}].content[{j}]", ttl, "messages", i, j))
    if len(found) > MAX_BREAKPOINTS:
        raise bad_request(
            f"a request may have at most {MAX_BREAKPOINTS} blocks with cache_control, this one has {len(found)}",
            param=found[MAX_BREAKPOINTS].where + ".cache_control",
        )
    for earlier, later in zip(found, found[1:]):
        if TTLS.index(later.ttl) < TTLS.index(earlier.ttl):
            raise bad_request(
                f"{later.where}: a cache_control with ttl '1h' must not come after one with ttl '5m' ({earlier.where})",
                param=later.where + ".cache_control.ttl",
            )
    return found


# -- where the breakpoints fall, in tokens ----------------------------------------------------------------------


# Two texts no message starts with both of: a placeholder turn after a mark ends where the real continuation starts to
# differ from one of them (the common prefix of two renders, each with one, is the mark's end).
_PLACEHOLDERS = ("0", "1")


def breakpoint_positions(
    prep: PromptPreparer,
    whole: list[dict[str, Any]],
    parts: list[tuple[str, list[dict[str, Any]]]],
    render: ChatRender,
) -> list[int]:
    """On the preparation thread: each breakpoint's end in the prompt's tokens (`parts`: (where, chat messages up to
    the marked block) per mark), 0 where it cannot be placed (logged).

    The end is the longest prefix the whole conversation's tokens share with a render of the conversation up to the
    mark, over three renders: the part alone, and the part followed by a placeholder turn of each role (user,
    assistant), each placeholder's end being where two different placeholders part. Why the placeholder: a template
    may write nothing of what comes before a turn until that turn (Gemma 3's renders the system text inside the first
    user turn: the system blocks alone rendered as a BOS token, and a mark on them pinned nothing); with a turn after
    the mark, everything before it is written as in the real prompt. A template that refuses a render (one that
    insists on alternating roles, say) has that candidate skipped."""
    if not parts:
        return []
    ids_whole = prep.tokenize_messages(whole, render)
    partial = dataclasses.replace(render, add_generation_prompt=False)
    # What any conversation shares with this prompt (a BOS token, a template's header): a mark ending there is no mark.
    header = min(
        _shared(prep, ids_whole, [{"role": "user", "content": p}], partial, "an empty prompt") for p in _PLACEHOLDERS
    )
    positions = []
    for where, messages in parts:
        end = _shared(prep, ids_whole, messages, partial, where)
        if end <= header:  # the template wrote nothing of the part on its own: try it before a placeholder turn
            for role in ("user", "assistant"):
                turns = [[*messages, {"role": role, "content": p}] for p in _PLACEHOLDERS]
                end = max(end, min(_shared(prep, ids_whole, t, partial, where) for t in turns))
        if end <= header:
            logger.warning("cache_control at %s could not be placed in the prompt: it pins nothing", where)
            end = 0
        positions.append(end)
    return positions


def _shared(
    prep: PromptPreparer, ids_whole: list[int], messages: list[dict[str, Any]], render: ChatRender, where: str
) -> int:
    """The tokens the whole prompt shares with a render of `messages`; 0 when the template refuses it."""
    try:
        ids = prep.tokenize_messages(messages, render)
    except Exception as e:  # noqa: BLE001 - a template's own error on a partial conversation
        logger.debug("could not render the prompt up to %s: %s", where, e)
        return 0
    return common_prefix(ids_whole, ids)


@dataclass(frozen=True, slots=True)
class CacheUsage:
    """Anthropic's split of a prompt's tokens: read from the KV cache, written at breakpoints, the rest."""

    input_tokens: int
    cache_read_input_tokens: int
    cache_creation_input_tokens: int
    ephemeral_5m_input_tokens: int
    ephemeral_1h_input_tokens: int

    @classmethod
    def of(
        cls, prompt_tokens: int, cached_tokens: int, marks: list[Breakpoint], positions: list[int], block_size: int
    ) -> CacheUsage:
        """Tokens past the cached ones up to the last breakpoint, in whole blocks, were written by this request; each
        is a write of the TTL of the first breakpoint at or after it."""
        written = {"5m": 0, "1h": 0}
        start = cached_tokens
        for mark, position in sorted(zip(marks, positions), key=lambda m: m[1]):
            end = min(position, prompt_tokens) // block_size * block_size
            if end > start:
                written[mark.ttl] += end - start
                start = end
        creation = written["5m"] + written["1h"]
        return cls(prompt_tokens - cached_tokens - creation, cached_tokens, creation, written["5m"], written["1h"])

    def body(self, output_tokens: int) -> dict[str, Any]:
        return {
            "input_tokens": self.input_tokens,
            "cache_creation_input_tokens": self.cache_creation_input_tokens,
            "cache_read_input_tokens": self.cache_read_input_tokens,
            "cache_creation": {
                "ephemeral_5m_input_tokens": self.ephemeral_5m_input_tokens,
                "ephemeral_1h_input_tokens": self.ephemeral_1h_input_tokens,
            },
            "output_tokens": output_tokens,
            "service_tier": "standard",
        }
