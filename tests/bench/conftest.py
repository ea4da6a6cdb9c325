"""Fixtures for the bench tests: one tiny checkpoint (with a tokenizer) shared by the whole module."""

from __future__ import annotations

import shutil
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


@pytest.fixture
def fake_llama_server(tmp_path: Path) -> Path:
    """An executable named llama-server that runs tests/bench/fake_llama_server.py (the peer of the bench tests)."""
    fake = tmp_path / "fake_llama_server.py"
    shutil.copy(Path(__file__).with_name("fake_llama_server.py"), fake)
    binary = tmp_path / "llama-server"
    binary.write_text(f'#!/bin/sh\nexec {sys.executable} {fake} "$@"\n')
    binary.chmod(0o755)
    return binary
