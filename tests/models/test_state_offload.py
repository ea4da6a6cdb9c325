"""A hybrid model's state snapshots in the KV offload tier (kv/state.py, kv/offload/connector.py): stored beside the
blocks in records of their own, restored with them into a snapshot slot, so that a conversation's state survives the
pool's eviction (host memory tier) and a restart (disk tier); a record that does not check out is recomputed, never
used; snapshots are published as KV events of the group after the KV cache groups. Greedy ids are compared with cold
runs (every token computed), which test_state_models.py checks against HF transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_hybrid_kv_cache import run
from test_state_models import GREEDY, cold_run, prompts
from tiny_models import build_tiny_hf_model, tiny_engine
from tiny_tokenizer import write_char_tokenizer

from kvserve.kv.events import BlockRemoved, BlockStored
from kvserve.kv.offload.store_dir import RECORD_SUFFIX

# 4 snapshot slots (max_num_seqs 1): a few other prompts evict a conversation's snapshots from the pool.
SMALL = dict(max_num_batched_tokens=16, max_num_seqs=1)


@pytest.fixture(scope="module", params=["lfm2_hybrid", "qwen3_5_hybrid"])
def hybrid(request, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    build_tiny_hf_model(request.param).save_pretrained(path)
    write_char_tokenizer(path)
    return path


def state_records(root: Path) -> list[Path]:
    """The state tier's records under a tier directory: those of the group after the KV cache groups, which live in
    a fingerprint subdirectory of their own."""
    out = []
    for fingerprint in root.iterdir():
        if fingerprint.is_dir() and "state snapshots" in (fingerprint / "fingerprint.json").read_text():
            out += sorted(fingerprint.glob(f"blocks/*/*{RECORD_SUFFIX}"))
    return out


def first_turn() -> tuple[list[int], list[int]]:
    """A first chat turn's prompt, and the second turn's (the first, its reply, a new message) once the reply is
    known (chat)."""
    return prompts(1, seed=41)[0][:30], [7, 8, 9, 10, 11]


def chat(engine, prompt: list[int], message: list[int]) -> tuple[list[int], object]:
    (first,) = run(engine, [prompt], GREEDY)
    turn = prompt + list(first.outputs[0].token_ids) + message
    return turn, first


def churn(engine) -> None:
    """Other prompts, enough to overwrite every one of the 4 snapshot slots and evict the earlier blocks."""
    for other in prompts(6, seed=42):
        run(engine, [other[:40]], GREEDY)


def test_snapshots_survive_a_restart_through_the_disk_tier(hybrid, tmp_path):
    """A chat's first turn on one engine; the second turn on a fresh engine over the same directory hits up to the
    reply's last block boundary, its blocks and the reply's snapshot restored from disk, and gives the cold run's
    ids. The snapshot tier keeps its own records (a fingerprint subdirectory of its own)."""
    prompt, message = first_turn()
    tier = dict(kv_offloading_size="64MiB", kv_offloading_path=str(tmp_path))
    first = tiny_engine(hybrid, **SMALL, **tier)
    turn, first_out = chat(first, prompt, message)
    first.core.offload.flush()
    first.core.state_offload.flush()
    assert first.core.state_offload.stored_blocks >= 2  # the prompt's hit point and the reply's end
    first.core.close()
    assert state_records(tmp_path)

    second = tiny_engine(hybrid, **SMALL, **tier)
    (out,) = run(second, [turn], GREEDY)
    computed = len(prompt) + len(first_out.outputs[0].token_ids) - 1  # the reply's last token is never computed
    assert out.num_cached_tokens == out.num_restored_tokens == computed // 4 * 4
    assert list(out.outputs[0].token_ids) == cold_run(hybrid, turn)
    snapshots = second.core.kv_manager.state_snapshots
    assert snapshots.num_loaded == 1 and second.core.state_offload.restored_blocks == 1
    from kvserve.engine.inspector import build_snapshot

    view = build_snapshot(second.core)["state"]["offload_tier"]
    assert view["medium"] == "DISK" and view["restored"] == 1 and view["num_snapshots"] >= 2
    second.core.close()


def test_the_host_tier_restores_snapshots_the_pool_overwrote(hybrid):
    """With 4 snapshot slots, other prompts overwrite a conversation's snapshots; its next turn restores the reply's
    snapshot (and any blocks) from the tier in host memory. Without a tier the same turn computes from the start."""
    prompt, message = first_turn()
    want = None
    for size in (None, "64MiB"):
        engine = tiny_engine(hybrid, **SMALL, **({} if size is None else {"kv_offloading_size": size}))
        turn, _ = chat(engine, prompt, message)
        churn(engine)
        assert not any(h in engine.core.kv_manager.state_snapshots for h in engine.core.kv_manager.state.reply_snapshot)
        (out,) = run(engine, [turn], GREEDY)
        want = want or cold_run(hybrid, turn)
        assert list(out.outputs[0].token_ids) == want
        if size is None:
            assert out.num_cached_tokens == 0
        else:
            assert out.num_cached_tokens > len(prompt) and out.num_restored_tokens > 0
            assert engine.core.kv_manager.state_snapshots.num_loaded == 1


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_snapshot_record_is_recomputed(hybrid, tmp_path, damage):
    """A state record changed on disk (a flipped byte, a cut file) fails its checks: the snapshot is not used (counted
    as a restore failure), the hit stops where a good snapshot ends, and the output is the cold run's."""
    prompt, message = first_turn()
    tier = dict(kv_offloading_size="64MiB", kv_offloading_path=str(tmp_path))
    first = tiny_engine(hybrid, **SMALL, **tier)
    turn, _ = chat(first, prompt, message)
    first.core.offload.flush()
    first.core.state_offload.flush()
    first.core.close()
    for record in state_records(tmp_path):
        data = bytearray(record.read_bytes())
        if damage == "flip":
            data[len(data) // 2] ^= 0x40
        else:
            del data[-100:]
        record.write_bytes(bytes(data))

    second = tiny_engine(hybrid, **SMALL, **tier)
    (out,) = run(second, [turn], GREEDY)
    assert list(out.outputs[0].token_ids) == cold_run(hybrid, turn)
    assert second.core.kv_manager.state_snapshots.num_loaded == 0
    assert out.num_cached_tokens == 0
    if damage == "flip":  # same size: refused when read; a cut file is refused by the start-up scan already
        assert second.core.state_offload.stats().restore_failures >= 1
    second.core.close()


def test_snapshots_are_published_as_kv_events_of_their_own_group(hybrid):
    """A saved snapshot is a BlockStored of the group after the KV cache groups (block id: its slot), an overwritten
    one a BlockRemoved; in vLLM's wire schema their spec kind is "mamba"; the router's index ignores them."""
    from kvserve.cluster.router import PrefixIndex
    from kvserve.kv.vllm_events import STATE_SNAPSHOT_KIND, event_batch

    engine = tiny_engine(hybrid, **SMALL)
    engine.core.kv_events.open_reader()
    prompt, message = first_turn()
    chat(engine, prompt, message)
    churn(engine)
    events = [e for _, _, e in engine.core.kv_events.drain()]
    group = engine.core.layout.num_groups
    stored = [e for e in events if isinstance(e, BlockStored) and e.group_idx == group]
    removed = [e for e in events if isinstance(e, BlockRemoved) and e.group_idx == group]
    snapshots = engine.core.kv_manager.state_snapshots
    assert len(stored) == snapshots.num_saved and len(removed) >= snapshots.num_evictions > 0
    live = {e.block_hash for e in stored} - {e.block_hash for e in removed}
    assert live == {h.hex() for h in snapshots.by_hash}
    assert all(snapshots.first_slot <= e.block_id < snapshots.first_slot + snapshots.num_slots for e in stored)
    batch = event_batch(events, 0.0, "CPU", groups=[g.spec for g in engine.core.layout.groups])
    kinds = {item["kv_cache_spec_kind"] for item in batch[1] if item["type"] == "BlockStored" and item["group_idx"]}
    assert STATE_SNAPSHOT_KIND in kinds
    index = PrefixIndex()
    for event in events:
        index.apply("r0", event)
    assert set(index.holders) == {b.block_hash.hex() for b in engine.core.pool.cached[0].values()}


def test_the_tier_splits_its_size_as_the_pool_does():
    """split_for_state_snapshots: the snapshots' share of the tier is their share of the pool's bytes, at least 4
    snapshots where that takes at most half; none when 4 do not fit in half."""
    from kvserve.kv.offload.config import KVOffloadConfig, split_for_state_snapshots

    config = KVOffloadConfig(size_bytes=1000)
    kv, state = split_for_state_snapshots(config, 300, 100, 10)
    assert (kv.size_bytes, state.size_bytes) == (750, 250)
    kv, state = split_for_state_snapshots(config, 10_000, 10, 50)
    assert (kv.size_bytes, state.size_bytes) == (800, 200)  # 4 snapshots: 200 bytes, though the share is 1
    assert split_for_state_snapshots(config, 10_000, 10, 200) == (config, None)


def test_a_hybrid_prompt_batch_through_the_tier_keeps_every_slot_and_block(hybrid):
    """Requests sharing a system prompt on a small pool with a host tier, preempted and restored: greedy ids equal cold
    runs, and every block, state slot and snapshot slot is accounted for after every step (check_invariants)."""
    engine = tiny_engine(
        hybrid, max_num_batched_tokens=16, num_gpu_blocks_override=25, max_num_seqs=4, kv_offloading_size="64MiB"
    )
    system = prompts(1, seed=13)[0][:26]
    batch = [system + p[1:30] for p in prompts(6, seed=14)]
    got = run(engine, batch, GREEDY)
    again = run(engine, batch[:2], GREEDY)
    for ids, out in zip(batch + batch[:2], got + again):
        assert list(out.outputs[0].token_ids) == cold_run(hybrid, ids)
    assert torch.tensor([o.num_cached_tokens for o in again]).min() > 0


def test_prompt_cache_retention_keeps_the_snapshots_in_the_disk_tier(hybrid, tmp_path):
    """prompt_cache_retention on a hybrid model: the request's state snapshots (its prompt's and its reply's last)
    are retained in the state tier with its blocks (their records' times set ahead, which eviction passes over)."""
    import time

    from kvserve import SamplingParams

    engine = tiny_engine(hybrid, **SMALL, kv_offloading_size="64MiB", kv_offloading_path=str(tmp_path))
    prompt, _ = first_turn()
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, prompt_cache_retention_s=3600.0)
    run(engine, [prompt], params)
    engine.core.offload.flush()
    engine.core.state_offload.flush()
    engine.core.close()
    records = state_records(tmp_path)
    retained = [r for r in records if r.stat().st_mtime > time.time() + 3000]
    snapshots = engine.core.kv_manager.state_snapshots
    assert len(records) >= 2 and len(retained) == len(records) == len(snapshots)
