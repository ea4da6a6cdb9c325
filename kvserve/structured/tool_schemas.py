"""OpenAI `tools` + `tool_choice` -> the JSON schema that forces a tool call, and the forced output -> calls.

As vLLM does for the two forcing choices (`auto` and `none` force nothing and return None here):
- a named function, `{"type": "function", "function": {"name": N}}`: the output is that function's arguments
  object, constrained by its `parameters` schema; the server wraps it as one call to N;
- `"required"`: the output is a JSON array of `{"name": N, "parameters": {...}}` objects (vLLM's key, kept so that
  prompts and parsers written for vLLM carry over), each constrained by its function's schema through `anyOf`; at
  least one call, and at most one when `parallel_tool_calls` is false. `$defs` / `definitions` of every function
  move to the root (a `#/$defs/X` reference inside a function resolves against the root of the combined schema);
  two functions defining the same name differently are a 400, as in vLLM.
Every bad input is a ValueError naming the request field (`tools[1].function.parameters`, `tool_choice`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvserve.structured.backend import CompiledGrammar, GrammarBackend, GrammarCompileError, GrammarCompileLimit
from kvserve.structured.params import ConstraintKind, StructuredOutputsParams
from kvserve.structured.schema_check import used_keywords, without_keywords
from kvserve.structured.schema_validate import unchecked_keyword

NAME_KEY = "name"
ARGUMENTS_KEY = "parameters"  # vLLM's key in the forced `required` output
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
_DEFS_KEYS = ("$defs", "definitions")


@dataclass(frozen=True, slots=True)
class FunctionTool:
    """One validated entry of `tools`."""

    name: str
    parameters: dict[str, Any]
    index: int  # its position in `tools`, for error messages
    strict: bool = False  # calls read from free text must validate against `parameters` (forced ones always do)

    @property
    def field(self) -> str:
        return f"tools[{self.index}].function.parameters"


@dataclass(frozen=True, slots=True)
class ForcedToolCall:
    """One call read from grammar-forced output: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


def parse_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[FunctionTool]:
    """The request's `tools`, checked: each {"type": "function", "function": {"name", "parameters"?}}."""
    if tools is None:
        return []
    if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
        raise ValueError(f"tools must be a list of tool objects, got {type(tools).__name__}")
    return [_parse_tool(tool, i) for i, tool in enumerate(tools)]


def _parse_tool(tool: object, index: int) -> FunctionTool:
    where = f"tools[{index}]"
    if not isinstance(tool, Mapping):
        raise ValueError(f"{where} must be an object, got {type(tool).__name__}")
    if tool.get("type", "function") != "function":
        raise ValueError(f"{where}.type must be 'function', got {tool.get('type')!r}")
    function = tool.get("function")
    if not isinstance(function, Mapping):
        raise ValueError(f"{where}.function must be an object with a 'name'")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}.function.name must be a non-empty string, got {name!r}")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = _EMPTY_PARAMETERS
    if not isinstance(parameters, Mapping):
        raise ValueError(f"{where}.function.parameters must be a JSON schema object, got {type(parameters).__name__}")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ValueError(f"{where}.function.strict must be true or false, got {strict!r}")
    if strict:
        _check_strict_schema(parameters, f"{where}.function.parameters")
    return FunctionTool(name, dict(parameters), index, bool(strict))


def _check_strict_schema(parameters: Mapping[str, Any], where: str) -> None:
    """A strict function's calls are validated against its schema (schema_validate): one using a keyword that check
    does not know is refused now, as OpenAI refuses strict schemas outside what it supports, rather than checked in
    part."""
    unchecked = unchecked_keyword(parameters)
    if unchecked is not None:
        path, keyword = unchecked
        raise ValueError(
            f"{where}: with strict true, calls are validated against this schema, and kvserve does not validate "
            f"{keyword!r} (at {path}); leave strict out or the keyword out"
        )


