"""The KV inspector's snapshot and events, checked against the engine's real state on a tiny model: block ids,
ref counts, hashes, block tables, the prefix tree, and the events of caching, eviction, preemption and abort."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from server_support import make_engine as make_server_engine

from kvserve.engine.engine import LLMEngine
from kvserve.kv.events import KVEventBuffer, event_to_json
from kvserve.sampling_params import SamplingParams

BS = 4  # make_engine's block size


def make_engine(model_dir: Path, **overrides: Any) -> LLMEngine:
    """The server tests' engine, its KV events opened for reading (none are made while nobody reads them)."""
    engine = make_server_engine(model_dir, **overrides)
    engine.core.kv_events.open_reader()
    return engine


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _kinds(engine: LLMEngine) -> list[str]:
    return [event.kind for _, _, event in engine.core.kv_events.drain()]


def _block(snap: dict[str, Any], block_id: int) -> dict[str, Any]:
    return next(b for b in snap["blocks"] if b["id"] == block_id)


def test_snapshot_matches_pool_and_block_tables(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, num_gpu_blocks_override=64)
    system = list(range(10, 10 + 3 * BS))  # three full blocks shared by both requests
    engine.add_request("a", system + [50, 51], _greedy(8))
    engine.add_request("b", system + [60, 61], _greedy(8))
    engine.step()
    snap = engine.kv_snapshot()
    json.dumps(snap)  # JSON-ready
    pool = engine.core.pool
    assert len(snap["block_states"]) == pool.num_blocks
    assert snap["block_states"][0] == "n"
    assert snap["pool"]["num_free_blocks"] == pool.num_free_blocks
    tables = {r["request_id"]: r["block_ids"] for r in snap["requests"]}
    for seq_id in engine.core.kv_manager.requests:
        blocks = engine.core.kv_manager.group_tables(seq_id)[0]
        assert tables[engine.core.requests.sequences[seq_id].group_id] == [b.block_id for b in blocks]
    shared = tables["a"][:3]
    assert tables["b"][:3] == shared  # the system prompt's blocks, shared
    for block_id in shared:
        entry = _block(snap, block_id)
        real = pool.blocks[block_id]
        assert entry["state"] == "s" and entry["ref_cnt"] == real.ref_cnt == 2
        assert sorted(entry["holders"]) == ["a", "b"]
        assert real.block_hash is not None and entry["hash"] == real.block_hash.hex()[:16]
        assert snap["block_states"][block_id] == "s"
    assert _block(snap, tables["a"][3])["state"] == "u"
    for block in pool.blocks[1:]:  # every block's state agrees with the pool
        expected = "s" if block.ref_cnt > 1 else "u" if block.ref_cnt else "c" if block.block_hash else "f"
        assert snap["block_states"][block.block_id] == expected
    # The prefix tree: one node per cached hash, chained by parent; b's hits on the shared blocks are counted.
    nodes = {n["hash"]: n for n in snap["prefix_cache"]}
    assert len(nodes) == len(pool.cached[0])
    first, second = (_block(snap, i)["hash"] for i in shared[:2])
    assert nodes[first]["parent"] is None and nodes[second]["parent"] == first
    assert nodes[first]["hits"] == 1
    by_req = {r["request_id"]: r for r in snap["requests"]}
    assert by_req["b"]["prefix_hit_tokens"] == 3 * BS and by_req["a"]["status"] == "running"
    assert snap["capacity"]["num_blocks"] == engine.core.cache_plan.num_blocks
    assert snap["gauges"]["num_running"] == 2


def test_stored_events_carry_chained_hashes_and_tokens(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, num_gpu_blocks_override=64)
    prompt = list(range(20, 20 + 2 * BS + 1))
    engine.add_request("a", prompt, _greedy(4))
    engine.step()
    stored = [event_to_json(*item) for item in engine.core.kv_events.drain() if item[2].kind == "block_stored"]
    assert [e["token_ids"] for e in stored] == [prompt[:BS], prompt[BS : 2 * BS]]
    assert stored[0]["parent_block_hash"] is None
    assert stored[1]["parent_block_hash"] == stored[0]["block_hash"]
    assert all(e["block_size"] == BS for e in stored)
    table = engine.core.kv_manager.group_tables(next(iter(engine.core.kv_manager.requests)))[0]
    assert [e["block_id"] for e in stored] == [b.block_id for b in table[:2]]


def test_finished_blocks_become_cached_evictable_then_removed(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, num_gpu_blocks_override=9)  # 8 usable blocks
    engine.add_request("a", list(range(10, 10 + 2 * BS)), _greedy(1))
    while engine.has_unfinished_requests():
        engine.step()
    snap = engine.kv_snapshot()
    cached = [b for b in snap["blocks"] if b["state"] == "c"]
    assert len(cached) == 2 and sorted(b["evict_rank"] for b in cached) == [0, 1]
    engine.core.kv_events.drain()
    engine.add_request("b", list(range(100, 100 + 8 * BS - 1)), _greedy(1))  # needs every block: evicts both
    engine.step()
    assert _kinds(engine).count("block_removed") == 2
    remaining = {n["hash"] for n in engine.kv_snapshot()["prefix_cache"]}
    assert not remaining & {b["hash"] for b in cached}  # a's prefix is gone from the cache


