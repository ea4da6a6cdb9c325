"""The contributor's checks are one set: the pre-commit hooks run exactly the lint, format and type checks that
.ci/run runs before the suite, so a commit that passes its hooks passes CI's first minute."""

from __future__ import annotations

from pathlib import Path

import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

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


# mypy --strict's per-module flags (mypy 2.4: `mypy --help`, "--strict"; `strict` itself is global only).
STRICT_FLAGS = {
    "disallow_any_generics",
    "disallow_subclassing_any",
    "disallow_untyped_calls",
    "disallow_untyped_defs",
    "disallow_incomplete_defs",
    "disallow_untyped_decorators",
    "warn_return_any",
    "no_implicit_reexport",
    "strict_equality",
}


def test_the_core_packages_are_type_checked_strictly() -> None:
    mypy = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    (strict,) = [o for o in mypy["overrides"] if set(o["module"]) >= {"kvserve.kv.*", "kvserve.engine.*"}]
    assert set(strict["module"]) == {"kvserve.kv.*", "kvserve.engine.*", "kvserve.kernels.*"}
    assert {flag for flag, on in strict.items() if on is True} == STRICT_FLAGS


def test_the_readme_names_every_system_package_ci_installs_for_the_suite() -> None:
    """#43 item 16: CI installs system packages the suite needs (chromium; nodejs and npm for the JavaScript client
    tests, which fail without them); a newcomer running the README's test command must learn of each there."""
    packages = [
        word
        for line in (ROOT / ".ci/run").read_text().splitlines()
        if "apt-get install" in line
        for word in line.split("apt-get install", 1)[1].split()
        if not word.startswith("-")
    ]
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Run the tests", 1)[1].split("\n## ", 1)[0]
    assert packages and not [p for p in packages if p not in section]
