"""Prefix-cache queries are counted once per request, at its first admission: not at every lookup while it waits
for blocks, not again when it is re-admitted after preemption. Counting every lookup inflated
kvserve:prefix_cache_queries_total and skewed the hit-rate gauge and `kvserve doctor` exactly under pressure."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.sampler import SampledToken
from kvserve.engine.scheduler import Scheduler
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.pool import BlockPool

BS = 4


@dataclass
class Params:
    """The fields of SamplingParams that the scheduler and manager read."""

    seed: int | None = None
    prompt_logprobs: int | None = None
    max_tokens: int = 8
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    kv_pins: tuple[()] = ()  # prompt prefixes to pin as the request finishes (none here)
    prompt_cache_retention_s: float = 0.0


def make(usable_blocks: int, max_len: int = 48) -> tuple[Scheduler, KVCacheManager]:
    kv = KVCacheManager(BlockPool(usable_blocks + 1), BS)
    return Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=max_len), kv


def req(rid: str, tokens: list[int], max_tokens: int) -> Request:
    return Request(rid, tokens, Params(max_tokens=max_tokens))


def step(sched: Scheduler) -> None:
    """One step with a fake model that emits token 7; update_from_output finishes requests at max_tokens."""
    out = sched.schedule()
    tokens = {s.request.request_id: [SampledToken(7, None, None, None)] for s in out.scheduled if s.completes_sequence}
    sched.update_from_output(out, tokens)


def run_to_end(sched: Scheduler, on_step=lambda: None) -> None:
    for _ in range(500):
        if not sched.waiting and not sched.running:
            return
        step(sched)
        on_step()
    raise AssertionError("requests never finished")


def test_a_lookup_alone_counts_nothing() -> None:
    sched, kv = make(usable_blocks=16)
    r = req("a", list(range(12)), max_tokens=1)
    for _ in range(3):
        kv.get_computed_blocks(r)
    assert kv.prefix_stats.queries_total == 0 and not kv.prefix_stats.recent


def test_a_request_that_retries_admission_counts_once() -> None:
    # 8 usable blocks of 4 tokens. `a` (20 tokens, 5 blocks, growing to 6) runs; `b` (20 tokens, its first block
    # shared with a, so 4 more blocks) cannot be admitted until a finishes, and looks the cache up at every step.
    sched, kv = make(usable_blocks=8)
    a = req("a", list(range(20)), max_tokens=4)
    b = req("b", list(range(4)) + list(range(100, 116)), max_tokens=2)
    sched.add(a)
    step(sched)
    sched.add(b)
    retries = 0

    def count_retries() -> None:
        nonlocal retries
        retries += b.status is RequestStatus.WAITING

    run_to_end(sched, count_retries)
    assert retries >= 2  # b was looked up (and refused) several times
    assert b.num_preemptions == 0 and a.num_preemptions == 0
    stats = kv.prefix_stats
    assert stats.queries_total == a.num_prompt_tokens + b.num_prompt_tokens == 40
    assert stats.hits_total == a.num_cached_tokens + b.num_cached_tokens == 4  # b's shared block, once
    assert len(stats.recent) == 2


def test_a_preempted_and_readmitted_request_counts_once() -> None:
    # 6 usable blocks, two requests of 10 tokens growing to 18 (5 blocks each): the newer one is preempted
    # and re-admitted later, through a lookup that may now hit its own published blocks.
    sched, kv = make(usable_blocks=6, max_len=24)
    a = req("a", list(range(10)), max_tokens=8)
    b = req("b", list(range(50, 60)), max_tokens=8)
    sched.add(a)
    sched.add(b)
    run_to_end(sched)
    assert b.num_preemptions >= 1 and sched.num_preemptions >= 1
    stats = kv.prefix_stats
    assert stats.queries_total == 20  # each prompt once, at its first admission
    assert stats.hits_total == a.num_cached_tokens + b.num_cached_tokens == 0
    assert len(stats.recent) == 2


def test_a_request_skipping_the_cache_is_not_a_query() -> None:
    """Prompt logprobs need every position's logits: no lookup happens, so none is counted (as before)."""
    sched, kv = make(usable_blocks=16)
    r = Request("p", list(range(12)), Params(max_tokens=1, prompt_logprobs=0))
    sched.add(r)
    run_to_end(sched)
    assert kv.prefix_stats.queries_total == 0
