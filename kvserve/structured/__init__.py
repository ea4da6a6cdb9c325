"""Structured output: constraints (JSON schema, regex, choice, grammar), grammar backends, per-request matchers.

Imports downward only (torch and the grammar libraries); the engine and the server plug these pieces in.
The grammar libraries are imported when a backend is built, not when this package is.
"""

from kvserve.structured.backend import (
    BACKEND_NAMES,
    CompiledGrammar,
    GrammarBackend,
    GrammarCompileError,
    GrammarVocab,
    make_backend,
)
from kvserve.structured.compiler import GrammarCompiler
from kvserve.structured.matcher import (
    GrammarMatcher,
    allocate_token_bitmask,
    apply_token_bitmask_,
    fill_step_bitmask,
)
from kvserve.structured.params import ConstraintKind, StructuredOutputsParams

__all__ = [
    "BACKEND_NAMES",
    "CompiledGrammar",
    "ConstraintKind",
    "GrammarBackend",
    "GrammarCompileError",
    "GrammarCompiler",
    "GrammarMatcher",
    "GrammarVocab",
    "StructuredOutputsParams",
    "allocate_token_bitmask",
    "apply_token_bitmask_",
    "fill_step_bitmask",
    "make_backend",
]
