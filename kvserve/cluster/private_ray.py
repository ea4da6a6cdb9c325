"""Connecting to Ray so that a cluster kvserve starts is private: token authentication on, its token readable by
this user alone.

Why: Ray's GCS, raylets, workers and agents listen on every interface whatever `--host` says (Ray 2.60 binds its
gRPC servers to the wildcard; giving 127.0.0.1 as the node address does not change that), and whoever reaches them
can run code as this user, whatever `--api-key` says. Ray's token authentication is what stands in the way. Ray
2.60 turns it on for a new local instance only while RAY_AUTH_MODE is unset, and writes the token it generates
world-readable (0644); another version, or RAY_AUTH_MODE=disabled left in the environment, starts an open cluster.
So kvserve asks for token authentication itself, makes the token file 0600 (in a 0700 folder when it makes the
folder), and warns loudly where RAY_AUTH_MODE turns authentication off. A cluster the user runs (`--ray-address`,
$RAY_ADDRESS) is the user's to secure: joining one without authentication is warned about too.
"""

from __future__ import annotations

import importlib
import logging
import os
import secrets
import stat
import sys
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

AUTH_MODE = "RAY_AUTH_MODE"  # Ray's variables: the mode, the token itself, the token file
AUTH_TOKEN = "RAY_AUTH_TOKEN"
AUTH_TOKEN_PATH = "RAY_AUTH_TOKEN_PATH"
DOCS = "docs/SCALE_OUT.md#security"


def token_path(environ: MutableMapping[str, str]) -> Path:
    """Where Ray reads its token: $RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token (Ray's own default)."""
    return Path(environ.get(AUTH_TOKEN_PATH) or Path.home() / ".ray" / "auth_token")


def ensure_private_token(path: Path) -> None:
    """A token at `path` that only this user can read: made here (0600, a random 64-hex-digit token, the form Ray
    generates) when there is none, tightened to 0600 when others could read it. A file that is not a regular file
    of this user's is refused rather than trusted."""
    if not path.parent.exists():
        path.parent.mkdir(mode=0o700, parents=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except FileExistsError:
        info = path.lstat()
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            raise ValueError(
                f"Ray's token file {path} is not a regular file owned by this user: kvserve will not start Ray "
                f"with it (remove it, or set {AUTH_TOKEN_PATH}; {DOCS})"
            ) from None
        if info.st_size == 0:
            raise ValueError(f"Ray's token file {path} is empty: remove it (kvserve then makes one) ({DOCS})") from None
        if info.st_mode & 0o077:
            os.chmod(path, 0o600)
            logger.warning(
                "Ray's token file %s could be read by other users (mode %o): made it 0600", path, info.st_mode & 0o777
            )
        return
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    logger.info("made a Ray token for this cluster in %s (mode 0600)", path)


def prepare_private_local_ray(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Before a local Ray instance starts: token authentication asked for, and a private token in place. True
    when it was; False (and a loud warning) where RAY_AUTH_MODE turns authentication off: the user's explicit
    setting is honoured, and said to be dangerous."""
    mode = environ.get(AUTH_MODE)
    if mode is not None and mode.strip().lower() != "token":
        logger.warning(
            "\n%s\n%s=%s: this Ray cluster runs WITHOUT authentication. Its ports listen on every interface, and "
            "anyone who can reach this machine can run code on it, whatever --api-key says. Unset %s (kvserve then "
            "turns on Ray's token authentication) unless this machine is reachable by no one else (%s)\n%s",
            "!" * 100,
            AUTH_MODE,
            mode,
            AUTH_MODE,
            DOCS,
            "!" * 100,
        )
        return False
    if not environ.get(AUTH_TOKEN):
        ensure_private_token(token_path(environ))
    environ[AUTH_MODE] = "token"
    return True


def _raylet() -> Any:
    """Ray's compiled core, where its authentication lives (its type stub does not list those names)."""
    return importlib.import_module("ray._raylet")


def _require_token_mode() -> None:
    """Ray reads RAY_AUTH_MODE into a cached config when it is imported: the cache is read again here (what Ray's
    own ray.init does when it turns token authentication on), and the mode checked. A Ray without token
    authentication cannot start a private cluster."""
    import ray

    raylet = _raylet()
    if not hasattr(raylet, "AuthenticationTokenLoader"):
        raise ValueError(
            f"Ray {ray.__version__} has no token authentication: a local cluster would be open to the network; "
            f"install the version kvserve is tested with: pip install -e '.[cluster]' ({DOCS})"
        )
    raylet.Config.initialize("")
    raylet.AuthenticationTokenLoader.instance().reset_cache()
    if raylet.get_authentication_mode() != raylet.AuthenticationMode.TOKEN:
        raise ValueError(f"Ray {ray.__version__} did not take {AUTH_MODE}=token: kvserve starts no open cluster")


def connect_ray(address: str | None, **init_args: Any) -> bool:
    """ray.init for kvserve: join `address` (else $RAY_ADDRESS), or start a private local instance; nothing when
    this process is already connected. True when this call connected (the caller shuts Ray down at the end)."""
    ray_module = sys.modules.get("ray")
    if ray_module is not None and ray_module.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is None and prepare_private_local_ray():
        _require_token_mode()
    import ray

    ray.init(address=address, **init_args)
    if address is not None:
        _warn_when_unauthenticated(address)
    return True


def _warn_when_unauthenticated(address: str) -> None:
    raylet = _raylet()
    if not hasattr(raylet, "AuthenticationMode") or raylet.get_authentication_mode() != raylet.AuthenticationMode.TOKEN:
        logger.warning(
            "the Ray cluster at %s runs without token authentication: anyone who can reach its ports can run code "
            "on its machines, whatever --api-key says (%s)",
            address,
            DOCS,
        )
