"""StructuredOutputsConfig: vLLM's `--structured-outputs-config` JSON, with kvserve's compile budgets. Pure Python.

Why budgets: a constraint is a program the server compiles for a client, and one hostile request (a choice of
100,000 strings) kept the old single compile thread busy for up to 97 s while every other structured request and
every prompt waited behind it. Now compiles run in worker processes beside the prompt preparation, at most
`max_concurrent_compiles` at once, each bounded in time (a worker over `max_compile_seconds` is killed, and its
request answered with a 400 naming the limit) and in size (a constraint whose source is over `max_grammar_bytes` is
refused before any compile); `max_queued_compiles` more may wait, beyond that a 503 says to retry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.json_flags import check_field_types, config_from_json_flag


@dataclass(frozen=True, slots=True)
class StructuredOutputsConfig:
    """The compile budgets (kvserve's keys of vLLM's flag). compile_in_workers false compiles on threads of this
    process instead (no time limit can then be enforced: a thread cannot be stopped; for embedding and tests).
    disable_any_whitespace: the default of requests that do not say (docs/STRUCTURED_OUTPUT.md)."""

    max_compile_seconds: float = 10.0
    max_grammar_bytes: int = 256 << 10
    max_concurrent_compiles: int = 1
    max_queued_compiles: int = 64
    compile_in_workers: bool = True
    max_cache_bytes: int = 256 << 20  # the compiled grammars kept (their own size, as xgrammar reports it)
    # vLLM's key, with kvserve's default flipped: JSON constraints are compact unless a request says otherwise, so a
    # small model cannot run away into whitespace (llama.cpp bounds it in its grammars too); false lifts it
    disable_any_whitespace: bool = True

    def __post_init__(self) -> None:
        check_field_types(self, "structured_outputs_config")
        checks = [
            (self.max_compile_seconds > 0, "max_compile_seconds", "> 0"),
            (self.max_grammar_bytes >= 1, "max_grammar_bytes", ">= 1"),
            (self.max_concurrent_compiles >= 1, "max_concurrent_compiles", ">= 1"),
            (self.max_queued_compiles >= 0, "max_queued_compiles", ">= 0"),
            (self.max_cache_bytes >= 1, "max_cache_bytes", ">= 1"),
        ]
        for ok, name, expected in checks:
            if not ok:
                raise ValueError(f"--structured-outputs-config {name} must be {expected}, got {getattr(self, name)!r}")


def parse_structured_outputs_config(
    value: str | dict[str, Any] | StructuredOutputsConfig | None,
) -> StructuredOutputsConfig:
    """The flag's JSON text, a dict (the offline API) or a config; None: the defaults."""
    return (
        config_from_json_flag(value, StructuredOutputsConfig, "structured_outputs_config") or StructuredOutputsConfig()
    )
