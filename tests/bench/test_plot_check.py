"""`--plot` is checked before any measurement: a missing plotting library or an unwritable path fails at once
with exit code 2 (it used to crash after the whole benchmark, losing its table and JSON)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import kvserve.bench.kv_cache as kv_cache_bench
from kvserve.cli import main


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Records whether the benchmark itself was started (it must not be)."""
    calls: list[object] = []

    def run(args: object) -> int:
        calls.append(args)
        return 0

    monkeypatch.setattr(kv_cache_bench, "run", run)
    return calls


def test_plot_into_a_missing_folder_fails_before_the_benchmark(tmp_path: Path, capsys, started) -> None:
    assert main(["bench", "kv-cache", "--plot", str(tmp_path / "missing" / "p.png")]) == 2
    assert not started
    err = capsys.readouterr().err
    assert "--plot" in err and "does not exist" in err


def test_plot_without_matplotlib_fails_before_the_benchmark(tmp_path: Path, capsys, monkeypatch, started) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)  # importing it raises ImportError
    assert main(["bench", "kv-cache", "--plot", str(tmp_path / "p.png")]) == 2
    assert not started
    assert "matplotlib cannot be imported" in capsys.readouterr().err


def test_a_good_plot_path_lets_the_benchmark_start(tmp_path: Path, started) -> None:
    assert main(["bench", "kv-cache", "--plot", str(tmp_path / "p.png")]) == 0
    assert len(started) == 1


def test_plot_needs_a_png_name(tmp_path: Path, capsys) -> None:
    assert main(["estimate", "--plot", str(tmp_path / "p.jpg")]) == 2
    assert "must end in .png" in capsys.readouterr().err
