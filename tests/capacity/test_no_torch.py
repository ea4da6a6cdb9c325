"""estimate and advise run without importing torch or transformers (checked in a fresh interpreter)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.capacity_catalog import find_entry
from kvserve.model.packaged import INSTRUCT_MODEL_NAME, QWEN25_CODER_05B_INSTRUCT

CHECK = """
import sys
from kvserve.cli import main
code = main(sys.argv[1:])
heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))
print('HEAVY', heavy, file=sys.stderr)
sys.exit(code if not heavy else 99)
"""


@pytest.fixture
def config_json(tmp_path: Path) -> Path:
    """A model given by config.json alone, with no weights."""
    entry = find_entry("qwen3-8b")
    assert entry is not None
    path = tmp_path / "config.json"
    path.write_text(json.dumps(entry.config))
    return path


@pytest.mark.parametrize(
    "argv",
    [
        ["estimate", "--json"],  # the default model's GGUF
        ["estimate", "--model", "deepseek-v3", "--memory", "1500GB", "--weights-bytes", "700GB", "--json"],
        ["estimate", "--model", "{config}", "--memory", "80GiB", "--json"],
        ["advise", "--model", "llama-3.1-8b", "--memory", "24GiB", "--scenario", "document_qa", "--json"],
    ],
    ids=["gguf", "catalog-mla", "config-json", "advise"],
)
def test_no_torch_import(config_json: Path, argv: list[str]) -> None:
    argv = [a.replace("{config}", str(config_json)) for a in argv]
    proc = subprocess.run([sys.executable, "-c", CHECK, *argv], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["model"]["num_layers"] > 0


@pytest.mark.skipif(
    any(importlib.util.find_spec(p.package) is None for p in QWEN25_CODER_05B_INSTRUCT.parts),
    reason="the instruct model's packages (.[instruct]) are not installed",
)
def test_the_packaged_instruct_model_by_name() -> None:
    """#43 item 15: the name `serve --model` takes is the name `estimate --model` takes, still without torch."""
    argv = ["estimate", "--model", INSTRUCT_MODEL_NAME, "--json"]
    proc = subprocess.run([sys.executable, "-c", CHECK, *argv], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["model"]["name"] == INSTRUCT_MODEL_NAME and doc["model"]["num_layers"] == 24
