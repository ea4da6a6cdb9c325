"""A request's output constraint, from whichever field it came in: OpenAI's `response_format`, vLLM's
`structured_outputs`, or vLLM's older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`.

Why one place: the three shapes mean the same five constraints (kvserve.structured.StructuredOutputsParams), a
request may carry only one of them, and a client must learn which field was wrong. So each constraint keeps the
name of the field it came from (`response_format.json_schema.schema`, `guided_regex`, ...), and every error about
it, from a bad shape here to a schema the grammar library refuses (compiled on the preparation thread before the
request is queued), is a 400 naming that field.

`structured_outputs` may also carry only options (`{"disable_any_whitespace": true}`); they then apply to the
constraint given in another field, so that an openai-SDK user of `response_format` can ask for compact JSON. With no
constraint anywhere they change nothing (as in vLLM): a client configured once with them (LangChain's `extra_body`)
sends them with every request, plain ones too.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from kvserve.server.errors import APIError, bad_request
from kvserve.structured.backend import GrammarCompileError
from kvserve.structured.params import StructuredOutputsParams

if TYPE_CHECKING:
    from kvserve.server.protocol import SamplingFields
    from kvserve.structured.compiler import GrammarCompiler

_CONSTRAINT_KEYS = ("json", "regex", "choice", "grammar", "json_object")
_OPTION_KEYS = tuple(f.name for f in fields(StructuredOutputsParams) if f.init and f.name not in _CONSTRAINT_KEYS)
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


@dataclass(frozen=True, slots=True)
class Constraint:
    """One request's constraint and the request field it came from (for error messages)."""

    params: StructuredOutputsParams
    field: str


def request_constraint(request: SamplingFields) -> Constraint | None:
    """The constraint `request` asks for, None for none; 400 naming the field for a malformed one, or for two."""
    options = _options(request)
    found = [
        c
        for c in (
            _from_response_format(request.response_format),
            _from_structured_outputs(request.structured_outputs),
            *_from_guided(request),
        )
        if c
    ]
    if len(found) > 1:
        names = ", ".join(field for field, _ in found)
        raise bad_request(f"only one output constraint may be given, got {names}", param=found[1][0])
    if not found:
        return None
    field, values = found[0]
    return Constraint(make_params(field, {**values, **options}), field)


def make_params(field: str, values: Mapping[str, Any]) -> StructuredOutputsParams:
    """StructuredOutputsParams from `values`; its ValueError as a 400 whose message names `field`."""
    try:
        return StructuredOutputsParams(**values)
    except (TypeError, ValueError) as e:
        message = str(e)
        for key in _CONSTRAINT_KEYS:  # "structured_outputs.json must be ..." -> "guided_json must be ..."
            message = message.replace(f"structured_outputs.{key}", field)
        raise bad_request(message if field in message else f"{field}: {message}", param=field) from e


def _options(request: SamplingFields) -> dict[str, Any]:
    so = request.structured_outputs or {}
    options = {k: so[k] for k in _OPTION_KEYS if k in so}
    if request.guided_whitespace_pattern is not None:
        options["whitespace_pattern"] = request.guided_whitespace_pattern
    return options


def _from_response_format(response_format: Mapping[str, Any] | None) -> tuple[str, dict[str, Any]] | None:
    """OpenAI's response_format: text (no constraint), json_object, or json_schema {name, schema, strict}."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "response_format", {"json_object": True}
    if kind != "json_schema":
        raise bad_request(
            f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
            param="response_format.type",
        )
    spec = response_format.get("json_schema")
    if not isinstance(spec, Mapping):
        raise bad_request(
            "response_format.json_schema must be an object with the schema under 'schema'",
            param="response_format.json_schema",
        )
    schema = spec.get("schema", spec.get("json_schema"))  # vLLM also reads its alias
    if schema is None:
        raise bad_request("response_format.json_schema.schema is required", param="response_format.json_schema.schema")
    return "response_format.json_schema.schema", {"json": schema}


def _from_structured_outputs(so: Mapping[str, Any] | None) -> tuple[str, dict[str, Any]] | None:
    if not so:
        return None
    unknown = sorted(set(so) - set(_CONSTRAINT_KEYS) - set(_OPTION_KEYS))
    if unknown:
        raise bad_request(
            f"structured_outputs: unknown field(s) {', '.join(unknown)} (known: "
            f"{', '.join(sorted((*_CONSTRAINT_KEYS, *_OPTION_KEYS)))})",
            param="structured_outputs",
        )
    present = [k for k in _CONSTRAINT_KEYS if so.get(k) not in (None, False)]
    if not present:
        return None  # options only: they apply to the constraint of another field
    if len(present) > 1:
        raise bad_request(
            f"structured_outputs: exactly one of {', '.join(_CONSTRAINT_KEYS)} may be set, got {', '.join(present)}",
            param="structured_outputs",
        )
    return f"structured_outputs.{present[0]}", {present[0]: so[present[0]]}


def _from_guided(request: SamplingFields) -> list[tuple[str, dict[str, Any]] | None]:
    return [
        (name, {key: getattr(request, name)}) if getattr(request, name) is not None else None
        for name, key in _GUIDED.items()
    ]


def request_options(request: SamplingFields) -> dict[str, Any]:
    """The constraint options the request gives (structured_outputs' without a constraint, guided_whitespace_pattern),
    for a constraint that comes from elsewhere (a forced tool call)."""
    return _options(request)


def compile_constraint(grammar: GrammarCompiler, constraint: Constraint, caller: Future[Any] | None = None) -> None:
    """Compile now, on a compile thread (GrammarCompiler.run_async; cached, so the engine's own compile is a hit): a
    schema, regex or grammar the backend refuses, or one over a compile budget, is a 400 naming the request field,
    before any response starts."""
    try:
        grammar.compile(constraint.params, caller)
    except GrammarCompileError as e:
        raise compile_failed(e.renamed(constraint.field)) from None


def compile_failed(error: GrammarCompileError) -> APIError:
    return bad_request(str(error), param=error.field)
