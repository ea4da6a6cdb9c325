"""#43 item 15: `kvserve estimate --model qwen2.5-coder-0.5b-instruct` sizes the packaged model `serve` serves by that
name (resolved as kvserve/model/source.py does: its checked, joined file), and says which extra installs it when its
packages are missing. No instruct packages are needed: a packaged model here is the default model's file, stamped
as already joined and checked, or one whose packages are absent."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvserve.cli import main
from kvserve.model import packaged
from kvserve.model.packaged import INSTRUCT_MODEL_NAME, QWEN25_CODER_05B_INSTRUCT, write_verified_stamp
from kvserve.model.source import default_model_path
from kvserve.tools.model_facts import resolve_model_facts


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_packaged_name_is_the_packaged_models_file(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = dataclasses.replace(QWEN25_CODER_05B_INSTRUCT, name="stand-in", file_name="stand-in.gguf")
    joined = cache_dir / "models" / model.file_name
    joined.parent.mkdir(parents=True)
    joined.symlink_to(default_model_path())  # as if joined and checked before: serve would use it as it is
    write_verified_stamp(joined, model.sha256)
    monkeypatch.setitem(packaged.PACKAGED_MODELS, model.name, model)
    facts = resolve_model_facts("stand-in")
    assert (facts.name, facts.kind, facts.source) == ("stand-in", "gguf", str(joined))
    assert facts.shape.num_layers == 18  # Gemma 3 270M's, read from the file's metadata


def test_missing_packages_name_the_extra_that_installs_them(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    absent = tuple(
        dataclasses.replace(p, package=f"kvserve_absent_{p.package}") for p in QWEN25_CODER_05B_INSTRUCT.parts
    )
    monkeypatch.setitem(
        packaged.PACKAGED_MODELS, INSTRUCT_MODEL_NAME, dataclasses.replace(QWEN25_CODER_05B_INSTRUCT, parts=absent)
    )
    assert main(["estimate", "--model", INSTRUCT_MODEL_NAME]) == 2
    err = capsys.readouterr().err
    assert f"model {INSTRUCT_MODEL_NAME!r} needs its packages" in err and "kvserve[instruct]" in err
    assert "Traceback" not in err and "catalog name" not in err
