"""Reliability tests reuse the server tests' helpers (tests/server/server_support.py): put that folder on
sys.path, since pytest only adds this test's own folder, and re-export its fixtures. `guarded_server` is
the server that bad input, fuzzing and security tests attack: API key on, the default model's chat
template (Gemma's, which rejects unknown roles), default body limit."""

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))

from server_support import (
    API_KEY,
    MODEL,
    RunningServer,
    make_engine,
    make_server,  # noqa: F401
    tiny_model_dir,  # noqa: F401
)

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.model.chat_template import GEMMA_CHAT_TEMPLATE
from kvserve.server.app import build_app
from kvserve.server.context import ServerSettings


@pytest.fixture(scope="module")
def guarded_server(tiny_model_dir: Path) -> Iterator[RunningServer]:  # noqa: F811
    async_engine = AsyncLLMEngine(make_engine(tiny_model_dir, chat_template=GEMMA_CHAT_TEMPLATE))
    settings = ServerSettings(served_model_names=(MODEL,), api_key=API_KEY)
    server = RunningServer(build_app(async_engine, settings), async_engine).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture
def make_configured_server(tiny_model_dir: Path) -> Iterator[Callable[..., RunningServer]]:  # noqa: F811
    """Factory: a server on the tiny model with ServerSettings overrides (no key unless given)."""
    servers: list[RunningServer] = []

    def make(**settings: Any) -> RunningServer:
        async_engine = AsyncLLMEngine(make_engine(tiny_model_dir))
        server = RunningServer(
            build_app(async_engine, ServerSettings(served_model_names=(MODEL,), **settings)), async_engine
        ).start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()
