"""`--data-parallel-size 2` on a local Ray instance (#17), two replicas of the tiny model behind the one app:
greedy outputs equal the single-process server's, requests sharing a prefix land on the replica that caches
it, cache salts never share, and a replica killed under load loses no request that had not started and leaks
no block on the survivor."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import psutil
import pytest
import ray
import zmq
from kv_events_reader import KVEventBatch, replay, replay_from
from server_support import (
    CHAT_TEMPLATE,
    MODEL,
    RunningServer,
    make_engine,
    serve_process,
    sse_messages,
    wait_until,
)

from kvserve.cluster.engine import ClusterEngine
from kvserve.cluster.private_ray import connect_ray, token_path
from kvserve.config import EngineConfig
from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.engine.engine import LLMEngine
from kvserve.engine.inspector_delta import apply_delta
from kvserve.kv.vllm_events import external_block_hash
from kvserve.server.app import build_app
from kvserve.server.context import ServerSettings

BS = 4
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [40, 41, 42], list(range(60, 90)), [7] * 12]
SETTINGS = ServerSettings(served_model_names=(MODEL,))


def _config(model_dir: Path, **changes: Any) -> EngineConfig:
    return EngineConfig.parse(
        model=str(model_dir),
        num_gpu_blocks_override=256,
        block_size=BS,
        chat_template=CHAT_TEMPLATE,
        cpu_threads=1,
        **changes,
    )


def _kv_events_config(folder: Path) -> dict[str, Any]:
    """vLLM's --kv-events-config; replica r publishes at the rank-offset addresses (`..._dp<r>`)."""
    return {
        "enable_kv_cache_events": True,
        "endpoint": f"ipc://{folder}/kv.pub",
        "replay_endpoint": f"ipc://{folder}/kv.replay",
        "topic": "kv",
    }


@pytest.fixture(scope="module")
def cluster(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[RunningServer, ClusterEngine]]:
    connect_ray(None, num_cpus=4, include_dashboard=False, log_to_driver=False)  # private, as kvserve's own
    try:
        events = _kv_events_config(tmp_path_factory.mktemp("kv-events"))
        engine = ClusterEngine.launch(_config(tiny_model_dir, kv_events_config=events), 2, router_policy="prefix_aware")
        server = RunningServer(build_app(engine, SETTINGS), engine).start()  # type: ignore[arg-type]
        yield server, engine
        server.stop()
    finally:
        ray.shutdown()


def _complete(server: RunningServer, prompt: list[int], max_tokens: int = 6, **extra: Any) -> dict[str, Any]:
    with server.client() as c:
        r = c.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra},
        )
    assert r.status_code == 200, r.text
    return r.json()


def _wait_indexed(engine: ClusterEngine, prompt: list[int], salt: str | None = None) -> None:
    """Until the router's index (fed by the replicas' reports every 50 ms) holds every full block of `prompt`."""
    hashes = engine.router.hasher.block_hashes(prompt, salt)
    wait_until(
        lambda: any(engine.router.index.matched_blocks(hashes, name) == len(hashes) for name in engine.replicas),
        timeout=30,
    )


def _on_replica(engine: ClusterEngine, name: str, fn: Any) -> Any:
    return ray.get(engine.replicas[name].handle.call.remote(fn), timeout=30)


