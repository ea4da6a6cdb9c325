"""What the engine core reports of itself and of each request: immutable values, safe to hand to any thread."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.kv.offload.tier import OffloadStats


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of what the engine is doing, for metrics and diagnosis."""

    num_running: int
    num_waiting: int
    num_blocks: int
    num_free_blocks: int
    block_size: int
    kv_cache_usage: float  # referenced blocks / usable blocks (not the null block; cached-but-free count as free)
    prefix_cache_queries_tokens: int
    prefix_cache_hits_tokens: int
    prefix_cache_hit_rate: float  # over the last 1,000 lookups
    num_preemptions: int
    prompt_tokens_total: int  # prompt tokens computed (cache hits excluded; recomputes included)
    generation_tokens_total: int
    # Speculative decoding (vLLM's names): drafts verified, tokens drafted in them, drafted tokens accepted.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()  # [i]: drafts accepted at draft position i
    # Steps by their tokens (vLLM's iteration_tokens_total): counts per ITERATION_TOKEN_BUCKETS bound, then +Inf.
    iteration_tokens_counts: tuple[int, ...] = ()
    iteration_tokens_sum: int = 0
    # The KV offload tier (None: no tier). External prefix cache, vLLM's names: prompt tokens looked up past the pool's
    # hits, and of them restored from the tier.
    offload: OffloadStats | None = None
    # Looked-up prompt tokens that missed because the pool had evicted their blocks shortly before (doctor's evidence
    # that an offload tier, or a larger pool, would have kept them).
    prefix_cache_evicted_misses_tokens: int = 0
    external_prefix_cache_queries_tokens: int = 0
    external_prefix_cache_hits_tokens: int = 0
    # Pinned prefixes (Anthropic's cache_control, kv/pins.py): live now (prefixes, distinct blocks), and since start
    # (pins made, expired, displaced by newer ones over the budget, refused as larger than the budget).
    kv_pinned_prefixes: int = 0
    kv_pinned_blocks: int = 0
    # A hybrid model's state layers (kv/state.py): sequence slots held and snapshots kept now; snapshots saved,
    # restored into a request's slot (prefix hits) and overwritten (LRU) since start.
    state_slots_used: int = 0
    state_snapshots: int = 0
    state_snapshots_saved: int = 0
    state_snapshots_restored: int = 0
    state_snapshots_evicted: int = 0
    kv_pins_created: int = 0
    kv_pins_expired: int = 0
    kv_pins_displaced: int = 0
    kv_pins_refused: int = 0
    kv_pins_tenant_capped: int = 0
    kv_retention_capped: int = 0  # tier records a prompt_cache_retention asked for past its budgets
    # Requests by why their prefix hit stopped short of the prompt (kv/misses.py MISS_REASONS), since start.
    prefix_cache_miss_reasons: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """Timestamps (time.monotonic) of one sequence's life, for latency metrics."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_preemptions: int


# The step-size histogram's bucket bounds (vLLM's iteration_tokens_total); the counts live in EngineStats.
ITERATION_TOKEN_BUCKETS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
