"""`tools` and `tool_choice` of a chat request: what they put into the prompt, what they force, and how the reply
is read back into `message.tool_calls`, streamed or not.

As vLLM does:
- "none": the tools are rendered into the prompt (by the chat template, or its documented fallback), the reply is
  plain text;
- "auto" (the default when tools are given): the model decides; the server's `--tool-call-parser` reads its calls
  out of the text, and without `--enable-auto-tool-choice` the request is a 400;
- "required" or a named function: the output is forced by a grammar (kvserve.structured.tool_schemas) into one or
  more calls whose arguments validate against the function's `parameters` (one call at most with
  parallel_tool_calls false). Forced output is compact JSON (disable_any_whitespace, unless the request's
  structured_outputs options say otherwise): the arguments are one line, and a small model cannot wander off
  into whitespace. A forced tool call takes precedence over response_format, as in vLLM.

Tool schemas are never a reason to refuse a request whose tools are not forced: under "auto" and "none" they only
shape the prompt, and nothing compiles them (coding agents send dozens of schemas, written by zod and pydantic,
with keywords no grammar backend has; vLLM does not compile them either). A forced call's grammar is compiled on a
compile thread before the request is queued: a schema the backend refuses only for keywords it lacks is compiled
without them (compile_forced; `auto` has tried llguidance after xgrammar first), and the reply says which in the
X-Kvserve-Ignored-Schema-Keywords header; any other refusal is a 400 naming `tools[i].function.parameters`.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from kvserve.server.constraints import Constraint, compile_failed, make_params, request_options
from kvserve.server.errors import bad_request
from kvserve.server.protocol import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from kvserve.structured.backend import GrammarCompileError
from kvserve.structured.call_arguments import OfferedTools
from kvserve.structured.params import StructuredOutputsParams
from kvserve.structured.tool_calls import (
    CallPiece,
    ParsedDelta,
    ToolCallAccumulator,
    ToolCallExtractor,
    extract_all,
    feed_in_order,
)
from kvserve.structured.tool_parsers import NamedFunctionExtractor, RequiredExtractor
from kvserve.structured.tool_schemas import (
    ForcedGrammar,
    FunctionTool,
    compile_forced,
    forced_function,
    ignored_by_tool,
    named_choice,
    parse_tools,
    tool_choice_schema,
)

if TYPE_CHECKING:
    from kvserve.server.context import ServerSettings
    from kvserve.server.protocol import ChatCompletionRequest
    from kvserve.structured.compiler import GrammarCompiler

logger = logging.getLogger(__name__)

_FORCED_OPTIONS = {"disable_any_whitespace": True}
AUTO_NEEDS_FLAGS = (
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set on the server'
)


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """A chat request's tools, checked: what to render, what to force, and how to read calls out of the reply."""

    tools: list[dict[str, Any]] | None  # for the prompt (None: no tools)
    functions: list[FunctionTool] = field(default_factory=list)
    choice: str = "none"  # none, auto, required, named
    constraint: Constraint | None = None  # required / named: the forcing grammar
    extractor: Callable[[], ToolCallExtractor] | None = None  # one per choice; None: the reply is plain text
    parallel: bool = True
    # finish_reason "tool_calls" also when max_tokens cut the reply after complete calls: vLLM's rule for parsers that
    # report complete calls only (the Responses API turns it off: its status is "incomplete" then, as OpenAI's)
    tool_calls_at_length: bool = False
    # the reply is decoded keeping special tokens: the parser's markers are special tokens (ToolParserSpec)
    keep_special_tokens: bool = False
    forced: tuple[FunctionTool, ...] = ()  # required / named: the functions the grammar may call