def test_greedy_outputs_equal_one_process(cluster, tiny_model_dir: Path) -> None:
    server, _ = cluster
    single = AsyncLLMEngine(make_engine(tiny_model_dir))
    one = RunningServer(build_app(single, SETTINGS), single).start()
    try:
        for prompt in PROMPTS:
            want = _complete(one, prompt)["choices"][0]["text"]
            assert _complete(server, prompt)["choices"][0]["text"] == want
            with server.client() as c:
                r = c.post(
                    "/v1/completions",
                    json={"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "stream": True},
                )
            frames = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
            assert frames[-1] == "[DONE]"
            assert "".join(json.loads(f)["choices"][0]["text"] for f in frames[:-1]) == want
    finally:
        one.stop()


def test_shared_prefix_goes_to_the_replica_that_caches_it(cluster) -> None:
    server, engine = cluster
    system = list(range(100, 100 + 6 * BS))  # six full blocks
    first = _complete(server, system + [1, 2], max_tokens=2)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    _wait_indexed(engine, system + [1, 2])
    hits_before = engine.decisions.get(("prefix_aware", "prefix_hit"), 0)
    for i in range(4):
        r = _complete(server, system + [3 + i, 4], max_tokens=2)
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 6 * BS  # served where the prefix is
    assert engine.decisions[("prefix_aware", "prefix_hit")] - hits_before == 4
    # A different salt shares nothing, in the router's index as in the engines.
    salted = _complete(server, system + [1, 2], max_tokens=2, cache_salt="tenant-a")
    assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    _wait_indexed(engine, system + [1, 2], "tenant-a")
    other = _complete(server, system + [1, 9], max_tokens=2, cache_salt="tenant-b")
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_prompt_cache_key_routes_its_requests_together(cluster) -> None:
    """Requests of one prompt_cache_key and no prefix in common go to one replica (the router's key map)."""
    server, engine = cluster
    before = engine.decisions.get(("prefix_aware", "prompt_cache_key"), 0)
    for i in range(3):
        _complete(server, list(range(200 + 10 * i, 200 + 10 * i + BS + 1)), max_tokens=1, prompt_cache_key="k1")
    assert engine.decisions[("prefix_aware", "prompt_cache_key")] - before == 2  # the first chose, two followed
    assert len({r for (_, key), r in engine.router.cache_keys.items() if key == "k1"}) == 1


def test_health_metrics_and_models(cluster) -> None:
    server, _ = cluster
    with server.client() as c:
        assert c.get("/health").status_code == 200
        models = c.get("/v1/models").json()["data"]
        assert [m["id"] for m in models] == [MODEL]
        metrics = c.get("/metrics").text
    assert "kvserve:num_requests_running " in metrics  # the replicas' sum, under the single-process name
    for name in ("replica-0", "replica-1"):
        assert f'kvserve:replica_up{{replica="{name}"}} 1.0' in metrics
        assert f'kvserve:replica_generation_tokens_total{{replica="{name}"}}' in metrics
    assert 'kvserve:router_decisions_total{policy="prefix_aware",reason=' in metrics


def _kv_state(snapshot: dict[str, Any]) -> dict[str, Any]:
    """What a KV inspector snapshot says of a pool (token ids aside: the stream carries none)."""
    return {
        "pool": snapshot["pool"],
        "block_states": snapshot["block_states"],
        "prefix_cache": snapshot["prefix_cache"],
        "requests": snapshot["requests"],
        "blocks": [{**b, "token_ids": None} for b in snapshot["blocks"]],
    }


def _real_kv(engine: ClusterEngine, name: str) -> dict[str, Any]:
    """The replica's own state, built on its engine thread."""
    return _kv_state(_on_replica(engine, name, lambda e: e.kv_snapshot(False)))


def _new_prefixes(server: RunningServer, start: int, count: int) -> None:
    """Requests that no replica has cached: the router takes turns, so each replica gets some."""
    for i in range(count):
        _complete(server, list(range(start + 20 * i, start + 20 * i + 3 * BS + 1)), max_tokens=2)


def test_kv_inspector_shows_each_replica(cluster) -> None:
    server, engine = cluster
    _new_prefixes(server, 130, 4)
    with server.client() as c:
        assert c.get("/v1/kv/replicas").json() == [{"name": "replica-0", "up": True}, {"name": "replica-1", "up": True}]
        for path in ("/v1/kv/snapshot", "/v1/kv/stream", "/v1/kv/blocks/1"):
            missing = c.get(path, params={"replica": "replica-9"})
            assert missing.status_code == 404, path
            assert missing.json()["error"]["param"] == "replica" and missing.json()["error"]["code"] == "not_found"
        assert c.get("/v1/kv/snapshot").headers["x-kvserve-replica"] == "replica-0"  # the first that is up
        shown = {}
        for name in engine.replicas:
            r = c.get("/v1/kv/snapshot", params={"replica": name})
            assert r.status_code == 200 and r.headers["x-kvserve-replica"] == name and r.json()["replica"] == name
            shown[name] = r.json()
            assert _kv_state(shown[name]) == _real_kv(engine, name)
            cached = next(b for b in shown[name]["blocks"] if b["state"] == "c")
            detail = c.get(f"/v1/kv/blocks/{cached['id']}", params={"replica": name}).json()
            assert detail["state"] == "c" and detail["token_ids"] == cached["token_ids"]
            assert c.get("/v1/kv/blocks/100000", params={"replica": name}).status_code == 404
    cached = [{node["hash"] for node in shown[name]["prefix_cache"]} for name in ("replica-0", "replica-1")]
    assert cached[0] and cached[1] and cached[0] != cached[1]  # two pools, not one shown twice


def test_kv_stream_of_replica_1_starts_with_its_snapshot(cluster) -> None:
    server, engine = cluster
    handle = engine.replicas["replica-1"].handle
    with server.client() as c, c.stream("GET", "/v1/kv/stream", params={"replica": "replica-1"}) as stream:
        assert stream.status_code == 200 and stream.headers["x-kvserve-replica"] == "replica-1"
        messages = sse_messages(stream)
        kind, first = next(messages)
        assert kind == "snapshot" and _kv_state(first) == _real_kv(engine, "replica-1")
        assert len(ray.get(handle.__ray_call__.remote(lambda actor: actor.kv_feed.watchers), timeout=30)) == 1
        _new_prefixes(server, 210, 2)  # one lands on replica-1: its deltas bring the stream to its new state
        want = _real_kv(engine, "replica-1")
        assert want["block_states"] != first["block_states"]
        state, seq = first, first["seq"]
        for kind, payload in messages:
            assert kind == "delta" and payload["base"] == seq  # no gap, no second snapshot
            state, seq = apply_delta(state, payload), payload["seq"]
            if _kv_state(state) == want:
                break
        else:
            raise AssertionError("the stream ended before its deltas reached replica-1's state")
    deadline = time.monotonic() + 30  # the closed stream ends the replica's watch
    while ray.get(handle.__ray_call__.remote(lambda actor: actor.kv_feed.watchers), timeout=30):
        assert time.monotonic() < deadline, "the replica's publisher is still watched"
        time.sleep(0.1)


@pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian's chromium is not installed at /usr/bin/chromium")
def test_kv_inspector_page_switches_replicas(cluster, tmp_path: Path) -> None:
    """In chromium (as tests/server/test_kv_inspector_browser.py): with two replicas the page has a selector, says
    which replica it shows, and switching shows the other replica's cached blocks."""
    from playwright.sync_api import sync_playwright

    server, engine = cluster
    _new_prefixes(server, 135, 2)
    cached = {name: sorted(n["hash"] for n in _real_kv(engine, name)["prefix_cache"]) for name in engine.replicas}
    assert cached["replica-0"] != cached["replica-1"]
    shown = "() => window.kvInspector.snapshot.prefix_cache.map((n) => n.hash).sort()"
    artifacts = Path(os.environ.get("KVSERVE_TEST_ARTIFACTS", tmp_path))
    artifacts.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_FLAGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.set_default_timeout(20_000)
            errors: list[str] = []
            page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(server.base_url + "/")
            page.wait_for_function("() => window.kvInspector && window.kvInspector.snapshot !== null")
            assert page.is_visible("#replica-picker") and page.input_value("#replica") == "replica-0"
            assert "replica-0" in page.inner_text("#status")
            assert page.evaluate(shown) == cached["replica-0"]
            page.select_option("#replica", "replica-1")  # the stream re-opens for replica-1: a snapshot first
            page.wait_for_function("() => window.kvInspector.snapshot && window.kvInspector.frames.snapshot == 2")
            assert page.input_value("#replica") == "replica-1" and "replica-1" in page.inner_text("#status")
            assert page.evaluate(shown) == cached["replica-1"]
            page.screenshot(path=str(artifacts / "kv-inspector-replicas.png"), full_page=True)
            assert errors == []
        finally:
            browser.close()


def test_each_replica_publishes_kv_events_that_rebuild_its_cache(cluster) -> None:
    """--kv-events-config with two replicas: replica r publishes vLLM's event batches (tagged with its
    data-parallel rank) at its own offset address, and an external router that replays each stream holds
    exactly that replica's prefix cache."""
    server, engine = cluster
    for i in range(4):  # no replica holds these: the router alternates between the two (ties: round robin)
        _complete(server, [150 + 20 * i + j for j in range(3 * BS + 1)], max_tokens=2)
    ctx = zmq.Context()
    try:
        for rank, name in enumerate(engine.replicas):
            # Functions sent to a replica are defined here: Ray pickles them by value (a module-level one would be
            # looked up in a test module the replica cannot import).
            def cache_contents(e: LLMEngine) -> list[tuple[str, str | None, tuple[int, ...]]]:
                """The replica's prefix cache as (hash, parent hash, tokens): what its stream must rebuild."""
                return [
                    (
                        h.hex(),
                        None if b.key is None or b.key.parent is None else b.key.parent.hex(),
                        b.key.token_ids if b.key is not None else (),
                    )
                    for h, b in e.pool.cached[0].items()
                ]

            def publisher_state(e: LLMEngine) -> tuple[int, int, str | None]:
                publisher = e.kv_event_publisher
                assert publisher is not None and publisher.flush()
                return publisher.published, publisher.dropped, publisher.replay_endpoint

            published, dropped, endpoint = _on_replica(engine, name, publisher_state)
            assert dropped == 0 and endpoint is not None
            assert endpoint.endswith(f"/kv.replay_dp{rank}" if rank else "/kv.replay")
            replayed = replay_from(ctx, endpoint, 0)
            assert [seq for seq, _ in replayed] == list(range(published))
            batches = [msgspec.msgpack.Decoder(KVEventBatch).decode(p) for _, p in replayed]
            assert batches and all(b.data_parallel_rank == rank for b in batches)
            want = {
                external_block_hash(h): (None if parent is None else external_block_hash(parent), tokens)
                for h, parent, tokens in _on_replica(engine, name, cache_contents)
            }
            assert want and replay(batches) == want
    finally:
        ctx.term()


def test_client_that_leaves_aborts_its_request_on_the_replica(cluster) -> None:
    server, engine = cluster

    def generated() -> int:
        return sum(_on_replica(engine, name, lambda e: e.num_generation_tokens_total) for name in engine.replicas)

    before = generated()
    longest = engine.facts.max_model_len - 3
    with (
        server.client() as c,
        c.stream(
            "POST",
            "/v1/completions",
            json={"model": MODEL, "prompt": [9, 9, 9], "max_tokens": longest, "ignore_eos": True, "stream": True},
        ) as r,
    ):
        assert r.status_code == 200
        next(line for line in r.iter_lines() if line.startswith("data: "))  # generating; then the client leaves
    deadline = time.monotonic() + 30
    while any(_on_replica(engine, name, lambda e: e.has_unfinished_requests()) for name in engine.replicas):
        assert time.monotonic() < deadline, "the replica kept generating for a client that left"
        time.sleep(0.1)
    assert generated() - before < longest  # stopped early: aborted, not run to max_tokens
    for name in engine.replicas:
        free, usable = _on_replica(engine, name, lambda e: (e.pool.num_free_blocks, e.pool.num_blocks - 1))
        assert free == usable


def test_killed_replica_loses_no_unstarted_request_and_leaks_nothing(cluster, caplog) -> None:
    server, engine = cluster
    caplog.set_level(logging.WARNING, logger="kvserve.cluster.engine")
    victim, survivor = sorted(engine.replicas)

    def send(i: int) -> int:
        with server.client() as c:
            return c.post(
                "/v1/completions",
                json={
                    "model": MODEL,
                    "prompt": [10 + i, 11, 12],
                    "max_tokens": 24,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            ).status_code

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(send, i) for i in range(8)]
        ray.kill(engine.replicas[victim].handle, no_restart=False)  # Ray restarts it
        statuses = [f.result(timeout=120) for f in futures]
    # Requests already generating on the victim end with a 500; every other one succeeds, the victim's
    # unstarted ones on the survivor.
    retried = sum("retrying on another" in r.getMessage() for r in caplog.records)
    assert set(statuses) <= {200, 500} and statuses.count(200) >= 1
    assert retried + statuses.count(500) >= 1, "the kill touched no request: the test proved nothing"
    assert statuses.count(200) >= 8 - statuses.count(500)
    for _ in range(8):  # the survivor keeps serving, and its pool is whole once idle
        assert _complete(server, [20, 21, 22], max_tokens=2)["choices"]
    free = _on_replica(
        engine, survivor, lambda e: (e.pool.num_free_blocks, e.pool.num_blocks - 1, e.has_unfinished_requests())
    )
    assert free[2] is False and free[0] == free[1]
    deadline = time.monotonic() + 120  # Ray restarts the victim, which reports again and is used again
    while not engine.replicas[victim].up:
        assert time.monotonic() < deadline, "the killed replica did not come back"
        time.sleep(0.2)
    for i in range(4):
        assert _complete(server, [30 + i, 31], max_tokens=2)["choices"]
    assert engine.replicas[victim].stats.generation_tokens_total > 0  # the restarted replica serves again


def _free_port_pair() -> int:
    """A port p with p + 1 free too (replica 1 publishes its KV events at the rank-offset port)."""
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return int(port)
    raise RuntimeError("no two consecutive free ports")


def _listening(root: psutil.Process) -> dict[int, tuple[str, list[tuple[str, int]]]]:
    """pid -> (its title, as Ray sets it: `ray::EngineReplica...`; the (address, port) of each TCP socket it
    listens on), for `root` and its descendants."""
    found: dict[int, tuple[str, list[tuple[str, int]]]] = {}
    for process in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            connections = process.net_connections(kind="inet")
            listens = [(c.laddr.ip, c.laddr.port) for c in connections if c.status == psutil.CONN_LISTEN]
            found[process.pid] = ((process.cmdline() or [""])[0], listens)
    return found


def test_serve_cli_with_two_replicas(tiny_model_dir: Path, tmp_path: Path) -> None:
    """`kvserve serve --data-parallel-size 2`: a local Ray instance, both replicas used (round robin), SIGTERM
    drains and exits 0. What it listens on, read from the OS: the HTTP port and the replicas' KV events (vLLM's
    `tcp://*` endpoint) on loopback; beyond loopback only Ray's own servers (token-checked: the test above), one
    core-worker port in each kvserve process (the ingress and the two replicas), nothing of kvserve's."""
    events = _free_port_pair()
    kv_events = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{events}"}
    proc, base = serve_process(
        tiny_model_dir,
        tmp_path,
        "--data-parallel-size",
        "2",
        "--router",
        "round_robin",
        "--uvicorn-log-level",
        "warning",
        "--kv-events-config",
        json.dumps(kv_events),
    )
    try:
        http_port = int(base.rpartition(":")[2])
        sockets = _listening(psutil.Process(proc.pid))
        replicas = [pid for pid, (title, _) in sockets.items() if title.startswith("ray::EngineReplica")]
        assert len(replicas) == 2, sockets
        ours = (http_port, events, events + 1)
        mine = {port: ip for _, listens in sockets.values() for ip, port in listens if port in ours}
        assert mine == {http_port: "127.0.0.1", events: "127.0.0.1", events + 1: "127.0.0.1"}, sockets
        for pid in (proc.pid, *replicas):  # Ray's core-worker gRPC, on the wildcard in Ray 2.60: one each, no more
            beyond = [(ip, port) for ip, port in sockets[pid][1] if not ip.startswith("127.")]
            assert len(beyond) == 1 and beyond[0][0] in ("::", "0.0.0.0"), (pid, sockets[pid])
        with httpx.Client(base_url=base, timeout=60) as c:
            for i in range(4):
                r = c.post("/v1/completions", json={"model": MODEL, "prompt": [5 + i, 6], "max_tokens": 3})
                assert r.status_code == 200, r.text
            time.sleep(0.5)
            metrics = c.get("/metrics").text
        for name in ("replica-0", "replica-1"):
            line = next(
                x
                for x in metrics.splitlines()
                if x.startswith(f'kvserve:replica_generation_tokens_total{{replica="{name}"}}')
            )
            assert float(line.split()[-1]) > 0, metrics
        assert 'kvserve:router_decisions_total{policy="round_robin",reason="round_robin"} 4.0' in metrics
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "2 replicas on Ray" in out


def _ray_client(address: str, tmp_path: Path, **env: str | None) -> subprocess.Popen[str]:
    """A Ray driver, in its own process, that tries to join the cluster at `address` with `env`'s changes."""
    environ = {**os.environ, "HOME": str(tmp_path)}  # a home without Ray's token file
    for key, value in env.items():
        if value is None:
            environ.pop(key, None)
        else:
            environ[key] = value
    code = f"import ray; ray.init(address={address!r}, log_to_driver=False); print('JOINED', ray.cluster_resources())"
    return subprocess.Popen(
        [sys.executable, "-c", code], env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def test_the_local_ray_cluster_refuses_a_client_without_its_token(cluster, tmp_path: Path) -> None:
    """#27 item 4: Ray's ports listen on every interface, so its token is what keeps others out. The GCS address
    Ray reports is the machine's interface address (not loopback): a driver with a wrong token, or none, is
    refused there; one with the token joins (so the refusals are the token's doing). Ray retries a refused join
    for about 20 s, so both run at once."""
    address = ray.get_runtime_context().gcs_address
    path = token_path(os.environ)
    assert os.environ["RAY_AUTH_MODE"] == "token" and stat.S_IMODE(path.stat().st_mode) == 0o600
    refused = [
        _ray_client(address, tmp_path, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 64, RAY_AUTH_TOKEN_PATH=None),
        _ray_client(address, tmp_path, RAY_AUTH_MODE=None, RAY_AUTH_TOKEN=None, RAY_AUTH_TOKEN_PATH=None),
    ]
    joined = _ray_client(address, tmp_path, RAY_AUTH_TOKEN_PATH=str(path))
    out, _ = joined.communicate(timeout=120)
    assert joined.returncode == 0 and "JOINED" in out, out
    for client in refused:
        out, _ = client.communicate(timeout=120)
        assert client.returncode != 0 and "JOINED" not in out, out
        assert "token-auth" in out and f"Failed to connect to Ray cluster at {address}" in out, out


def test_one_process_never_imports_ray() -> None:
    code = (
        "import sys; from kvserve.server import app, cli; from kvserve.engine import async_engine; "
        "assert 'ray' not in sys.modules and 'kvserve.cluster.engine' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_more_cpus_than_the_cluster_has_is_a_clear_error(cluster, tiny_model_dir: Path) -> None:
    """Instead of replicas that wait forever for CPUs (the module's Ray instance has 4)."""
    with pytest.raises(ValueError, match="need 6 CPUs; the Ray cluster has 4"):
        ClusterEngine.launch(dataclasses.replace(_config(tiny_model_dir), cpu_threads=3), 2)


def test_gpu_replicas_on_a_cluster_without_gpus_is_a_clear_error(cluster, tiny_model_dir: Path) -> None:
    """--device cuda asks Ray for one GPU per replica; this Ray instance has none."""
    with pytest.raises(ValueError, match=r"need 2 GPUs \(one each\); the Ray cluster has 0"):
        ClusterEngine.launch(dataclasses.replace(_config(tiny_model_dir), device="cuda"), 2)
