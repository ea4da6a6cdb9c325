"""Fixtures for the bench tests: one tiny checkpoint (with a tokenizer) shared by the whole module."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from tiny_models import build_tiny_hf_model
from tiny_tokenizer import write_char_tokenizer


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bench_tiny") / "llama_gqa"
    build_tiny_hf_model("llama_gqa").save_pretrained(path)
    write_char_tokenizer(path)
    return path
