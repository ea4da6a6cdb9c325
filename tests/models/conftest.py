"""Fixtures for the model tests; the helpers live in tiny_models.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tiny_models import build_tiny_hf_model, save_tiny_checkpoints


@pytest.fixture
def tiny_checkpoint(tmp_path: Path) -> Callable[..., tuple[Path, torch.nn.Module]]:
    """Factory: save a tiny variant under tmp_path, return (dir, the HF model)."""

    def make(variant: str, max_shard_size: str | None = None, **overrides: object) -> tuple[Path, torch.nn.Module]:
        model = build_tiny_hf_model(variant, **overrides)
        path = tmp_path / variant
        kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(path, **kwargs)
        return path, model

    return make


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny llama (GQA) and gemma3 (MQA, sliding window) checkpoints with a character tokenizer, once per module."""
    return save_tiny_checkpoints(tmp_path_factory.mktemp)
