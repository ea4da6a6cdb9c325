"""Why a prefix hit stopped short (kv/misses.py): each reason produced on purpose and classified as such, at the
first token the cache did not serve: never seen, evicted (with the pressure since), a pin that expired, a prompt that
diverged at a given token, another salt, a sliding window, a tier record refused; none when all was served."""

from __future__ import annotations

from kv_pin_support import BS, Params, flood, make, serve_request

from kvserve.engine.request import Request
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.misses import PrefixMiss


def serve(kv: KVCacheManager, rid: str, tokens: list[int], salt: str | None = None, pin: int = 0) -> PrefixMiss | None:
    """A request admitted, computed and finished (pinning `pin` tokens as it finishes): why its hit stopped."""
    return serve_request(kv, rid, tokens, pin, 60.0, salt).miss


PROMPT = list(range(1000, 1000 + 6 * BS + 3))


def test_a_cold_prompt_was_never_seen_and_a_full_hit_has_no_miss():
    _, kv, _ = make()
    assert serve(kv, "a", PROMPT) == PrefixMiss("never_seen", 0)
    assert serve(kv, "b", PROMPT) is None  # every whole block before the last token served


def test_an_evicted_prefix_says_when_and_under_what_pressure():
    """A 24-block pool: `a` leaves 6 cached blocks; the first flood prompt (12 blocks) takes the 18 free blocks without
    a hash; the second evicts `a`'s 6 and 6 of the first's; the third and fourth evict 12 each: 30 evictions, of which
    `a`'s first block's is the 6th (blocks are evicted in the order they were freed: a request frees its last block
    first, so the first is freed, and evicted, last of its six), leaving 24 after it."""
    pool, kv, clock = make()
    serve(kv, "a", PROMPT)
    clock.now = 5.0
    flood(kv)
    assert pool.num_evictions == 30
    clock.now = 7.5
    miss = serve(kv, "b", PROMPT)
    assert miss == PrefixMiss("evicted", 0, evicted_ago_s=2.5, evicted_blocks_since=24)


def test_a_prompt_that_diverged_names_the_token():
    _, kv, _ = make()
    serve(kv, "a", PROMPT)
    changed = list(PROMPT)
    changed[2 * BS + 5] = 1
    miss = serve(kv, "b", changed)
    assert miss == PrefixMiss("diverged", 2 * BS, diverged_at_token=2 * BS + 5)


def test_another_salt_is_told_apart_from_never_seen():
    _, kv, _ = make()
    serve(kv, "a", PROMPT, salt="tenant-a")
    assert serve(kv, "b", PROMPT, salt="tenant-b") == PrefixMiss("different_cache_salt", 0)
    assert serve(kv, "c", PROMPT) == PrefixMiss("different_cache_salt", 0)  # unsalted, seen salted
    assert serve(kv, "d", PROMPT, salt="tenant-a") is None


def test_an_expired_pin_is_named_when_its_blocks_were_evicted():
    _, kv, clock = make()
    serve(kv, "a", PROMPT, pin=6 * BS)
    clock.now = 61.0
    assert kv.expire_pins() == 1
    flood(kv)
    miss = serve(kv, "b", PROMPT)
    assert miss is not None and miss.reason == "pin_expired" and miss.at_token == 0


def test_a_sliding_window_that_cut_the_hit_short():
    """Full attention + a 32-token window on 16 blocks. `a` is prefilled in chunks, so its sliding group gives back
    blocks 0-1 mid-request; another request reuses them (the spent queue goes first). A prompt sharing `a`'s first
    three blocks finds them all in the full group, but not the window before them in the sliding group."""
    _, kv, _ = make(num_blocks=16, windows=[None, 32])  # a: 7 blocks a group
    a = Request("a", PROMPT, Params())
    for end in (2 * BS, 4 * BS, len(PROMPT)):  # three chunks: the third allocation frees blocks 0-1 as spent
        assert kv.allocate_slots(a, end - a.num_computed_tokens)
        a.num_computed_tokens = end
    kv.forget(a)
    # 6 blocks: the 4 unhashed free ones (a's partial blocks, the pool's unused), then the 2 spent ones
    assert serve(kv, "other", [9000 + i for i in range(3 * BS)]) == PrefixMiss("never_seen", 0)
    shared = PROMPT[: 3 * BS] + [5] * (2 * BS)
    miss = serve(kv, "b", shared)
    assert miss == PrefixMiss("outside_sliding_window", 0)


def test_a_refused_tier_record_is_named():
    _, kv, _ = make()
    r = Request("a", PROMPT, Params())
    hashes = kv.hashes(r, r.num_tokens - 1)
    assert kv.classify_miss(r, 0, frozenset({hashes[0]})) == PrefixMiss("tier_record_failed_check", 0)


def test_a_model_of_sliding_layers_only_is_never_cut_by_a_window_it_does_not_know():
    """Without a full-attention group there is nothing to compare the windows with: a cold prompt was never seen."""
    _, kv, _ = make(num_blocks=40, windows=[32])
    assert serve(kv, "a", PROMPT) == PrefixMiss("never_seen", 0)
