"""The contributor's checks are one set: the pre-commit hooks run exactly the lint, format and type checks that
.ci/run runs before the suite, so a commit that passes its hooks passes CI's first minute."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ("ruff check", "ruff format", "mypy")


def _ci_checks() -> list[str]:
    lines = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()]
    return [line for line in lines if line.startswith(CHECKS)]


def test_pre_commit_hooks_are_the_ci_checks() -> None:
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    hooks = [hook for repo in config["repos"] for hook in repo["hooks"]]
    assert [hook["entry"] for hook in hooks] == _ci_checks()
    assert all(hook["language"] == "system" and hook["pass_filenames"] is False for hook in hooks)


def test_ci_checks_formatting_and_types() -> None:
    checks = _ci_checks()
    assert "ruff format --check kvserve tests scripts" in checks and "mypy" in checks
