"""Pinned prefixes (kv/pins.py, Anthropic's cache_control): a pinned prefix survives pool pressure that evicts an
unpinned one, lives its TTL from its last use on an injected clock and no longer, never serves another cache salt,
stays within its budget, holds a sliding group's window only, and is dropped with the prefix cache. Pressure is
counted in hits, never timed; the pool and the references are checked whole after every scenario."""

from __future__ import annotations

from kv_pin_support import BS, flood, make, serve_request

from kvserve.engine.core import check_kv_invariants
from kvserve.kv.manager import KVCacheManager


def serve(kv: KVCacheManager, rid: str, tokens: list[int], pin: int = 0, ttl: float = 300.0, salt=None) -> int:
    """A request admitted, computed and finished (pinning `pin` tokens as it finishes): its hit tokens."""
    return serve_request(kv, rid, tokens, pin, ttl, salt).hit_tokens


PROMPT = list(range(1000, 1000 + 8 * BS + 5))  # 8 whole blocks and a bit


def test_a_pinned_prefix_survives_pressure_that_evicts_an_unpinned_one():
    _, kv, _ = make()
    serve(kv, "a", PROMPT)
    flood(kv)
    assert serve(kv, "a2", PROMPT) == 0  # unpinned: evicted
    serve(kv, "b", PROMPT, pin=8 * BS)
    flood(kv)
    assert serve(kv, "b2", PROMPT) == 8 * BS  # pinned: every block of the prefix served
    assert kv.pins.stats.created == 1 and kv.pins.num_pinned_tokens == 8 * BS


def test_a_pin_lives_its_ttl_from_its_last_use():
    _, kv, clock = make()
    serve(kv, "a", PROMPT, pin=4 * BS, ttl=300)
    clock.now = 299
    assert serve(kv, "hit", PROMPT[: 6 * BS]) >= 4 * BS  # a hit on the pinned prefix refreshes it: expires at 599
    clock.now = 598
    kv.expire_pins()
    assert len(kv.pins.pins) == 1
    clock.now = 599
    assert kv.expire_pins() == 1 and not kv.pins.pins and kv.pins.stats.expired == 1
    check_kv_invariants(kv)
    flood(kv)
    assert serve(kv, "late", PROMPT) == 0  # expired, then evicted like any block


def test_a_pin_never_serves_another_salt():
    _, kv, _ = make()
    serve(kv, "a", PROMPT, pin=8 * BS, salt="tenant-a")
    flood(kv)
    assert serve(kv, "b", PROMPT, salt="tenant-b") == 0
    assert serve(kv, "a2", PROMPT, salt="tenant-a") == 8 * BS


def test_pins_stay_within_their_budget():
    """Distinct blocks are counted; a new pin displaces the least recently used ones; one larger than the budget
    alone is refused."""
    _, kv, _ = make(budget=6)
    serve(kv, "a", PROMPT, pin=8 * BS)  # 8 blocks > 6: refused, counted
    assert not kv.pins.pins and kv.pins.stats.refused == 1
    serve(kv, "b", PROMPT, pin=4 * BS)  # 4 blocks fit
    assert kv.pins.num_pinned_blocks == 4
    serve(kv, "c", PROMPT, pin=6 * BS)  # a longer pin of the same prefix: 2 more distinct blocks, 6 in all
    assert kv.pins.num_pinned_blocks == 6 and kv.pins.num_pinned_refs == 10
    other = list(range(50, 50 + 2 * BS))
    serve(kv, "b2", PROMPT, pin=4 * BS)  # b's pin is used again: c's is now the least recently used
    serve(kv, "d", other, pin=2 * BS)  # 2 more would make 8 > 6: c goes (its 2 blocks of its own), b stays
    assert kv.pins.stats.displaced == 1 and kv.pins.num_pinned_blocks == 6 and len(kv.pins.pins) == 2
    flood(kv)
    assert serve(kv, "again", PROMPT[: 5 * BS]) == 4 * BS  # b's prefix is still pinned, after pressure


def test_a_sliding_group_pins_the_window_before_the_prefix_end():
    """Full attention + a 32-token window: the pin holds all 8 full-attention blocks and the 2 window blocks of the
    sliding group before the prefix's end, and a hit after pressure serves the whole prefix."""
    _, kv, _ = make(num_blocks=40, windows=[None, 32])
    serve(kv, "a", PROMPT, pin=8 * BS)
    assert kv.pins.num_pinned_refs == 8 + 2
    flood(kv, rounds=6)
    assert serve(kv, "a2", PROMPT) == 8 * BS


def test_dropping_the_prefix_cache_drops_the_pins():
    pool, kv, _ = make()
    serve(kv, "a", PROMPT, pin=8 * BS)
    kv.reset_prefix_cache()
    assert not kv.pins.pins and pool.num_free_blocks == pool.num_usable_blocks
    check_kv_invariants(kv)


def test_pins_yield_to_a_request_that_could_not_fit_otherwise():
    """A pin never starves a live request: one that needs more blocks than the pins leave gets them (the least
    recently used pin released), where it would otherwise wait for ever."""
    _, kv, _ = make()  # 24 blocks
    serve(kv, "a", PROMPT, pin=8 * BS)
    assert kv.pins.num_pinned_blocks == 8
    big = [9000 + i for i in range(20 * BS)]  # 20 blocks: more than the 16 the pin leaves
    assert serve(kv, "big", big) == 0
    assert not kv.pins.pins and kv.pins.stats.displaced == 1


