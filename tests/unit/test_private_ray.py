"""kvserve/cluster/private_ray.py without starting Ray (#27 item 4): the token file it makes or tightens, and the
open cluster it warns about. tests/server/test_cluster.py checks the running cluster refuses a wrong token."""

from __future__ import annotations

import logging
import stat
import string
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvserve.cluster import private_ray
from kvserve.cluster.private_ray import ensure_private_token, prepare_private_local_ray, token_path


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_new_token_is_readable_by_this_user_alone(tmp_path: Path) -> None:
    path = tmp_path / "ray" / "auth_token"
    ensure_private_token(path)
    token = path.read_text()
    assert len(token) == 64 and set(token) <= set(string.hexdigits.lower())
    assert _mode(path) == 0o600 and _mode(path.parent) == 0o700
    ensure_private_token(path)  # a second start keeps the token the running cluster has
    assert path.read_text() == token


def test_a_token_others_can_read_is_tightened_and_kept(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "auth_token"
    path.write_text("f" * 64)
    path.chmod(0o644)  # what Ray 2.60 writes
    with caplog.at_level(logging.WARNING, logger="kvserve.cluster.private_ray"):
        ensure_private_token(path)
    assert _mode(path) == 0o600 and path.read_text() == "f" * 64
    assert "could be read by other users (mode 644): made it 0600" in caplog.text


@pytest.mark.parametrize("kind", ["symlink", "empty"])
def test_a_token_file_that_cannot_be_trusted_is_refused(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "auth_token"
    if kind == "symlink":
        (tmp_path / "elsewhere").write_text("f" * 64)
        path.symlink_to(tmp_path / "elsewhere")
    else:
        path.touch(mode=0o600)
    with pytest.raises(ValueError, match="not a regular file owned by this user" if kind == "symlink" else "is empty"):
        ensure_private_token(path)


@pytest.mark.parametrize("mode", ["disabled", "DISABLED", "k8s", ""])
def test_authentication_turned_off_is_honoured_loudly(
    tmp_path: Path, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    environ = {"RAY_AUTH_MODE": mode, "RAY_AUTH_TOKEN_PATH": str(tmp_path / "auth_token")}
    with caplog.at_level(logging.WARNING, logger="kvserve.cluster.private_ray"):
        assert prepare_private_local_ray(environ) is False
    assert f"RAY_AUTH_MODE={mode}: this Ray cluster runs WITHOUT authentication" in caplog.text
    assert "whatever --api-key says" in caplog.text and "docs/SCALE_OUT.md" in caplog.text
    assert environ["RAY_AUTH_MODE"] == mode and not (tmp_path / "auth_token").exists()


def test_token_mode_is_asked_for_and_the_token_made_where_ray_reads_it(tmp_path: Path) -> None:
    environ = {"RAY_AUTH_TOKEN_PATH": str(tmp_path / "auth_token")}
    assert prepare_private_local_ray(environ) is True
    assert environ["RAY_AUTH_MODE"] == "token" and _mode(tmp_path / "auth_token") == 0o600
    assert token_path(environ) == tmp_path / "auth_token"
    assert token_path({}) == Path.home() / ".ray" / "auth_token"


def test_a_token_given_in_the_environment_needs_no_file(tmp_path: Path) -> None:
    environ = {"RAY_AUTH_MODE": "Token", "RAY_AUTH_TOKEN": "e" * 64, "RAY_AUTH_TOKEN_PATH": str(tmp_path / "t")}
    prepare_private_local_ray(environ)
    assert environ["RAY_AUTH_MODE"] == "token" and not (tmp_path / "t").exists()


def test_joining_a_cluster_without_authentication_is_warned_about(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A cluster the user runs is the user's to secure; kvserve says so when its mode is not token (Ray's modes
    stood in for, so that no open cluster is started to test it)."""
    modes = SimpleNamespace(TOKEN="token", DISABLED="disabled")
    for mode, warned in (("disabled", True), ("token", False)):
        fake = SimpleNamespace(AuthenticationMode=modes, get_authentication_mode=lambda mode=mode: mode)
        monkeypatch.setattr(private_ray, "_raylet", lambda fake=fake: fake)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvserve.cluster.private_ray"):
            private_ray._warn_when_unauthenticated("10.0.0.1:6379")
        assert ("10.0.0.1:6379 runs without token authentication" in caplog.text) is warned
