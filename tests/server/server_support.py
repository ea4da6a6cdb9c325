"""Real uvicorn servers on free ports, serving engines on a tiny random checkpoint (helpers and fixtures;
conftest.py re-exports the fixtures, tests import the helpers from here under this unique module name).

Why in-process threads: each server starts in well under a second and the tests can reach the engine (to
inject faults, gate steps, check the block pool) through the app factory, without any production flag.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from tiny_models import build_tiny_hf_model, tiny_engine
from tiny_tokenizer import write_char_tokenizer

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.engine.core import EngineCore
from kvserve.engine.engine import LLMEngine
from kvserve.server.app import build_app
from kvserve.server.context import ServerSettings
from kvserve.server.transport import ServerConfig, TransportLimits
from kvserve.server.uvicorn_server import GracefulServer

API_KEY = "sk-test-key"
MODEL = "tiny"
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 20.0


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny_llama")
    build_tiny_hf_model("llama_gqa").save_pretrained(path)
    write_char_tokenizer(path)
    return path


def make_engine(model_dir: Path, **overrides: Any) -> LLMEngine:
    """tiny_engine with the server tests' chat template and one CPU thread."""
    return tiny_engine(model_dir, **{"chat_template": CHAT_TEMPLATE, "cpu_threads": 1, **overrides})


class HookedCore:
    """A real engine core whose step() first runs `before_step` (which may block, sleep or raise): the way
    tests inject slowness, gates and faults through the app factory."""

    def __init__(self, inner: EngineCore, before_step: Callable[[], None]) -> None:
        self._inner = inner
        self._before_step = before_step

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def step(self):
        self._before_step()
        return self._inner.step()


def hook_steps(engine: LLMEngine, before_step: Callable[[], None], core: type[HookedCore] = HookedCore) -> LLMEngine:
    """`engine` with its core's steps hooked: AsyncLLMEngine drives the core, so that is where a hook must sit."""
    engine.core = core(engine.core, before_step)  # type: ignore[assignment]
    return engine


class RunningServer:
    """uvicorn serving `app` on 127.0.0.1:<free port> in a background thread, on kvserve's transport."""

    def __init__(
        self, app: Any, engine: AsyncLLMEngine, grace_s: float = 5.0, transport: TransportLimits | None = None
    ) -> None:
        self.engine = engine
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = ServerConfig(
            app, transport or TransportLimits(), log_level="warning", timeout_graceful_shutdown=grace_s
        )
        self.server = GracefulServer(config, on_grace_expired=engine.stop)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def start(self) -> RunningServer:
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:  # uvicorn offers no event for this; bounded
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "server did not stop"

    def client(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=kw.pop("timeout", 30.0), **kw)


ServerFactory = Callable[..., RunningServer]


@pytest.fixture
def make_server(tiny_model_dir: Path) -> Iterator[ServerFactory]:
    """Factory: start a server; `before_step` wraps the engine, engine overrides go to EngineConfig."""
    servers: list[RunningServer] = []

    def make(
        before_step: Callable[[], None] | None = None,
        max_queued_requests: int = 1000,
        grace_s: float = 5.0,
        api_key: str | None = None,
        chat_history_policy: str = "reject",
        core: type[HookedCore] = HookedCore,
        **engine_overrides: Any,
    ) -> RunningServer:
        engine: Any = make_engine(tiny_model_dir, **engine_overrides)
        if before_step is not None or core is not HookedCore:
            engine = hook_steps(engine, before_step or (lambda: None), core)
        async_engine = AsyncLLMEngine(engine, max_queued_requests=max_queued_requests)
        settings = ServerSettings(served_model_names=(MODEL,), api_key=api_key, chat_history_policy=chat_history_policy)
        server = RunningServer(build_app(async_engine, settings), async_engine, grace_s).start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        if server.thread.is_alive():
            server.stop()


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[RunningServer]:
    """The shared server of most tests: API key on, two served names."""
    async_engine = AsyncLLMEngine(make_engine(tiny_model_dir))
    settings = ServerSettings(served_model_names=(MODEL, "tiny-alias"), api_key=API_KEY)
    running = RunningServer(build_app(async_engine, settings), async_engine).start()
    yield running
    running.stop()


@pytest.fixture
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with server.client(headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        yield client


def metric_values(client: httpx.Client) -> dict[str, float]:
    """Sample name (with labels, but the model_name every series carries) -> value, from /metrics parsed by
    prometheus_client's parser (tests/server/test_metrics.py checks the model_name labels themselves)."""
    from prometheus_client.parser import text_string_to_metric_families

    response = client.get("/metrics")
    assert response.status_code == 200
    values = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.02) -> None:
    """Poll `predicate` until true; fail after `timeout` (for state that changes in another thread)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)


def serve_process(
    model_dir: Path, tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], str]:
    """A real `kvserve serve` process on the tiny model (free port, the tiny chat template, one CPU thread, a
    256-block pool; `args` add or override flags), started and healthy. Returns (process, base URL); the caller
    stops it. For tests of what only a whole process shows: signals, exit codes, the log."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    template = tmp_path / "template.jinja"
    template.write_text(CHAT_TEMPLATE)
    cmd = [
        sys.executable,
        "-m",
        "kvserve.cli",
        "serve",
        str(model_dir),
        "--port",
        str(port),
        "--block-size",
        "4",
        "--num-gpu-blocks-override",
        "256",
        "--chat-template",
        str(template),
        "--served-model-name",
        "tiny",
        "--cpu-threads",
        "1",
        *args,
    ]
    proc = subprocess.Popen(
        cmd,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    base = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        try:
            return httpx.get(f"{base}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(healthy, timeout=60, interval=0.1)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, base


def sse_messages(response: httpx.Response) -> Iterator[tuple[str, dict[str, Any]]]:
    """(event, parsed JSON data) of each Server-Sent Event of a streamed response, as they arrive."""
    event, data = "message", ""
    for line in response.iter_lines():
        if line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data += line[5:].strip()
        elif not line and data:
            yield event, json.loads(data)
            event, data = "message", ""
