"""Cache layers composed, at the KV manager: the defects a review found where state snapshots, the offload tier's
restores, reply snapshots and pins meet within one step (issue 54's D1-D5, D7, D8). Each scenario is the smallest the
differential fuzzer (tests/fuzz) shrank its finding to, rebuilt on the manager alone; each failed before its fix.

The rule they check: a state snapshot slot named by a step's restores, saves or loads is never reassigned before the
step ends (so each save writes a slot its snapshot alone holds, and no restore reads a slot written before it runs);
a snapshot serves only the block content it was saved for; a pin is released for a live request only when that frees
blocks it needs."""

from __future__ import annotations

from kv_pin_support import BS, Params, make, serve_request

from kvserve.engine.core import check_kv_invariants
from kvserve.engine.request import Request
from kvserve.kv.groups import make_kv_cache_layout
from kvserve.kv.hashing import BlockKey
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.pool import BlockPool
from kvserve.kv.state import StateSlots, StateSnapshots

SB = 4  # the state tests' block size: small prompts cross several boundaries


def state_manager(num_snapshots: int, num_blocks: int = 64) -> KVCacheManager:
    """A manager of a hybrid model (one full-attention group beside state layers): 4 sequence slots, then
    `num_snapshots` snapshot slots."""
    layout = make_kv_cache_layout([None])
    kv = KVCacheManager(
        BlockPool(num_blocks + 1),
        SB,
        layout=layout,
        state_slots=StateSlots(4),
        state_snapshots=StateSnapshots(4, num_snapshots),
    )
    return kv


def fill_snapshots(kv: KVCacheManager, count: int) -> list[bytes]:
    """Saved snapshots of other conversations in `count` slots."""
    snapshots = kv.state_snapshots
    assert snapshots is not None
    hashes = [bytes([i + 1]) * 32 for i in range(count)]
    for h in hashes:
        assert snapshots.reserve(h, BlockKey(None, (h[0],), b"")) is not None
    snapshots.saved(hashes)
    return hashes


def request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, Params())


def prefill(kv: KVCacheManager, r: Request, hit: list | None = None, num_hit: int = 0) -> None:
    """Compute the request's prompt in chunks cut as the scheduler cuts them (KVCacheManager.state_chunk), one step
    each, then let it go."""
    r.num_computed_tokens = num_hit
    first = True
    while r.num_computed_tokens < r.num_tokens:
        n = kv.state_chunk(r, r.num_computed_tokens, r.num_tokens - r.num_computed_tokens)
        assert kv.allocate_slots(r, n, hit if first else None)
        first = False
        run_step(kv)
        r.num_computed_tokens += n
    kv.forget(r)


def run_step(kv: KVCacheManager) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The runner's side of a step: take the planned copies, then say the saves are done."""
    copies = kv.take_state_copies()
    kv.state_saves_done()
    return copies


def test_two_saves_of_one_step_never_share_a_slot():
    """D1: a chunk-end snapshot (not a snapshot point: reserved as the next to be overwritten) and another request's
    prompt-end snapshot in the same step, every slot full: the second reservation took the first's pending slot, both
    saves wrote it, and with a tier both records were stored from it (the first hash's record holding the second's
    state)."""
    kv = state_manager(num_snapshots=2)
    fill_snapshots(kv, 2)
    a = request("a", list(range(10, 50)))  # 40 tokens: a chunk of 8 ends at block 2, no snapshot point
    b = request("b", list(range(60, 69)))  # 9 tokens: a chunk of 8 ends at its hit point
    assert kv.allocate_slots(a, 8) and kv.allocate_slots(b, 8)
    _, saves = kv.take_state_copies()
    targets = [t for _, t in saves]
    assert len(saves) == 2 and len(set(targets)) == 2
    snapshots = kv.state_snapshots
    assert snapshots is not None and kv.state is not None
    for (_, target), saving in zip(saves, kv.state.saving):
        assert snapshots.by_hash[saving.block_hash] == target == saving.slot
    kv.state_saves_done()
    stored = kv.state.take_saved()  # what a tier would store: no slot under two hashes
    assert len({s.slot for s in stored}) == len(stored) == 2
    snapshots.check()