def plan_tools(request: ChatCompletionRequest, settings: ServerSettings) -> ToolPlan:
    """The request's tools and tool_choice, checked (cheap: on the event loop); 400 naming the field otherwise."""
    parallel = request.parallel_tool_calls is not False
    try:
        functions = parse_tools(request.tools)
        choice = _choice(request.tool_choice, bool(functions))
        forced = forced_function(functions, request.tool_choice) if choice == "named" else None
        schema = (
            tool_choice_schema(request.tools, request.tool_choice, parallel)
            if choice in ("named", "required")
            else None
        )
    except ValueError as e:
        raise bad_request(str(e), param="tool_choice" if str(e).startswith("tool_choice") else "tools") from e
    tools = list(request.tools) if request.tools else None
    if choice == "none":
        # the tools are still checked above (a bad schema is a 400 either way); only the prompt leaves them out
        excluded = settings.exclude_tools_when_tool_choice_none and request.tool_choice == "none"
        return ToolPlan(None if excluded else tools, functions)
    if choice == "auto":
        parser = settings.tool_parser
        if not settings.enable_auto_tool_choice or parser is None:
            raise bad_request(AUTO_NEEDS_FLAGS, param="tool_choice")
        reader = partial(parser.extractor, OfferedTools.of_functions(functions))
        return ToolPlan(
            tools,
            functions,
            choice,
            None,
            reader,
            parallel,
            parser.whole_calls,
            keep_special_tokens=parser.special_markers,
        )
    constraint = Constraint(
        make_params("tools", {"json": schema, **_FORCED_OPTIONS, **request_options(request)}), "tools"
    )
    extractor: Callable[[], ToolCallExtractor] = (
        partial(NamedFunctionExtractor, forced.name) if forced is not None else RequiredExtractor
    )
    callable_functions = (forced,) if forced is not None else tuple(functions)
    return ToolPlan(tools, functions, choice, constraint, extractor, parallel, forced=callable_functions)


def _choice(tool_choice: object, has_tools: bool) -> str:
    """none / auto / required / named; OpenAI's default is auto with tools, none without."""
    if tool_choice is None:
        return "auto" if has_tools else "none"
    if tool_choice in ("none", "auto", "required"):
        if tool_choice == "required" and not has_tools:
            raise ValueError("tool_choice 'required' needs at least one tool in tools")
        return "none" if tool_choice == "auto" and not has_tools else str(tool_choice)
    named_choice(tool_choice)  # its shape: ValueError naming tool_choice
    if not has_tools:
        raise ValueError("tool_choice names a function, but the request has no tools")
    return "named"


IGNORED_SCHEMA_KEYWORDS_HEADER = "X-Kvserve-Ignored-Schema-Keywords"


def compile_tools(grammar: GrammarCompiler, plan: ToolPlan, caller: Future[Any] | None = None) -> ForcedGrammar | None:
    """On a compile thread (GrammarCompiler.run_async; `caller` its job's future): a forced call's grammar (cached:
    the engine's compile is a hit), without the schema keywords the backend lacks (compile_forced); None when no
    call is forced. A schema refused for anything else is a 400 naming the tool's field."""
    if plan.constraint is None:
        return None

    def compile_one(params: StructuredOutputsParams) -> object:
        return grammar.compile(params, caller)

    try:
        return compile_forced(compile_one, plan.constraint.params)
    except GrammarCompileError as e:
        for tool in plan.forced:  # the tool at fault, if one is, alone (and as forgiving)
            try:
                compile_forced(compile_one, StructuredOutputsParams(json=tool.parameters))
            except GrammarCompileError as alone:
                raise compile_failed(alone.renamed(tool.field)) from None
        raise compile_failed(e if e.field.startswith("tools[") else e.renamed("tools")) from None


def ignored_keywords_header(plan: ToolPlan, forced: ForcedGrammar | None) -> dict[str, str]:
    """The reply's header naming the schema keywords a forced call's grammar left out, per function (none: {})."""
    if forced is None or not forced.ignored:
        return {}
    per_tool = ignored_by_tool(plan.forced, forced.ignored)
    text = "; ".join(f"{name}: {', '.join(keys)}" for name, keys in per_tool.items()) or ", ".join(forced.ignored)
    logger.warning("forced tool call: schema keywords the grammar backend lacks are not enforced (%s)", text)
    return {IGNORED_SCHEMA_KEYWORDS_HEADER: text.encode("ascii", "backslashreplace").decode("ascii")}


