"""kvserve: an LLM inference engine and OpenAI-compatible server built around a paged KV cache."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
]

if TYPE_CHECKING:
    from kvserve.config import EngineConfig
    from kvserve.engine.engine import LLMEngine
    from kvserve.engine.llm import LLM
    from kvserve.outputs import CompletionOutput, RequestOutput
    from kvserve.sampling_params import SamplingParams
    from kvserve.structured.params import StructuredOutputsParams

_EXPORTS = {
    "LLM": "kvserve.engine.llm",
    "LLMEngine": "kvserve.engine.engine",
    "EngineConfig": "kvserve.config",
    "SamplingParams": "kvserve.sampling_params",
    "StructuredOutputsParams": "kvserve.structured.params",
    "RequestOutput": "kvserve.outputs",
    "CompletionOutput": "kvserve.outputs",
}


def __getattr__(name: str) -> Any:
    """Import lazily so that torch-free tools (kvserve estimate) stay fast."""
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kvserve' has no attribute {name!r}")