def test_preemption_and_abort_events(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, num_gpu_blocks_override=7, max_model_len=24)  # 6 usable blocks
    engine.add_request("a", list(range(10, 10 + 2 * BS)), _greedy(14))
    engine.add_request("b", list(range(40, 40 + 2 * BS)), _greedy(14))
    kinds: list[str] = []
    events = []
    for _ in range(40):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        for item in engine.core.kv_events.drain():
            kinds.append(item[2].kind)
            events.append(event_to_json(*item))
    preempted = [e for e in events if e["kind"] == "preempted"]
    assert preempted and preempted[0]["tokens_lost"] > 0 and preempted[0]["blocks_freed"] > 0
    assert preempted[0]["request_id"] in ("a", "b")  # the user's id, not the engine's sequence id
    assert engine.kv_snapshot()["gauges"]["num_preemptions"] >= 1
    engine.add_request("c", list(range(70, 70 + 2 * BS)), _greedy(30))
    engine.step()
    held = engine.core.kv_manager.num_blocks_held(engine.core.scheduler.running[0])
    engine.abort_request("c")
    aborted = [event_to_json(*i) for i in engine.core.kv_events.drain() if i[2].kind == "aborted"]
    assert aborted == [
        {
            "kind": "aborted",
            "request_id": "c",
            "blocks_freed": held,
            "seq": aborted[0]["seq"],
            "time": aborted[0]["time"],
        }
    ]
    snap = engine.kv_snapshot()
    assert snap["requests"] == [] and not [b for b in snap["blocks"] if b["state"] in "us"]


def test_admission_refused_is_reported_once(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, num_gpu_blocks_override=7, max_model_len=24)
    engine.add_request("a", list(range(10, 10 + 5 * BS)), _greedy(3))
    engine.add_request("b", list(range(40, 40 + 4 * BS)), _greedy(3))
    engine.step()
    engine.step()
    refused = [i[2] for i in engine.core.kv_events.drain() if i[2].kind == "admission_refused"]
    assert len(refused) == 1 and refused[0].blocks_free < refused[0].blocks_needed
    assert refused[0].request_id == "b"


def test_redacted_snapshot_has_no_tokens(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    engine.add_request("a", list(range(10, 10 + 2 * BS + 1)), _greedy(2))
    engine.step()
    assert any(b["token_ids"] for b in engine.kv_snapshot()["blocks"])
    snap = engine.kv_snapshot(include_tokens=False)
    assert snap["redacted"] and all(b["token_ids"] is None for b in snap["blocks"])


def test_event_buffer_is_bounded() -> None:
    from kvserve.kv.events import AllBlocksCleared

    buffer = KVEventBuffer(capacity=3)
    buffer.append(AllBlocksCleared())  # nobody reads it yet: not kept
    assert len(buffer) == 0
    buffer.open_reader()
    for _ in range(5):
        buffer.append(AllBlocksCleared())
    items = buffer.drain()
    assert [seq for seq, _, _ in items] == [2, 3, 4] and buffer.dropped == 2 and len(buffer) == 0


def test_block_detail_gives_ranges_tokens_and_text(tiny_model_dir: Path) -> None:
    import pytest

    from kvserve.engine.inspector import block_detail

    engine = make_engine(tiny_model_dir)
    engine.add_request("a", "abcdefghij", _greedy(3))
    engine.step()
    seq_id = next(iter(engine.core.kv_manager.requests))
    table = engine.core.kv_manager.group_tables(seq_id)[0]
    tokens = engine.core.requests.sequences[seq_id].request.token_slice(BS, 2 * BS)
    detail = block_detail(engine.core, table[1].block_id)
    assert detail["held"] == [{"request_id": "a", "start": BS, "end": 2 * BS}]
    assert detail["token_ids"] == tokens and "text" not in detail  # the route decodes, off the engine thread
    hidden = block_detail(engine.core, table[1].block_id, include_text=False)
    assert hidden["token_ids"] is None and hidden["held"] == detail["held"]
    with pytest.raises(ValueError, match="out of range"):
        block_detail(engine.core, engine.core.pool.num_blocks)


def test_publisher_publishes_only_while_watched_and_bounds_its_share(tiny_model_dir: Path) -> None:
    from kvserve.engine.kv_publisher import KVPublisher

    engine = make_engine(tiny_model_dir)
    wakes: list[int] = []
    publisher = KVPublisher(engine.core, lambda: wakes.append(1), interval_s=0.0, max_overhead=0.5)
    engine.add_request("a", list(range(10, 10 + 2 * BS + 1)), _greedy(2))
    engine.step()
    publisher.tick(True)
    assert publisher.published.snapshot is None and publisher.published.events  # events without a watcher
    with publisher.watch():
        assert wakes == [1] and publisher.due()
        publisher.tick(False)
        first = publisher.published.snapshot
        assert first is not None and first.seq == 1
        assert all(b["token_ids"] is None for b in first.data["blocks"])  # streamed snapshots carry no tokens
        assert publisher.wait_timeout() is None  # nothing changed since: nothing to publish
        engine.step()
        publisher.tick(True)
        # The next one waits at least twice as long as the last build took (max_overhead 0.5).
        assert publisher._gap_s > 0.0
    assert publisher.num_watchers == 0 and not publisher.due()


def test_waiting_for_the_token_budget_is_not_a_refusal(tiny_model_dir: Path) -> None:
    # Without chunked prefill, b's whole prompt must fit in what a's prefill left of the budget: b waits with the pool
    # nearly empty, which is no lack of blocks.
    engine = make_engine(tiny_model_dir, enable_chunked_prefill=False, max_num_batched_tokens=32, max_model_len=32)
    engine.add_request("a", list(range(10, 30)), _greedy(2))
    engine.add_request("b", list(range(40, 60)), _greedy(2))
    engine.step()
    assert engine.core.num_waiting == 1
    assert "admission_refused" not in _kinds(engine)
