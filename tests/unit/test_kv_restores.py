"""Restores from the offload tier and the scheduler's queue (kv/offload/connector.py, engine/scheduler.py), with a fake
tier whose copies end when the test says: a restore that is done gives its blocks back at the next step, whoever
waits before its request in the queue.

Found by the differential fuzzer (seed 2096, a disk tier under pool pressure): the head of the queue could not be
admitted because the restores of requests behind it held blocks, and those restores were released only when their
requests were reached, which the refused head never let happen: nothing computed again (a deadlock)."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import SimpleNamespace

from kv_pin_support import Params

from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.scheduler import Scheduler
from kvserve.kv.block import TierBlock
from kvserve.kv.hashing import BlockHasher
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.offload.connector import OffloadConnector, RestoreCostModel
from kvserve.kv.pool import BlockPool

BS = 4


@dataclass
class FakeTier:
    """An OffloadingManager holding the blocks of `held` (group 0 hashes); each restore's copy ends when the test sets
    its future."""

    held: set[bytes] = field(default_factory=set)
    loads: list[Future[int]] = field(default_factory=list)
    readable: bool = True
    retains: bool = False

    def lookup(self, keys: list[tuple[int, bytes]]) -> int:
        n = 0
        for _, block_hash in keys:
            if block_hash not in self.held:
                break
            n += 1
        return n

    def prepare_load(self, blocks: list[TierBlock], cancelled: threading.Event) -> Future[int]:
        future: Future[int] = Future()
        future.blocks = len(blocks)  # type: ignore[attr-defined]
        self.loads.append(future)
        return future

    def complete_load(self, blocks: list[TierBlock]) -> None: ...

    def prepare_store(self, blocks: list[TierBlock]) -> None: ...

    def retain(self, keys: list[tuple[int, bytes]], until: float) -> None: ...

    def take_events(self) -> list[object]:
        return []


def hashes_of(tokens: list[int]) -> list[bytes]:
    return BlockHasher().extend(lambda a, b: tokens[a:b], len(tokens), BS, [])


def test_a_done_restore_behind_a_refused_request_gives_its_blocks_back():
    a = Request("a", list(range(1000, 1040)), Params())  # 10 blocks, its first 2 in the tier
    b = Request("b", list(range(2000, 2020)), Params())  # 5 blocks, its first 2 in the tier
    tier = FakeTier(held={*hashes_of(a.prompt_token_ids)[:2], *hashes_of(b.prompt_token_ids)[:2]})
    kv = KVCacheManager(BlockPool(11 + 1), BS)
    connector = OffloadConnector(kv, tier, RestoreCostModel(True, lambda: None))  # type: ignore[arg-type]
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, offload=connector)
    sched.add(a)
    sched.add(b)
    assert sched.schedule().is_empty  # both restores start; neither is done
    assert set(connector.loads) == {"a", "b"}
    for future in tier.loads:
        future.set_result(future.blocks)  # type: ignore[attr-defined]
    for _ in range(3):  # a needs 10 blocks: 11 usable less b's restore's 2, until b's restore gives them back
        out = sched.schedule()
        if out.scheduled:
            break
    assert [s.request.request_id for s in out.scheduled][:1] == ["a"]
    assert a.status is RequestStatus.RUNNING and a.num_restored_tokens == 8


class EndsBetweenLooks:
    """An orphaned restore whose copy ends right after the first time it is asked whether it is done."""

    def __init__(self) -> None:
        self.asked = 0

    def done(self) -> bool:
        self.asked += 1
        return self.asked > 1


def test_an_orphaned_restore_ending_while_it_is_reaped_is_finished_later_never_dropped():
    """reap_orphan_loads asked each load twice whether it was done (once to finish it, once to keep it): a copy that
    ended between the two looks was neither, so its blocks stayed referenced with no holder (the fuzzer's seed 30435,
    a disk tier under load, caught it as 'ref_cnt 1 but 0 holders')."""
    load = EndsBetweenLooks()
    finished: list[object] = []
    connector = SimpleNamespace(orphan_loads=[load], finish_load=finished.append)
    OffloadConnector.reap_orphan_loads(connector)  # type: ignore[arg-type]
    assert connector.orphan_loads == [load] and not finished  # not done at its one look: kept for the next step
    OffloadConnector.reap_orphan_loads(connector)  # type: ignore[arg-type]
    assert finished == [load] and connector.orphan_loads == []
