"""Session-wide set-up: offline hubs, and the default model loaded once for every test that needs it.

Why once: a load of Gemma 3 270M takes seconds (a first start, minutes), and about nine modules each loaded their
own. Tests that need other settings build a sibling engine around the same loaded model (LLMEngine.sibling: own KV
cache, scheduler and requests); only a different weight format (q8_0) loads again."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

if TYPE_CHECKING:
    from kvserve.engine.engine import LLMEngine


@pytest.fixture(scope="session")
def default_engine() -> Iterator[LLMEngine]:
    """The default model on its default path (the file's GGUF blocks), with a small pool: for a test's own settings,
    `default_engine.sibling(kv_cache_memory_bytes=..., max_model_len=...)`."""
    from kvserve.config import EngineConfig
    from kvserve.engine.engine import LLMEngine

    engine = LLMEngine.from_config(EngineConfig(kv_cache_memory_bytes=64 << 20))
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def default_float32_model() -> tuple[Any, Any]:
    """(the loaded model, its tokenizer) of the default model dequantized to float32 weights: the exact reference
    path the stored HF outputs are compared with (engine/build.py's build_engine puts engines around it)."""
    import torch

    from kvserve.model.loader import load_model, resolve_dtype
    from kvserve.model.source import resolve_model
    from kvserve.model.tokenizer import load_tokenizer

    source = resolve_model(None)
    device = torch.device("cpu")
    loaded = load_model(source, resolve_dtype("auto", device, None), device)  # type: ignore[arg-type]
    return loaded, load_tokenizer(source)
