"""KV events on ZMQ in vLLM's schema (docs/KV_EVENTS.md), checked the way an external router reads them: decoded
with msgspec structs shaped like vLLM's, replayed (BlockStored adds, BlockRemoved removes, AllBlocksCleared
empties) and compared with the engine's prefix cache after a run with shared prefixes, evictions and a reset."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import msgspec
import psutil
import pytest
import zmq
from kv_events_reader import (
    KVEventBatch,
    LegacyBatch,
    VAllBlocksCleared,
    VBlockRemoved,
    VBlockStored,
    replay,
    replay_from,
)
from server_support import make_engine

from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine_args import add_engine_args, engine_config_from_args
from kvserve.kv.event_publisher import ZmqKVEventPublisher, bound_address, offset_endpoint
from kvserve.kv.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvserve.kv.events_config import KVEventsConfig, parse_kv_events_config
from kvserve.kv.vllm_events import event_batch, external_block_hash
from kvserve.sampling_params import SamplingParams

BS = 4  # make_engine's block size
TOPIC = "kv"


def engine_cache(engine: LLMEngine) -> dict[int, tuple[int | None, tuple[int, ...]]]:
    """The same view, read from the engine's own prefix cache."""
    return {
        external_block_hash(h.hex()): (
            None if b.key is None or b.key.parent is None else external_block_hash(b.key.parent.hex()),
            b.key.token_ids if b.key is not None else (),
        )
        for h, b in engine.core.pool.cached[0].items()
    }


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _run(engine: LLMEngine, prompts: dict[str, list[int]], max_tokens: int = 3) -> None:
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, _greedy(max_tokens))
    while engine.has_unfinished_requests():
        engine.step()


# -- the engine's stream --------------------------------------------------------------------------------------


def test_stream_replays_to_the_engine_cache(tiny_model_dir: Path, tmp_path: Path) -> None:
    pub_ep, replay_ep = f"ipc://{tmp_path}/kv.pub", f"ipc://{tmp_path}/kv.replay"
    engine = make_engine(
        tiny_model_dir,
        num_gpu_blocks_override=17,
        kv_events_config={  # 16 usable blocks
            "enable_kv_cache_events": True,
            "endpoint": pub_ep,
            "replay_endpoint": replay_ep,
            "topic": TOPIC,
        },
    )
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(pub_ep)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
    try:
        system = list(range(10, 10 + 3 * BS))  # a 3-block shared prefix
        _run(engine, {"a": system + [50, 51, 52, 53, 54], "b": system + [60, 61]})
        _run(engine, {"c": system + [70, 71, 72, 73]})  # a prefix hit: nothing new stored for the prefix
        _run(engine, {"d": list(range(200, 200 + 13 * BS))})  # needs most of the pool: evicts cached blocks
        engine.core.pool.reset_prefix_cache()  # AllBlocksCleared
        _run(engine, {"e": system + [80, 81, 82, 83, 84]})
        _run(engine, {"f": list(range(100, 100 + 6 * BS)), "g": system + [90]})
        publisher = engine.core.kv_event_publisher
        assert publisher is not None and publisher.flush() and publisher.dropped == 0

        # Replay from 0 returns every batch, numbered without gaps.
        replayed = replay_from(ctx, replay_ep, 0)
        assert [seq for seq, _ in replayed] == list(range(publisher.published))
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        batches = [decoder.decode(payload) for _, payload in replayed]
        kinds = {type(e).__name__ for b in batches for e in b.events}
        assert kinds == {"VBlockStored", "VBlockRemoved", "VAllBlocksCleared"}  # the run exercised all three
        assert all(b.data_parallel_rank == 0 for b in batches)
        stored = [e for b in batches for e in b.events if isinstance(e, VBlockStored)]
        assert all(
            e.block_size == BS and e.medium == "CPU" and len(e.token_ids) == BS * len(e.block_hashes) for e in stored
        )
        assert any(len(e.block_hashes) > 1 for e in stored)  # a request's new blocks travel as one event
        # The index an external router builds equals the engine's prefix cache: hashes, parents and tokens.
        index = replay(batches)
        assert index and index == engine_cache(engine)

        # The live stream: vLLM's three frames; whatever the subscriber saw equals the replayed batches, up to the last.
        live: dict[int, bytes] = {}
        while sub.poll(2_000):
            topic, seq, payload = sub.recv_multipart()
            assert topic == TOPIC.encode() and len(seq) == 8
            live[int.from_bytes(seq, "big")] = payload
            if int.from_bytes(seq, "big") == publisher.published - 1:
                break
        assert live and max(live) == publisher.published - 1
        assert all(live[seq] == dict(replayed)[seq] for seq in live)
        # Replay from the middle returns only the batches from there on.
        middle = publisher.published // 2
        assert [seq for seq, _ in replay_from(ctx, replay_ep, middle)] == list(range(middle, publisher.published))
    finally:
        sub.close(linger=0)
        ctx.term()
        engine.close()