def test_one_tenants_pins_never_displace_another_tenant_holding_less():
    """Max-min fairness under the pin budget: tenant b pinning more than the budget leaves displaces b's own older pins
    while a holds less than b, never a's; b's responses count only b's own displaced pins (a's existence is not b's
    business)."""
    _, kv, _ = make(num_blocks=48, budget=12)
    serve(kv, "a", [100 + i for i in range(4 * BS + 1)], pin=4 * BS, salt="tenant-a")
    outcomes = []
    for n in range(4):  # 4 blocks each: b holds 8 with room, then displaces its own
        r = serve_request(kv, f"b{n}", [2000 + 100 * n + i for i in range(4 * BS + 1)], pin=4 * BS, salt="tenant-b")
        assert r.hit_tokens == 0
        outcomes.append(kv.pins.stats.displaced)
    assert outcomes == [0, 0, 1, 2]
    assert serve(kv, "a2", [100 + i for i in range(4 * BS + 1)], salt="tenant-a") == 4 * BS  # a's pin survived
    tenants = {p.tenant for p in kv.pins.pins.values()}
    assert len(tenants) == 2 and kv.pins.num_pinned_blocks <= 12


def test_a_tenants_pin_budget_displaces_its_own_pins_and_is_counted():
    """--max-pinned-kv-fraction-per-tenant: a tenant's new pin past its share displaces its own least recently used
    pins (counted as tenant_capped); a pin larger than the share alone is refused, counted too."""
    layout_pool, kv, _ = make(num_blocks=48, budget=24)
    kv.pins.tenant_budget = 8
    serve(kv, "b0", [2000 + i for i in range(4 * BS + 1)], pin=4 * BS, salt="b")
    serve(kv, "b1", [3000 + i for i in range(4 * BS + 1)], pin=4 * BS, salt="b")
    assert kv.pins.stats.tenant_capped == 0 and len(kv.pins.pins) == 2
    serve(kv, "b2", [4000 + i for i in range(4 * BS + 1)], pin=4 * BS, salt="b")
    assert len(kv.pins.pins) == 2 and kv.pins.stats.tenant_capped == 1
    serve(kv, "big", [5000 + i for i in range(9 * BS + 1)], pin=9 * BS, salt="b")
    assert kv.pins.stats.refused == 1 and kv.pins.stats.tenant_capped == 2
    check_kv_invariants(kv)


def test_a_hit_keeps_its_first_and_last_pins_recent_and_earlier_turns_go_first():
    """A chat pins its system prompt, then each turn's end (full attention + a 32-token window: each pin holds its own
    two window blocks). A later turn hits all three; a new pin past the budget then displaces the earlier turn's pin,
    whose full-attention blocks the newest pin holds anyway, not the system prompt's (other conversations hit it) nor
    the newest (the next turn hits it). Moving every pin along the hit to the front made them as recent as the newest,
    and the system prompt's pin went first."""
    _, kv, _ = make(num_blocks=60, windows=[None, 32], budget=14)
    for rid, blocks in [("system", 2), ("turn1", 4), ("turn2", 6)]:
        serve(kv, rid, PROMPT, pin=blocks * BS)
    assert kv.pins.num_pinned_blocks == 12  # 6 full-attention blocks, 2 window blocks per pin
    assert serve(kv, "turn3", PROMPT) == 8 * BS
    serve(kv, "other", [7000 + i for i in range(2 * BS + 1)], pin=2 * BS)  # 4 more blocks: 16 > 14
    assert sorted(p.num_tokens for p in kv.pins.pins.values()) == [2 * BS, 2 * BS, 6 * BS]
    assert kv.pins.stats.displaced == 1
    check_kv_invariants(kv)


def test_pins_another_pin_extends_go_before_a_conversations_newest():
    """Two conversations, each pinning its system prompt (4 blocks) and then its newest turn (6 blocks), a 32-token
    window (each pin holds its own two window blocks): 10 blocks each, over a budget of 17. B's newest pin displaces
    the system prompts' pins, which the newest pins extend (they keep only window blocks), and both newest pins stay:
    A's next turn still hits all of its history. Least recently used alone released A's system pin and then A's newest,
    and A recomputed everything (bench prompt-cache's oldest agent on Gemma 3)."""
    _, kv, _ = make(num_blocks=80, windows=[None, 32], budget=17)
    chats = {name: [base + i for i in range(6 * BS + 5)] for name, base in (("a", 1000), ("b", 5000))}
    for name, tokens in chats.items():
        serve(kv, f"{name}-system", tokens[: 4 * BS + 1], pin=4 * BS)
        serve(kv, f"{name}-turn", tokens, pin=6 * BS)
    assert sorted(p.num_tokens for p in kv.pins.pins.values()) == [6 * BS, 6 * BS]
    assert kv.pins.num_pinned_blocks == 16
    flood(kv)
    assert serve(kv, "a-next", chats["a"] + [9] * BS) == 6 * BS
    check_kv_invariants(kv)