def forced_function(tools: list[FunctionTool], tool_choice: object) -> FunctionTool | None:
    """The function a named tool_choice forces (vLLM: the last tool of that name), None for the string choices."""
    name = named_choice(tool_choice)
    if name is None:
        return None
    matches = [t for t in tools if t.name == name]
    if not matches:
        known = ", ".join(t.name for t in tools) or "none"
        raise ValueError(f"tool_choice: function {name!r} is not in tools (tools: {known})")
    return matches[-1]


def named_choice(tool_choice: object) -> str | None:
    """The function name of a named tool_choice, None for "none" / "auto" / "required"; ValueError otherwise."""
    if tool_choice is None or tool_choice in ("none", "auto", "required"):
        return None
    if isinstance(tool_choice, str):
        raise ValueError(f"tool_choice must be 'none', 'auto', 'required' or a named function, got {tool_choice!r}")
    if not isinstance(tool_choice, Mapping) or tool_choice.get("type", "function") != "function":
        raise ValueError(
            f"tool_choice must be 'none', 'auto', 'required' or "
            f"{{'type': 'function', 'function': {{'name': ...}}}}, got {tool_choice!r}"
        )
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str) or not name:
        raise ValueError(f"tool_choice.function.name must be a non-empty string, got {name!r}")
    return name


def tool_choice_schema(
    tools: Sequence[Mapping[str, Any]] | None, tool_choice: object, parallel_tool_calls: bool = True
) -> dict[str, Any] | None:
    """The JSON schema the forced output must follow, or None when tool_choice forces nothing."""
    parsed = parse_tools(tools)
    function = forced_function(parsed, tool_choice)
    if function is not None:
        return function.parameters
    if tool_choice != "required":
        return None
    if not parsed:
        raise ValueError("tool_choice 'required' needs at least one tool in tools")
    return required_schema(parsed, parallel_tool_calls)


