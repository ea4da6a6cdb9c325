"""The KV-aware router (#17) against real engines on a tiny model: its index, fed by each engine's KV events,
predicts exactly the prefix hit the engine then reports, never across cache salts, and follows evictions; the
balancing rule and the other policies on synthetic loads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from server_support import make_engine as make_server_engine

from kvserve.cluster.router import ReplicaLoad, RequestHasher, Router
from kvserve.engine.engine import LLMEngine
from kvserve.sampling_params import SamplingParams

BS = 4  # make_engine's block size
IDLE = ReplicaLoad()


def make_engine(model_dir: Path, **overrides: Any) -> LLMEngine:
    """The server tests' engine, its KV events opened for reading (none are made while nobody reads them)."""
    engine = make_server_engine(model_dir, **overrides)
    engine.core.kv_events.open_reader()
    return engine


def _run(engine: LLMEngine, request_id: str, prompt: list[int], salt: str | None = None) -> int:
    """Serve one request to the end; the prompt tokens it found in the engine's prefix cache."""
    engine.add_request(
        request_id, prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), cache_salt=salt
    )
    engine.step()
    hit = next(r["prefix_hit_tokens"] for r in engine.kv_snapshot()["requests"] if r["request_id"] == request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return hit


def _feed(router: Router, engines: dict[str, LLMEngine]) -> None:
    for name, engine in engines.items():
        for _, _, event in engine.core.kv_events.drain():
            router.index.apply(name, event)


def test_index_predicts_the_engines_own_prefix_hits(tiny_model_dir: Path) -> None:
    engines = {"r0": make_engine(tiny_model_dir), "r1": make_engine(tiny_model_dir)}
    router = Router("prefix_aware", RequestHasher(BS))
    tenant_a = list(range(10, 10 + 5 * BS))
    tenant_b = list(range(150, 150 + 3 * BS))
    _run(engines["r0"], "a0", tenant_a + [1, 2])
    _run(engines["r1"], "b0", tenant_b + [3])
    _feed(router, engines)
    loads = {"r0": IDLE, "r1": IDLE}
    for prompt, salt, want in ((tenant_a + [7, 8, 9], None, "r0"), (tenant_b[: 2 * BS] + [5] * 9, None, "r1")):
        decision = router.choose(prompt, salt, loads)
        assert decision.replica == want and decision.reason == "prefix_hit"
        hit = _run(engines[want], f"q{want}", prompt, salt)
        assert hit == decision.matched_blocks * BS > 0  # the router's prediction is the engine's hit
    # A salted request shares nothing with the unsalted cache, in the router as in the engine.
    decision = router.choose(tenant_a + [7], "tenant-secret", loads)
    assert decision.reason == "no_prefix_hit" and decision.matched_blocks == 0
    assert _run(engines[decision.replica], "salted", tenant_a + [7], "tenant-secret") == 0


def test_index_follows_evictions_and_clears(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, num_gpu_blocks_override=12)  # room for ~2 prompts: later ones evict
    router = Router("prefix_aware", RequestHasher(BS))
    for i in range(6):
        _run(engine, f"r{i}", [30 * (i + 1) + t for t in range(4 * BS + 1)])
        _feed(router, {"r0": engine})
        assert router.index.blocks_of.get("r0", set()) == {h.hex() for h in engine.core.pool.cached[0]}
    # 24 blocks stored, some evicted
    assert 0 < router.index.num_blocks("r0") == len(engine.core.pool.cached[0]) < 6 * 4
    engine.core.pool.reset_prefix_cache()
    _feed(router, {"r0": engine})
    assert router.index.num_blocks("r0") == 0 and not router.index.holders


def test_imbalance_sends_a_hit_to_the_least_loaded_replica() -> None:
    router = Router("prefix_aware", RequestHasher(BS), balance_abs=4, balance_rel=2.0)
    prompt = list(range(3 * BS + 1))
    for block_hash in router.hasher.block_hashes(prompt):
        router.index.holders.setdefault(block_hash, set()).add("hot")
        router.index.blocks_of.setdefault("hot", set()).add(block_hash)
    busy = {"hot": ReplicaLoad(num_running=6), "cold": ReplicaLoad(num_running=2)}
    assert router.choose(prompt, None, busy).reason == "prefix_hit"  # gap 4: not above balance_abs
    busier = {"hot": ReplicaLoad(num_running=6, num_waiting=3), "cold": ReplicaLoad(num_running=2)}
    decision = router.choose(prompt, None, busier)
    assert (decision.replica, decision.reason, decision.matched_blocks) == ("cold", "imbalanced", 0)
    router.forget(["hot"])
    assert router.choose(prompt, None, busy).reason == "no_prefix_hit"


def test_least_loaded_and_round_robin() -> None:
    least = Router("least_loaded", RequestHasher(BS))
    loads = {
        "a": ReplicaLoad(num_running=3),
        "b": ReplicaLoad(num_running=1, kv_cache_usage=0.9),
        "c": ReplicaLoad(num_running=1, kv_cache_usage=0.2),
    }
    assert least.choose([1, 2], None, loads).replica == "c"
    rr = Router("round_robin", RequestHasher(BS))
    assert [rr.choose([1], None, loads).replica for _ in range(4)] == ["a", "b", "c", "a"]
    with pytest.raises(RuntimeError, match="no healthy replica"):
        rr.choose([1], None, {})
    with pytest.raises(ValueError, match="--router"):
        Router("random", RequestHasher(BS))


def test_a_prompt_cache_key_keeps_its_replica_while_it_has_room() -> None:
    """OpenAI's prompt_cache_key: the key's first choice sticks (even against a lighter replica, within the balance
    rule, under every policy); out of balance, or gone, the key moves; another salt's key is another key."""
    for policy in ("prefix_aware", "least_loaded", "round_robin"):
        router = Router(policy, RequestHasher(BS))
        loads = {"r0": IDLE, "r1": IDLE}
        first = router.choose([1, 2, 3], None, loads, cache_key="agent-7")
        other = "r1" if first.replica == "r0" else "r0"
        lighter = {first.replica: ReplicaLoad(num_running=3), other: IDLE}  # within balance: 3 vs 0 < 8 apart
        for _ in range(3):
            again = router.choose([9, 9, 9], None, lighter, cache_key="agent-7")
            assert again.replica == first.replica and again.reason == "prompt_cache_key", policy
        swamped = {first.replica: ReplicaLoad(num_running=20), other: ReplicaLoad(num_running=1)}
        moved = router.choose([9, 9, 9], None, swamped, cache_key="agent-7")
        assert moved.replica == other and moved.reason != "prompt_cache_key"
        assert router.choose([9], None, {other: IDLE, first.replica: IDLE}, cache_key="agent-7").replica == other
        gone = router.choose([9], None, {first.replica: IDLE}, cache_key="agent-7")
        assert gone.replica == first.replica and gone.reason != "prompt_cache_key"  # the key's replica was down
        assert ("tenant-b", "agent-7") not in router.cache_keys
        router.choose([9], "tenant-b", loads, cache_key="agent-7")
        assert ("tenant-b", "agent-7") in router.cache_keys and (None, "agent-7") in router.cache_keys