def test_a_tier_restore_never_takes_a_pending_snapshots_slot():
    """D2: a restore from the offload tier reserved the slot of a snapshot a running request saves after this step;
    the save then overwrote the restored state, which the restored hash still named."""
    kv = state_manager(num_snapshots=1)
    a = request("a", list(range(10, 19)))
    assert kv.allocate_slots(a, 8)  # a snapshot at its hit point, pending until the step ran
    snapshots = kv.state_snapshots
    assert snapshots is not None
    assert snapshots.reserve_for_load(b"\x77" * 32, BlockKey(None, (1,), b"")) is None
    (_, target), = kv.take_state_copies()[1]  # fmt: skip
    kv.state_saves_done()
    assert snapshots.slot_of(kv.req_hashes["a"][1]) == target


def test_a_tier_restore_never_overwrites_a_restore_source_of_the_same_step():
    """D3: with the host tier a restore writes its slot at once; that slot was another request's restore source of
    the same step, which the runner copies only before the forward pass: that request started from the restored
    state."""
    kv = state_manager(num_snapshots=1)
    prompt = list(range(10, 19))
    prefill(kv, request("first", prompt))
    again = request("again", prompt + [5, 6])
    hit, num_hit = kv.get_computed_blocks(again)
    assert num_hit == 8
    assert kv.allocate_slots(again, again.num_tokens - num_hit, hit)
    snapshots = kv.state_snapshots
    assert snapshots is not None
    assert kv.state is not None
    source = kv.state.restores[0][0]
    slot = snapshots.reserve_for_load(b"\x77" * 32, BlockKey(None, (1,), b""))
    assert slot != source
    snapshots.check()


def test_a_reply_never_drops_a_snapshot_it_did_not_save():
    """D8: a reply boundary whose snapshot exists already (another conversation with the same tokens saved it) was
    recorded as the reply's own; the reply's next boundary then dropped it."""
    kv = state_manager(num_snapshots=4)
    prompt = list(range(10, 15))  # 5 tokens; the reply's boundaries at 8 and 12
    other = request("other", prompt + [20, 21, 22])  # the same 8 tokens as the reply's first boundary
    assert kv.allocate_slots(other, 8)
    run_step(kv)
    other.num_computed_tokens = 8
    kv.forget(other)
    shared = kv.hashes(request("probe", prompt + [20, 21, 22]), 8)[1]
    snapshots = kv.state_snapshots
    assert snapshots is not None and shared in snapshots

    r = request("r", prompt)
    assert kv.allocate_slots(r, 5)
    run_step(kv)
    r.num_computed_tokens = 5
    for token in (20, 21, 22, 23, 24, 25, 26, 27):  # decode through the boundaries at 8 and 12
        r.output_token_ids.append(token)
        assert kv.allocate_slots(r, 1)
        run_step(kv)
        r.num_computed_tokens += 1
    assert shared in snapshots


def test_a_snapshot_serves_only_the_block_content_it_was_saved_for():
    """D7: blocks compare their whole content on a hit, snapshots compared the hash alone; a snapshot whose key is not
    the request's block's (a hash collision) is no hit."""
    kv = state_manager(num_snapshots=4)
    prompt = list(range(10, 19))
    prefill(kv, request("first", prompt))
    assert kv.get_computed_blocks(request("same", prompt + [5]))[1] == 8
    snapshots = kv.state_snapshots
    assert snapshots is not None
    block_hash = kv.hashes(request("probe", prompt), 8)[1]
    snapshots.keys[block_hash] = BlockKey(None, (999,), b"")  # another block's content under the same hash
    assert kv.get_computed_blocks(request("again", prompt + [5]))[1] == 0