def required_schema(tools: list[FunctionTool], parallel_tool_calls: bool = True) -> dict[str, Any]:
    """An array of {"name", "parameters"} calls, each to one of `tools` with arguments valid for it."""
    defs = _merged_defs(tools)
    calls = [_call_schema(t) for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _call_schema(tool: FunctionTool) -> dict[str, Any]:
    parameters = {k: v for k, v in tool.parameters.items() if k not in _DEFS_KEYS}
    parameters = _defs_refs_to_root(parameters)
    return {
        "type": "object",
        "properties": {NAME_KEY: {"type": "string", "enum": [tool.name]}, ARGUMENTS_KEY: parameters},
        "required": [NAME_KEY, ARGUMENTS_KEY],
        "additionalProperties": False,
    }


def _merged_defs(tools: list[FunctionTool]) -> dict[str, Any]:
    """Every function's $defs (and draft-07 `definitions`), hoisted to one root $defs."""
    seen: dict[str, Any] = {}
    for tool in tools:
        for key in _DEFS_KEYS:
            defs = tool.parameters.get(key) or {}
            if not isinstance(defs, Mapping):
                raise ValueError(f"{tool.field}.{key} must be an object")
            for name, schema in defs.items():
                if name in seen and seen[name] != schema:
                    raise ValueError(
                        f"{tool.field}.{key}.{name}: another tool defines {name!r} differently; "
                        "definitions shared by several tools must be identical"
                    )
                seen[name] = schema
    return {name: _defs_refs_to_root(schema) for name, schema in seen.items()}


def _defs_refs_to_root(schema: Any) -> Any:
    """`#/definitions/X` -> `#/$defs/X` (the combined schema keeps them all under $defs)."""
    if isinstance(schema, list):
        return [_defs_refs_to_root(s) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {k: _defs_refs_to_root(v) for k, v in schema.items()}
    ref = out.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/definitions/"):
        out["$ref"] = "#/$defs/" + ref[len("#/definitions/") :]
    return out


def tool_choice_params(
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: object,
    parallel_tool_calls: bool = True,
    disable_any_whitespace: bool = False,
) -> StructuredOutputsParams | None:
    """The structured-output constraint for a forcing tool_choice, None otherwise."""
    schema = tool_choice_schema(tools, tool_choice, parallel_tool_calls)
    if schema is None:
        return None
    return StructuredOutputsParams(json=schema, disable_any_whitespace=disable_any_whitespace)


def compile_tool_choice(
    backend: GrammarBackend,
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: object,
    parallel_tool_calls: bool = True,
    disable_any_whitespace: bool = False,
) -> CompiledGrammar | None:
    """The compiled forcing grammar (None when nothing is forced); a schema the backend refuses is a
    GrammarCompileError naming the tool it came from (`tools[2].function.parameters`)."""
    params = tool_choice_params(tools, tool_choice, parallel_tool_calls, disable_any_whitespace)
    if params is None:
        return None
    try:
        return backend.compile(params)
    except GrammarCompileError as e:
        check_tool_schemas(backend.compile, parse_tools(tools))  # raises for the first tool at fault, if one is
        raise e.renamed("tools") from None


@dataclass(frozen=True, slots=True)
class ForcedGrammar:
    """The constraint a forced call compiled as, and the schema keywords it had to leave out (none: as sent)."""

    params: StructuredOutputsParams
    ignored: tuple[str, ...] = ()


_RELAX_ROUNDS = 4  # each round drops the keywords one refusal named; a schema needs one or two


def compile_forced(
    compile_one: Callable[[StructuredOutputsParams], object], params: StructuredOutputsParams
) -> ForcedGrammar:
    """Compile a forced call's constraint; a schema the backend refuses only for keywords it lacks (llguidance's
    `propertyNames`, xgrammar's `patternProperties`, ... : GrammarCompileError.unsupported) is compiled again
    without those keywords, so that the call is forced by everything else in the schema. (A tool's schema is the
    client's, not the user's: Claude Code's zod records all carry `propertyNames`, and refusing them refused every
    forced call.) Anything else refused raises as before; a budget (GrammarCompileLimit) is never relaxed."""
    ignored: list[str] = []
    for _ in range(_RELAX_ROUNDS):
        try:
            compile_one(params)
            return ForcedGrammar(params, tuple(ignored))
        except GrammarCompileLimit:
            raise
        except GrammarCompileError as e:
            new = [k for k in e.unsupported if k not in ignored]
            if not new or params.kind is not ConstraintKind.JSON:
                raise
            ignored += new
            params = replace(params, json=without_keywords(params.schema, frozenset(ignored)))
    compile_one(params)
    return ForcedGrammar(params, tuple(ignored))


def ignored_by_tool(tools: Sequence[FunctionTool], ignored: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """Function name -> the ignored keywords its schema uses (what a response header reports)."""
    out = {}
    for tool in tools:
        used = used_keywords(tool.parameters, frozenset(ignored))
        if used:
            out[tool.name] = used
    return out


def check_tool_schemas(compile_one: Callable[[StructuredOutputsParams], object], tools: list[FunctionTool]) -> None:
    """Compile each function's parameters schema alone (with `compile_one`: a backend's or a GrammarCompiler's
    compile, within its budgets); the first one refused raises, named by its field."""
    for tool in tools:
        try:
            compile_one(StructuredOutputsParams(json=tool.parameters))
        except GrammarCompileError as e:
            raise e.renamed(tool.field) from None


def parse_forced_tool_calls(text: str, tool_choice: object) -> list[ForcedToolCall]:
    """The calls in output that a forcing tool_choice constrained (ValueError if it is not complete JSON, e.g. it
    ended at max_tokens). Named: the whole text is the arguments. Required: arguments re-serialized, as vLLM does."""
    name = named_choice(tool_choice)
    if name is not None:
        _loads(text)
        return [ForcedToolCall(name, text.strip())]
    if tool_choice != "required":
        raise ValueError(f"tool_choice {tool_choice!r} forces no tool call")
    calls = _loads(text)
    if not isinstance(calls, list):
        raise ValueError("forced tool-call output is not a JSON array")
    out = []
    for call in calls:
        if not isinstance(call, dict) or not isinstance(call.get(NAME_KEY), str):
            raise ValueError(f"forced tool-call output has a call without a name: {call!r}")
        arguments = call.get(ARGUMENTS_KEY, {})
        out.append(ForcedToolCall(call[NAME_KEY], json.dumps(arguments, ensure_ascii=False)))
    return out


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"forced tool-call output is not complete JSON: {e}") from e