def test_publisher_off_imports_no_zmq(tiny_model_dir: Path) -> None:
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from server_support import make_engine
        from kvserve.sampling_params import SamplingParams
        for config in (None, {{"enable_kv_cache_events": False, "publisher": "zmq"}}, {{"publisher": "null"}}):
            engine = make_engine({str(tiny_model_dir)!r}, kv_events_config=config)
            engine.add_request("a", list(range(10, 30)), SamplingParams(max_tokens=2, temperature=0.0))
            while engine.has_unfinished_requests():
                engine.step()
            assert engine.core.kv_event_publisher is None
        loaded = sorted(m for m in sys.modules
                        if m == "zmq" or m.startswith(("zmq.", "msgspec")) or m.endswith("event_publisher"))
        assert not loaded, loaded
    """)
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_sibling_engine_does_not_publish(tiny_model_dir: Path, tmp_path: Path) -> None:
    engine = make_engine(
        tiny_model_dir, kv_events_config={"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/kv.pub"}
    )
    try:
        assert engine.core.kv_event_publisher is not None
        assert engine.sibling().core.kv_event_publisher is None  # the address is taken by the first engine
    finally:
        engine.close()


def test_replica_rank_offsets_the_address(tiny_model_dir: Path, tmp_path: Path) -> None:
    """--data-parallel-size N: replica r (EngineConfig.data_parallel_rank) publishes at its own address."""
    engines = [
        make_engine(
            tiny_model_dir,
            data_parallel_rank=rank,
            kv_events_config={"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/kv.pub"},
        )
        for rank in (0, 1)
    ]
    try:
        publishers = [e.core.kv_event_publisher for e in engines]
        assert publishers[0] is not None and publishers[1] is not None
        assert (publishers[0].endpoint, publishers[1].endpoint) == (
            f"ipc://{tmp_path}/kv.pub",
            f"ipc://{tmp_path}/kv.pub_dp1",
        )
        assert publishers[1].data_parallel_rank == 1
    finally:
        for engine in engines:
            engine.close()


# -- the schema, without an engine ----------------------------------------------------------------------------


def _events() -> list[Any]:
    h = [f"{i:02x}" * 32 for i in range(1, 5)]  # sha256-sized hex hashes
    return [
        BlockStored(1, h[0], None, (1, 2), 2),
        BlockStored(2, h[1], h[0], (3, 4), 2),
        BlockStored(3, h[2], None, (5, 6), 2),  # a new chain: a new event
        BlockRemoved(1, h[0]),
        BlockRemoved(2, h[1]),
        AllBlocksCleared(),
        BlockStored(4, h[3], h[2], (7, 8), 2),
    ]


def test_batch_schema_map_encoding() -> None:
    payload = msgspec.msgpack.encode(event_batch(_events(), 12.5, "GPU"))
    batch = msgspec.msgpack.Decoder(KVEventBatch).decode(payload)
    h = [external_block_hash(f"{i:02x}" * 32) for i in range(1, 5)]
    assert h[0] == 0x0101010101010101 and batch.ts == 12.5 and batch.data_parallel_rank == 0
    first, second, removed, cleared, last = batch.events
    assert isinstance(first, VBlockStored) and first.block_hashes == h[:2] and first.parent_block_hash is None
    assert first.token_ids == [1, 2, 3, 4] and first.extra_keys == [None, None] and first.group_idx == 0
    assert first.kv_cache_spec_kind == "full_attention" and first.medium == "GPU"
    assert isinstance(second, VBlockStored) and second.block_hashes == [h[2]] and second.parent_block_hash is None
    assert isinstance(removed, VBlockRemoved) and removed.block_hashes == h[:2]
    assert isinstance(cleared, VAllBlocksCleared)
    assert isinstance(last, VBlockStored) and last.parent_block_hash == h[2]
    raw = msgspec.msgpack.decode(payload)  # the untyped shape a Go/Rust reader sees
    assert isinstance(raw, list) and len(raw) == 3 and raw[1][0]["type"] == "BlockStored"


def test_batch_schema_legacy_array_encoding() -> None:
    payload = msgspec.msgpack.encode(event_batch(_events(), 1.0, "CPU", encoding="array"))
    batch = msgspec.msgpack.Decoder(LegacyBatch).decode(payload)
    assert [type(e).__name__ for e in batch.events] == [
        "LegacyStored",
        "LegacyStored",
        "LegacyRemoved",
        "LegacyCleared",
        "LegacyStored",
    ]
    assert msgspec.msgpack.decode(payload)[1][0][0] == "BlockStored"


def test_non_block_events_make_no_batch() -> None:
    from kvserve.kv.events import Preempted

    assert event_batch([Preempted("r", 4, 1)], 0.0, "CPU") is None


# -- the flag ---------------------------------------------------------------------------------------------------


def test_config_follows_vllm() -> None:
    assert parse_kv_events_config(None) is None
    config = parse_kv_events_config('{"enable_kv_cache_events": true}')
    assert config is not None and config.publisher == "zmq" and config.enabled
    assert (
        config.endpoint,
        config.replay_endpoint,
        config.buffer_steps,
        config.hwm,
        config.max_queue_size,
        config.topic,
    ) == ("tcp://*:5557", None, 10_000, 100_000, 100_000, "")
    assert not KVEventsConfig().enabled and KVEventsConfig().publisher == "null"
    assert not KVEventsConfig(enable_kv_cache_events=True, publisher="null").enabled
    assert (
        offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559" and offset_endpoint("inproc://kv", 1) == "inproc://kv_dp1"
    )


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}', "unknown kv_events_config keys ['endpont']"),
        ("{not json", "not valid JSON"),
        ("[1]", "must be a JSON object"),
        ('{"publisher": "kafka"}', "publisher must be one of null, zmq"),
        ('{"endpoint": "localhost:5557"}', "endpoint must be a ZMQ address"),
        ('{"hwm": "10"}', 'hwm must be an integer, got "10"'),
        ('{"enable_kv_cache_events": 1}', "enable_kv_cache_events must be true or false, got 1"),
        ('{"max_queue_size": 0}', "max_queue_size must be >= 1"),
        ('{"event_encoding": "json"}', "event_encoding must be one of map, array"),
        ('{"bind_host": " "}', "bind_host must be null or an interface address"),
    ],
)
def test_config_errors_are_clear(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        EngineConfig.parse(kv_events_config=value)


def test_flag_reaches_the_engine_config() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--kv-events-config", '{"enable_kv_cache_events": true, "topic": "t"}'])
    config = engine_config_from_args(args).kv_events_config
    assert isinstance(config, KVEventsConfig) and config.enabled and config.topic == "t"
    assert engine_config_from_args(parser.parse_args([])).kv_events_config is None


def test_a_full_queue_drops_and_counts(tmp_path: Path) -> None:
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/q", max_queue_size=1)
    publisher = ZmqKVEventPublisher(config, block_size=2, medium="CPU")
    publisher.close(timeout=30)
    assert not publisher._thread.is_alive()  # the thread is gone: nothing drains the queue
    for i in range(3):
        publisher.record(BlockRemoved(i, f"{i:064x}"))
    publisher.record(AllBlocksCleared())
    assert publisher.dropped == 3  # one queued, three dropped; the engine thread never waited


@pytest.mark.parametrize(
    ("endpoint", "bind_host", "opened"),
    [
        ("tcp://*:5557", None, "tcp://127.0.0.1:5557"),  # offline, or a server on the default --host
        ("tcp://*:5557", "0.0.0.0", "tcp://0.0.0.0:5557"),  # --host 0.0.0.0
        ("tcp://*:5557", "*", "tcp://*:5557"),  # vLLM's every interface, asked for
        ("tcp://*:5557", "::1", "tcp://[::1]:5557"),
        ("tcp://10.1.2.3:5557", None, "tcp://10.1.2.3:5557"),  # explicit: as written
        ("ipc:///tmp/kv", "0.0.0.0", "ipc:///tmp/kv"),
    ],
)
def test_a_wildcard_binds_what_the_server_listens_on(endpoint: str, bind_host: str | None, opened: str) -> None:
    assert bound_address(endpoint, bind_host) == opened


def test_serve_host_reaches_the_events_config() -> None:
    assert KVEventsConfig().listening_on("0.0.0.0").bind_host == "0.0.0.0"
    assert KVEventsConfig(bind_host="*").listening_on("127.0.0.1").bind_host == "*"  # the user's own choice stays


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_default_endpoint_listens_on_loopback_only() -> None:
    """vLLM's default endpoint `tcp://*:5557` would listen on every interface; kvserve's server and offline engine
    bind loopback unless --host (or bind_host) asks otherwise. The sockets are read from the OS (psutil), and a
    subscriber on loopback receives (so the socket listed is the one that publishes)."""
    port, replay_port = _free_port(), _free_port()
    config = KVEventsConfig(
        enable_kv_cache_events=True, endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay_port}"
    )
    publisher = ZmqKVEventPublisher(config, block_size=2, medium="CPU")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        listening = {
            c.laddr.port: c.laddr.ip
            for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port in (port, replay_port)
        }
        assert listening == {port: "127.0.0.1", replay_port: "127.0.0.1"}
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{port}")
        sub.rcvtimeo = 200
        received = None
        for i in range(50):  # PUB drops what it sends before the subscription arrives: send until one lands
            publisher.record(BlockRemoved(i, f"{i:064x}"))
            try:
                received = sub.recv_multipart()
                break
            except zmq.Again:
                continue
        assert received is not None and len(received) == 3
    finally:
        sub.close(linger=0)
        ctx.term()
        publisher.close(timeout=30)


def test_a_taken_address_fails_at_start() -> None:
    ctx = zmq.Context()
    taken = ctx.socket(zmq.PUB)
    taken.bind("tcp://*:*")
    try:
        port = taken.getsockopt_string(zmq.LAST_ENDPOINT).rpartition(":")[2]
        config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}")  # "*": binds, vLLM's rule
        with pytest.raises(ValueError, match="--kv-events-config: cannot open tcp://"):
            ZmqKVEventPublisher(config, block_size=2, medium="CPU")
    finally:
        taken.close(linger=0)
        ctx.term()
