"""Block tables are padded with the null block, which no request ever holds: a kernel that read past a
sequence's table would see no one's K/V (they were padded with block 0, a real, allocatable block)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvserve.attention.metadata import AttentionMetadata
from kvserve.capacity import NULL_BLOCK_ID
from kvserve.engine.request import Request
from kvserve.engine.runner import ModelRunner
from kvserve.engine.scheduler import Scheduler
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.pool import BlockPool

BS = 4
CPU = torch.device("cpu")


@dataclass
class Params:
    seed: int | None = None
    prompt_logprobs: int | None = None


class RecordingModel:
    """Stands in for the model: records what the runner feeds it and returns zeros."""

    num_logits = 8

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], AttentionMetadata]] = []

    def __call__(
        self, ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta: AttentionMetadata, state=None
    ):
        self.calls.append((ids.tolist(), meta))
        return torch.zeros(len(ids), 4)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return torch.zeros(len(hidden), self.num_logits)


def test_metadata_pads_with_the_null_block() -> None:
    meta = AttentionMetadata.build([[3, 1, 2], [5]], [10, 3], [10, 3], BS, CPU)
    assert meta.block_tables.tolist() == [[3, 1, 2], [5, NULL_BLOCK_ID, NULL_BLOCK_ID]]


def test_the_runner_pads_a_mixed_batch_with_a_block_no_request_holds() -> None:
    pool = BlockPool(17)
    kv = KVCacheManager(pool, BS)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=48)
    long, short = Request("long", list(range(30)), Params()), Request("short", [100, 101], Params())
    sched.add(long)
    sched.add(short)
    model = RecordingModel()
    ModelRunner(model, [], kv, BS, CPU).execute(sched.schedule())  # type: ignore[arg-type]
    ((ids, meta),) = model.calls  # one KV cache group: one metadata for every layer
    assert ids == list(range(30)) + [100, 101]
    held = {b.block_id for r in (long, short) for b in kv.group_tables(r.request_id)[0]}
    assert NULL_BLOCK_ID not in held and len(held) == 8 + 1
    assert meta.block_tables[1, 1:].tolist() == [NULL_BLOCK_ID] * 7
    assert pool.null_block.ref_cnt == 0 and not pool.null_block.in_free_queue


def test_metadata_from_table_tails_equals_metadata_from_whole_tables() -> None:
    """A sliding group's tables sent as (leading null entries, the ids after them) give the same tensors as the whole
    tables; a table shorter than its sequence's context is refused, not read past."""
    whole = [[NULL_BLOCK_ID, NULL_BLOCK_ID, 7, 4], [9], [NULL_BLOCK_ID, 2, 6]]
    seq_lens, query_lens = [15, 3, 10], [1, 3, 6]
    want = AttentionMetadata.build(whole, seq_lens, query_lens, BS, CPU)
    leads = [next(i for i, b in enumerate(t) if b != NULL_BLOCK_ID) for t in whole]
    tails = [t[lead:] for t, lead in zip(whole, leads, strict=True)]
    got = AttentionMetadata.build(tails, seq_lens, query_lens, BS, CPU, leading_nulls=leads)
    for name in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.seq_lens_cpu == want.seq_lens_cpu and got.query_lens_cpu == want.query_lens_cpu
    # Each new position's slot, by hand: block id x 4 + offset (positions 14; 0-2; 4-9).
    assert got.slot_mapping.tolist() == [4 * 4 + 2, 36, 37, 38, 8, 9, 10, 11, 24, 25]
    with pytest.raises(IndexError):
        AttentionMetadata.build([[3]], [9], [2], BS, CPU)