def test_the_state_hit_is_one_scan_of_the_prefix():
    """D5: the longest state hit re-ran the whole hit search for every shorter candidate. With 2,048 blocks cached in a
    full-attention group, a snapshot at every one, and a sliding group that serves only the first two, a lookup asks
    each block's presence a bounded number of times (counted, not timed; it asked about 8 million times)."""
    layout = make_kv_cache_layout([None, 8])  # a full-attention group and a sliding one (a hit needs 2 blocks)
    kv = KVCacheManager(BlockPool(65, num_groups=2), SB, layout=layout, state_slots=StateSlots(1),
                        state_snapshots=StateSnapshots(1, 1))  # fmt: skip
    n = 2048
    asked = 0

    def has(group: int, index: int) -> bool:  # the sliding group holds only the first two blocks
        nonlocal asked
        asked += 1
        return group == 0 or index < 2

    assert kv.coordinator.longest_hit(n, has, lambda i: True) == 2
    assert asked <= 4 * n


def test_pins_are_released_only_when_that_frees_what_a_request_needs():
    """D4: a pinned prefix shared with a running request holds no block the pool could give; a request too large for
    the free blocks released it anyway (every step, for the refused head of the queue): pins 1 -> 0, free blocks
    unchanged. Released are only pins whose blocks only pins hold, and only as many as make the request fit."""
    _, kv, _ = make(num_blocks=24)
    prompt = list(range(1000, 1000 + 6 * BS + 5))
    serve_request(kv, "pin", prompt, pin=6 * BS)
    running = Request("running", prompt + list(range(7000, 7000 + 11 * BS)), Params())
    hit, num_hit = kv.get_computed_blocks(running)
    assert num_hit == 6 * BS and kv.allocate_slots(running, running.num_tokens - num_hit, hit)
    free = kv.pool.num_free_blocks
    big = Request("big", [9000 + i for i in range(12 * BS)], Params())
    assert free < 12
    assert not kv.allocate_slots(big, big.num_tokens)
    assert len(kv.pins.pins) == 1 and kv.pool.num_free_blocks == free
    check_kv_invariants(kv)


def test_a_pin_is_released_for_a_request_only_as_far_as_it_needs():
    """Of two pins whose blocks only pins hold, a request needing the blocks of one releases that one (the least
    recently used), not both."""
    _, kv, _ = make(num_blocks=24)
    serve_request(kv, "p1", [100 + i for i in range(6 * BS + 1)], pin=6 * BS)
    serve_request(kv, "p2", [500 + i for i in range(6 * BS + 1)], pin=6 * BS)
    assert kv.pool.num_free_blocks == 12
    big = Request("big", [9000 + i for i in range(13 * BS)], Params())
    assert kv.allocate_slots(big, big.num_tokens)
    assert list(kv.pins.pins) == [kv.req_hashes.get("p2", [b""])[-1]] or len(kv.pins.pins) == 1
    check_kv_invariants(kv)


def test_a_pin_over_the_requests_own_hit_frees_nothing_for_it():
    """The fuzzer's long run (seeds 8108, 8606, 8688, 8947): a request whose prefix hit is pinned, short of blocks,
    released that pin and counted its blocks as freed, but the request revives its own hit blocks at once, so the
    allocation that followed found the pool short and raised (the request failed with "cannot allocate"). A release
    counts only blocks the request does not take back; here none, so nothing is released and the request waits."""
    _, kv, _ = make(num_blocks=24)
    prompt = list(range(1000, 1000 + 6 * BS + 1))
    serve_request(kv, "pin", prompt, pin=6 * BS)
    filler = Request("filler", [5000 + i for i in range(kv.pool.num_free_blocks * BS)], Params())
    assert kv.allocate_slots(filler, filler.num_tokens) and kv.pool.num_free_blocks == 0
    again = Request("again", prompt + list(range(7000, 7000 + 2 * BS)), Params())
    hit, num_hit = kv.get_computed_blocks(again)
    assert num_hit == 6 * BS
    assert not kv.allocate_slots(again, again.num_tokens - num_hit, hit)  # it raised ValueError
    assert len(kv.pins.pins) == 1
    check_kv_invariants(kv)
