"""What the pin and miss-reason tests (test_kv_pins.py, test_kv_misses.py) share: a KV manager on a small pool with an
injected clock, and a request admitted, computed and finished as the scheduler does it."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.engine.core import check_kv_invariants
from kvserve.engine.request import Request
from kvserve.kv.groups import make_kv_cache_layout
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.misses import PrefixMiss
from kvserve.kv.pool import BlockPool
from kvserve.sampling_params import KVPin

BS = 16


@dataclass
class Params:
    """The fields of SamplingParams the KV manager reads."""

    seed: int | None = None
    prompt_logprobs: int | None = None
    kv_pins: tuple[KVPin, ...] = field(default_factory=tuple)


@dataclass
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def make(
    num_blocks: int = 24, windows: list[int | None] | None = None, budget: int | None = None
) -> tuple[BlockPool, KVCacheManager, Clock]:
    """`num_blocks` usable blocks of BS tokens (plus the null block), the layers' `windows` (None: full attention), a
    pin budget (None: half the pool), all on one injected clock."""
    layout = make_kv_cache_layout(windows or [None])
    clock = Clock()
    pool = BlockPool(num_blocks + 1, num_groups=layout.num_groups, clock=clock)
    return pool, KVCacheManager(pool, BS, layout=layout, max_pinned_blocks=budget), clock


@dataclass(frozen=True, slots=True)
class Served:
    hit_tokens: int
    miss: PrefixMiss | None


def serve_request(
    kv: KVCacheManager, rid: str, tokens: list[int], pin: int = 0, ttl: float = 300.0, salt: str | None = None
) -> Served:
    """Admit, compute and finish a request as the scheduler does (pinning `pin` tokens as it finishes); its hit and
    why the hit stopped. The pool and every reference are checked afterwards."""
    r = Request(rid, tokens, Params(), cache_salt=salt)
    hit, num_hit = kv.get_computed_blocks(r)
    miss = kv.classify_miss(r, num_hit)
    assert kv.allocate_slots(r, r.num_tokens - num_hit, hit)
    r.num_computed_tokens = r.num_tokens
    if pin:
        kv.pin_prefix(r, [KVPin(pin, ttl)])
    kv.forget(r)
    check_kv_invariants(kv)
    return Served(num_hit, miss)


def flood(kv: KVCacheManager, rounds: int = 4) -> None:
    """Other users' prompts (12 blocks each), enough to cycle every unpinned block of a small pool."""
    for n in range(rounds):
        serve_request(kv, f"flood{n}", [5000 + 1000 * n + i for i in range(12 * BS)])