# -- reading calls out of a reply ------------------------------------------------------------------------------


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# A reply's parts in the order written: a piece of content text, or the index of one of its tool calls.
ReplyPart = str | int


@dataclass(frozen=True, slots=True)
class ParsedReply:
    """One whole choice's reply: content (None when empty beside calls, as OpenAI's; "" when empty alone, as a reply
    without tools) and calls; `parts` (when asked for: parse_reply's `ordered`) the same in the order written, which
    OpenAI's message cannot say and Anthropic's content blocks do."""

    content: str | None
    tool_calls: list[ToolCall]
    parts: tuple[ReplyPart, ...] = ()


def parse_reply(plan: ToolPlan, text: str, ordered: bool = False) -> ParsedReply:
    """A non-streamed choice through the plan's extractor (the same machine a stream runs); `ordered`: also its parts
    in order (the text read a character at a time: feed_in_order)."""
    if plan.extractor is None:
        return ParsedReply(text, [], (text,) if ordered and text else ())
    if not ordered:
        result = extract_all(plan.extractor(), text)
        parts: tuple[ReplyPart, ...] = ()
    else:
        deltas = feed_in_order(plan.extractor(), text, finished=True)
        acc = ToolCallAccumulator()
        for delta in deltas:
            acc.add(delta)
        result = acc.result()
        parts = _ordered_parts(deltas, len(result.calls) if plan.parallel else 1)
    calls = result.calls if plan.parallel else result.calls[:1]
    return ParsedReply(
        result.content if calls else result.content or "",
        [ToolCall(id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls],
        parts,
    )


def _ordered_parts(deltas: list[ParsedDelta], num_calls: int) -> tuple[ReplyPart, ...]:
    """Parts in order from feed_in_order's deltas: each content piece, and each of the first `num_calls` calls where
    its first piece is."""
    parts: list[ReplyPart] = []
    seen: set[int] = set()
    for delta in deltas:
        if delta.content:
            parts.append(delta.content)
        for piece in delta.calls:
            if piece.index < num_calls and piece.index not in seen:
                seen.add(piece.index)
                parts.append(piece.index)
    return tuple(parts)


def finish_reason(plan: ToolPlan, reason: str | None, has_calls: bool) -> str | None:
    """ "tool_calls" when the reply called tools and ended by itself, or was cut after complete calls where the plan
    says so (tool_calls_at_length); a forced call cut by max_tokens stays "length"."""
    if has_calls and (reason == "stop" or (plan.tool_calls_at_length and reason == "length")):
        return "tool_calls"
    return reason


class StreamedCalls:
    """One streamed choice's calls: its extractor, and the id each call got in its first piece."""

    def __init__(self, plan: ToolPlan) -> None:
        assert plan.extractor is not None
        self._extractor = plan.extractor()
        self._parallel = plan.parallel
        self._ids: list[str] = []

    @property
    def has_calls(self) -> bool:
        return bool(self._ids)

    def add(self, text: str, finished: bool) -> list[tuple[str, list[DeltaToolCall]]]:
        """(new content, new call pieces) for the next piece of text, as parts in the order written (each content or
        call pieces: feed_in_order); `finished`: it is the last."""
        parts = [(delta.content, self._pieces(delta)) for delta in feed_in_order(self._extractor, text, finished)]
        return [(content, pieces) for content, pieces in parts if content or pieces]

    def _pieces(self, delta: ParsedDelta) -> list[DeltaToolCall]:
        return [self._piece(p) for p in delta.calls if self._parallel or p.index == 0]

    def _piece(self, piece: CallPiece) -> DeltaToolCall:
        if piece.name is None:
            return DeltaToolCall(index=piece.index, function=DeltaFunctionCall(arguments=piece.arguments))
        self._ids.append(new_call_id())
        return DeltaToolCall(
            index=piece.index,
            id=self._ids[-1],
            type="function",
            function=DeltaFunctionCall(name=piece.name, arguments=piece.arguments),
        )
