"""kvserve doctor against the real server (uvicorn in a thread, a tiny random checkpoint), with the probe."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvserve.cli import main


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    import uvicorn
    from tiny_models import build_tiny_hf_model
    from tiny_tokenizer import write_char_tokenizer

    from kvserve.config import EngineConfig
    from kvserve.engine.async_engine import AsyncLLMEngine
    from kvserve.engine.engine import LLMEngine
    from kvserve.server.app import build_app
    from kvserve.server.context import ServerSettings

    path: Path = tmp_path_factory.mktemp("tiny_llama")
    build_tiny_hf_model("llama_gqa").save_pretrained(path)
    write_char_tokenizer(path)
    engine = LLMEngine.from_config(
        EngineConfig(model=str(path), num_gpu_blocks_override=256, block_size=4, cpu_threads=1)
    )
    app = build_app(AsyncLLMEngine(engine), ServerSettings(served_model_names=("tiny",)))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(20)


def test_doctor_reads_the_real_server_and_probes_it(server_url: str, capsys) -> None:
    code = main(
        [
            "doctor",
            "--url",
            server_url,
            "--scrapes",
            "2",
            "--interval",
            "0",
            "--probe",
            "--probe-prompt-lens",
            "4,16",
            "--probe-concurrency",
            "1,3",
            "--json",
        ]
    )
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    # It says what it does and for how long before the scrapes' silence (20 s by default), and shows progress.
    assert f"reading {server_url}/metrics 2 times, 0 s apart" in captured.err and "scrapes" in captured.err
    assert doc["models"] == ["tiny"]
    assert doc["cache_config"]["num_blocks"] == "256" and doc["cache_config"]["block_size"] == "4"
    assert [r["concurrency"] for r in doc["probe"]["latency_by_concurrency"]] == [1, 3]
    assert doc["summary"]["requests"] >= 2 + 1 + 3  # the probe's requests show up in the server's TTFT count
    assert doc["summary"]["kv_cache_usage_perc_max"] == 0.0  # idle again after the probe
    # TTFT split into its two causes, as the server measured them: queue time and prefill time
    assert doc["summary"]["queue_time_mean_s"] is not None and doc["summary"]["queue_time_mean_s"] >= 0
    assert doc["windows"][0]["prefill_mean"] is not None and doc["windows"][0]["prefill_mean"] > 0
    assert code == (1 if doc["findings"] else 0)
