"""Claude Code 2.1.197 and Codex CLI 0.171.0, installed from npm (tests/agent_cli/package-lock.json), each run on one
short task against `kvserve serve` with the instruct model, as docs/AGENTS.md configures them: nothing switched off,
a private HOME, the environment variables and config file of the recipe. Opt-in (KVSERVE_AGENT_E2E=1): Claude Code's
first prompt is about 20k tokens, minutes of prefill on a small CPU; the replay of their captured requests through the
server (tests/server/test_agent_replay.py) is what runs by default.

What is asserted is the server's side: each CLI finishes without an API error (a 0.5B model's answer to a coding
agent's prompt is whatever it is), and the requests after each CLI's first read their prompt from the prefix cache."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(os.environ.get("KVSERVE_AGENT_E2E") != "1", reason="opt-in: KVSERVE_AGENT_E2E=1"),
]

CLI_DIR = Path(__file__).resolve().parents[1] / "agent_cli"
MODEL = "qwen2.5-coder-0.5b-instruct"
SERVED = "local"
TASK_TIMEOUT_S = 3600  # a first prompt of 20k tokens on 2 busy cores takes minutes; later turns are cached
TASK = "What does hello.py print? Answer in one short sentence."


def _clis() -> Path:
    """tests/agent_cli/node_modules/.bin, installed from the lock file when missing (npm ci)."""
    if shutil.which("npm") is None or shutil.which("node") is None:
        pytest.fail("node and npm are needed to install Claude Code and Codex")
    if not (CLI_DIR / "node_modules" / ".package-lock.json").exists():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=CLI_DIR, check=True, timeout=600)
    return CLI_DIR / "node_modules" / ".bin"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`kvserve serve` as docs/AGENTS.md starts it, on a free port; its log in a file for when a test fails."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--model", MODEL, "--served-model-name", SERVED]
    cmd += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--ignore-unsupported-tools"]
    cmd += ["--port", str(port)]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "hello.py").write_text('print("hello")\n')
    (tmp_path / "home").mkdir()
    return tmp_path


_SUMMED = (
    "kvserve:prefix_cache_queries_total",
    "kvserve:prefix_cache_hits_total",
    "kvserve:time_to_first_token_seconds_sum",
    "kvserve:time_to_first_token_seconds_count",
    "kvserve:request_prompt_tokens_sum",
)


def _metrics(base: str) -> dict[str, float]:
    """The server's counters this test reads, summed over labels (printed: -rA shows them)."""
    values = dict.fromkeys(_SUMMED, 0.0)
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in values:
            values[name] += float(line.rsplit(" ", 1)[1])
    print({k.removeprefix("kvserve:"): v for k, v in values.items()})
    return values


def _cached_fraction(base: str) -> float:
    values = _metrics(base)
    queries = values["kvserve:prefix_cache_queries_total"]
    return values["kvserve:prefix_cache_hits_total"] / queries if queries else 0.0


def test_claude_code_runs_a_task(server: str, project: Path) -> None:
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(project / "home"),
        "ANTHROPIC_BASE_URL": server,
        "ANTHROPIC_API_KEY": "sk-local",
        "ANTHROPIC_MODEL": SERVED,
        "ANTHROPIC_SMALL_FAST_MODEL": SERVED,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_STREAM_IDLE_TIMEOUT_MS": "1800000",  # its watchdog counts content events: a long prefill sends none
    }
    claude = str(_clis() / "claude")
    cmd = [claude, "-p", TASK, "--output-format", "json", "--max-turns", "3"]
    done = subprocess.run(cmd, cwd=project / "project", env=env, capture_output=True, text=True, timeout=TASK_TIMEOUT_S)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print({k: result.get(k) for k in ("subtype", "num_turns", "duration_ms", "result")})
    assert result["api_error_status"] is None, result
    assert result["subtype"] in ("success", "error_max_turns"), result
    assert result["num_turns"] >= 1
    if result["num_turns"] > 1:  # a tool was called and its result sent back: that request hit the cache
        assert _cached_fraction(server) > 0.5


def test_codex_runs_a_task(server: str, project: Path) -> None:
    config = project / "home" / ".codex"
    config.mkdir(parents=True)
    (config / "config.toml").write_text(
        'model = "local"\nmodel_provider = "kvserve"\n\n[model_providers.kvserve]\nname = "kvserve"\n'
        f'base_url = "{server}/v1"\nenv_key = "KVSERVE_API_KEY"\nwire_api = "responses"\n'
    )
    env = {"PATH": os.environ["PATH"], "HOME": str(project / "home"), "KVSERVE_API_KEY": "sk-local"}
    codex = str(_clis() / "codex")
    cmd = [codex, "exec", "--skip-git-repo-check", "--json", TASK]
    done = subprocess.run(
        cmd,
        cwd=project / "project",
        env=env,
        capture_output=True,
        text=True,
        timeout=TASK_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    print([e["item"]["type"] for e in events if e["type"] == "item.completed"], _cached_fraction(server))
    kinds = [e["type"] for e in events]
    assert "turn.completed" in kinds and "turn.failed" not in kinds, done.stdout[-2000:] + done.stderr[-2000:]
