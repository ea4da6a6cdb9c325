"""Scheduler + KV manager driven without a model: budgets, chunking, preemption and the pool invariant."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from kvserve.capacity import longest_fitting, request_fits
from kvserve.engine.core import check_kv_invariants
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.sampler import SampledToken
from kvserve.engine.scheduler import Scheduler
from kvserve.kv.groups import make_kv_cache_layout
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.pool import BlockPool


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


def make(
    num_blocks=16,
    block_size=4,
    max_seqs=4,
    budget=32,
    max_len=48,
    caching=True,
    reserve=False,
    windows=(None,),
    long=0,
    break_even=0,
):
    """A scheduler over a pool of num_blocks usable blocks (plus the null block), with the KV cache groups of layers
    whose sliding windows are `windows` (None: full attention; the default is one full-attention group), and
    --long-prefill-token-threshold `long` (chunks scaled by the attention break-even `break_even`)."""
    layout = make_kv_cache_layout(windows)
    pool = BlockPool(num_blocks + 1, enable_caching=caching, num_groups=layout.num_groups)
    kv = KVCacheManager(pool, block_size, reserve_tokens=max_len if reserve else 0, layout=layout)
    sched = Scheduler(
        kv, max_seqs, budget, max_len, long_prefill_token_threshold=long, attention_break_even_tokens=break_even
    )
    return sched, pool, kv


def req(rid: str, n: int, max_tokens: int = 8, base: int = 0) -> Request:
    return Request(rid, [base + i for i in range(n)], Params(max_tokens=max_tokens))


def num_unfinished(sched: Scheduler) -> int:
    """Requests the scheduler still holds (waiting or running): the tests run until there are none."""
    return len(sched.waiting) + len(sched.running)


def fake_step(sched: Scheduler) -> list[Request]:
    """Run one step with a fake model that emits token 7 (the scheduler's update_from_output appends it and ends a
    request at max_tokens or max-model-len); returns requests that finished."""
    out = sched.schedule()
    sched.update_from_output(out, sevens(out))
    return [s.request for s in out.scheduled if s.request.is_finished]


def sevens(out) -> dict[str, list[SampledToken]]:
    """Token 7 for every request of `out` whose step completes its sequence (the only ones the runner samples)."""
    return {s.request.request_id: [SampledToken(7, None, None, None)] for s in out.scheduled if s.completes_sequence}


def check(sched: Scheduler, pool: BlockPool, kv: KVCacheManager) -> None:
    """The engine's own invariant check (free + referenced == usable; references == holders in every group)."""
    assert kv.pool is pool
    check_kv_invariants(kv, sched.offload)
    for r in sched.running:
        assert kv.num_tokens_held(r) >= r.num_computed_tokens


def test_chunked_prefill_respects_budget_and_mixes_decodes():
    sched, pool, kv = make(num_blocks=64, budget=10)
    a = req("a", 3, max_tokens=5)
    sched.add(a)
    fake_step(sched)  # a: prefill 3, samples
    b = req("b", 25, base=100)
    sched.add(b)
    out = sched.schedule()
    assert [(s.request.request_id, s.num_tokens) for s in out.scheduled] == [("a", 1), ("b", 9)]
    assert out.num_tokens <= 10 and not out.scheduled[1].completes_sequence
    sched.update_from_output(out, sevens(out))
    assert b.num_computed_tokens == 9 and kv.num_blocks_held(b) == 3
    check(sched, pool, kv)


def test_preemption_frees_newest_and_it_resumes():
    sched, pool, kv = make(num_blocks=6, block_size=4, budget=64, max_len=24)
    a, b = req("a", 10, max_tokens=8), req("b", 10, max_tokens=8, base=50)
    sched.add(a)
    sched.add(b)
    finished = []
    for _ in range(200):
        finished += fake_step(sched)
        check(sched, pool, kv)
        if not num_unfinished(sched):
            break
    assert {r.request_id for r in finished} == {"a", "b"}
    assert sched.num_preemptions >= 1 and b.num_preemptions >= 1 and a.num_preemptions == 0
    assert len(a.output_token_ids) == len(b.output_token_ids) == 8
    assert pool.num_free_blocks == pool.num_usable_blocks


def test_prefix_hit_shares_full_blocks_but_not_the_last_token():
    sched, pool, kv = make(num_blocks=32, block_size=4, budget=64)
    a = req("a", 10, max_tokens=30)
    sched.add(a)
    fake_step(sched)
    b = req("b", 8, max_tokens=2)  # same first 8 tokens: two full blocks, but the last token is recomputed
    sched.add(b)
    out = sched.schedule()
    sb = [s for s in out.scheduled if s.request is b][0]
    assert sb.start == 4 and sb.num_tokens == 4 and b.num_cached_tokens == 4
    assert kv.group_tables("b")[0][0] is kv.group_tables("a")[0][0] and kv.group_tables("a")[0][0].ref_cnt == 2
    sched.update_from_output(out, sevens(out))
    check(sched, pool, kv)


def test_without_chunked_prefill_a_prompt_longer_than_a_step_does_not_block_the_queue():
    """#43 item 13: a prompt that no step's budget can hold never runs; before, it stopped every request behind it
    (the engine refuses such prompts at add_request, see tests/models/test_engine_config.py; this is the backstop)."""
    layout = make_kv_cache_layout((None,))
    pool = BlockPool(33, num_groups=layout.num_groups)
    kv = KVCacheManager(pool, 4, layout=layout)
    sched = Scheduler(kv, 4, 8, 48, enable_chunked_prefill=False)
    sched.add(req("long", 20))
    sched.add(req("short", 5, base=100))
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["short"]
    assert [r.request_id for r in sched.waiting] == ["long"]
    check(sched, pool, kv)


def test_salted_request_gets_no_hit():
    sched, pool, kv = make(num_blocks=32, block_size=4, budget=64)
    a = req("a", 10, max_tokens=30)
    sched.add(a)
    fake_step(sched)
    b = req("b", 10)
    b.cache_salt = "tenant-2"
    assert kv.get_computed_blocks(b) == ([[]], 0)


def test_abort_and_double_finish_keep_pool_whole():
    sched, pool, kv = make()
    a = req("a", 9)
    sched.add(a)
    fake_step(sched)
    sched.finish(a, RequestStatus.FINISHED_ABORTED)
    sched.finish(a, RequestStatus.FINISHED_ABORTED)
    kv.free(req("unknown", 3))
    check(sched, pool, kv)
    assert pool.num_free_blocks == pool.num_usable_blocks


def test_a_chat_history_outlives_other_users_out_of_window_blocks():
    """#42: with a sliding group, most of a long prompt's blocks leave the window mid-request. User a's finished turn
    (full-attention blocks and last window) must survive two other users' turns in a pool that holds a's history plus
    their windows: the pool evicts their out-of-window blocks first, so a's next turn hits its whole history (under
    LRU alone it hit nothing here, and needed a pool of 56 blocks instead of 44 to hit all of it)."""

    def run(r: Request) -> None:
        sched.add(r)
        while num_unfinished(sched):
            fake_step(sched)
            check(sched, pool, kv)

    sched, pool, kv = make(num_blocks=44, budget=16, max_len=64, windows=(None, 8))
    run(req("a", 40, max_tokens=1))
    run(req("b", 40, max_tokens=1, base=1000))
    run(req("c", 40, max_tokens=1, base=2000))
    assert kv.get_computed_blocks(req("a2", 48, max_tokens=1))[1] == 40


def test_reserving_max_model_len_takes_every_block_at_admission_and_returns_them():
    # 14 blocks of 4 tokens, max-model-len 16: each request reserves 4 blocks, so 3 fit however short they are.
    sched, pool, kv = make(num_blocks=14, block_size=4, max_seqs=8, budget=64, max_len=16, reserve=True)
    requests = [req(f"r{i}", 3, max_tokens=2 + i, base=100 * i) for i in range(5)]
    for r in requests:
        sched.add(r)
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["r0", "r1", "r2"]  # r3 waits: 2 blocks are left
    assert all(kv.num_blocks_held(r) == 4 for r in requests[:3]) and pool.num_free_blocks == 2
    sched.update_from_output(out, sevens(out))
    check(sched, pool, kv)
    finished = []
    for _ in range(100):
        held = {r.request_id: kv.num_blocks_held(r) for r in sched.running}
        assert all(n == 4 for n in held.values())  # growth within the reservation allocates nothing
        assert len(held) <= 3
        finished += fake_step(sched)
        check(sched, pool, kv)
        if not num_unfinished(sched):
            break
    assert sorted(r.request_id for r in finished) == [f"r{i}" for i in range(5)]
    assert sched.num_preemptions == 0 and pool.num_free_blocks == pool.num_usable_blocks and not kv.requests


def test_reservation_counts_prefix_hit_blocks():
    sched, pool, kv = make(num_blocks=32, block_size=4, budget=64, max_len=24, reserve=True)
    a = req("a", 10, max_tokens=30)
    sched.add(a)
    fake_step(sched)
    b = req("b", 9, max_tokens=2)  # shares a's first two full blocks
    sched.add(b)
    out = sched.schedule()
    assert b.num_cached_tokens == 8 and kv.group_tables("b")[0][0] is kv.group_tables("a")[0][0]
    assert kv.num_blocks_held(a) == kv.num_blocks_held(b) == 6  # 24 tokens, hit blocks included
    assert pool.num_free_blocks == 32 - 6 - 4
    sched.update_from_output(out, sevens(out))
    check(sched, pool, kv)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 12), st.integers(0, 3)),
        st.tuples(st.just("step")),
        st.tuples(st.just("abort"), st.integers(0, 50)),
    ),
    min_size=1,
    max_size=60,
)


# KV cache layouts: one full-attention group; a full group and a sliding one (window 5: hits need the 2 blocks
# before their end); Gemma-like, one full and two sliding groups; every layer windowed (one sliding group).
LAYOUTS = [(None,), (None, 5), (7, None, 7), (6, 6)]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=ops,
    num_blocks=st.integers(12, 40),
    budget=st.integers(4, 64),
    caching=st.booleans(),
    reserve=st.booleans(),
    windows=st.sampled_from(LAYOUTS),
    long=st.sampled_from([0, 0, 3, 8]),
    break_even=st.sampled_from([0, 8]),
)
# A preempted request re-admitted through a prefix hit once counted its cached tokens twice and never fit.
@example(
    ops=[("add", 13, 9, 0), ("add", 22, 4, 1)],
    num_blocks=12,
    budget=5,
    caching=True,
    reserve=False,
    windows=(None,),
    long=0,
    break_even=0,
)
def test_random_add_step_abort_keeps_the_pool_whole(
    ops, num_blocks, budget, caching, reserve, windows, long, break_even
):
    """Any sequence of adds, steps and aborts keeps the pool whole and ends every request, with long prompts yielding
    (--long-prefill-token-threshold `long`) or not."""
    block_size = 4
    assume(not reserve or windows == (None,))  # a contiguous cache's emulation is the uniform layout's
    layout = make_kv_cache_layout(windows)
    usable = num_blocks
    # The longest request (with a prefill chunk of the whole budget) must fit the pool, as the engine checks at start.
    max_len = longest_fitting(lambda n: request_fits(usable, n, block_size, layout, budget), min(48, usable * 4))
    assume(max_len >= 8)
    sched, pool, kv = make(
        num_blocks=num_blocks,
        block_size=block_size,
        max_seqs=5,
        budget=budget,
        max_len=max_len,
        caching=caching,
        reserve=reserve,
        windows=windows,
        long=long,
        break_even=break_even,
    )
    live: list[Request] = []
    count = 0
    for op in ops:
        if op[0] == "add":
            _, n, max_tokens, family = op
            n = min(n, max_len - 1)
            r = Request(f"r{count}", [family * 1000 + i for i in range(n)], Params(max_tokens=max_tokens))
            count += 1
            sched.add(r)
            live.append(r)
        elif op[0] == "step":
            for r in fake_step(sched):
                live.remove(r)
        elif live:
            victim = live.pop(op[1] % len(live))
            sched.finish(victim, RequestStatus.FINISHED_ABORTED)
        check(sched, pool, kv)
        placed = [r.request_id for r in sched.running] + [r.request_id for r in sched.waiting]
        assert len(placed) == len(set(placed)) == len(live)
    for _ in range(2000):
        if not num_unfinished(sched):
            break
        for r in fake_step(sched):
            live.remove(r)
        check(sched, pool, kv)
    assert not live and not num_unfinished(sched)
    assert pool.num_free_blocks == pool.num_usable_blocks
    assert not kv.requests


def make_long(threshold=8, max_long=1, budget=32, max_seqs=4, num_blocks=64, partial=None):
    """A scheduler with --long-prefill-token-threshold `threshold` and --max-long-partial-prefills `max_long`."""
    layout = make_kv_cache_layout((None,))
    pool = BlockPool(num_blocks + 1, num_groups=layout.num_groups)
    kv = KVCacheManager(pool, 4, layout=layout)
    sched = Scheduler(
        kv,
        max_seqs,
        budget,
        256,
        max_num_partial_prefills=partial,
        long_prefill_token_threshold=threshold,
        max_long_partial_prefills=max_long,
    )
    return sched, pool, kv


def step_shape(sched: Scheduler) -> list[tuple[str, int]]:
    """One fake step; the (request id, tokens) it scheduled."""
    out = sched.schedule()
    sched.update_from_output(out, sevens(out))
    return [(s.request.request_id, s.num_tokens) for s in out.scheduled]


def test_a_long_prompt_alone_takes_the_threshold_a_step_and_the_last_chunk_whole():
    """vLLM's --long-prefill-token-threshold: a prompt with more tokens left than the threshold computes at most that
    many a step, though the budget holds more; alone, it gets a chunk every step."""
    sched, pool, kv = make_long(threshold=8, budget=32)
    sched.add(req("long", 30, max_tokens=2))
    assert [step_shape(sched) for _ in range(5)] == [[("long", 8)]] * 3 + [[("long", 6)], [("long", 1)]]
    check(sched, pool, kv)


def test_a_short_request_runs_alone_during_a_long_prefill_until_it_has_had_the_threshold():
    """The CPU rule: a short request arriving during a long prefill is admitted the next step without the long chunk,
    and its decodes run without it until the others have had `threshold` tokens since the long prompt's last chunk;
    then the long prompt gets a chunk beside them (never starved). Before, the long prompt's chunk took each step's
    budget first (a 32-token chat sent during a 13k-token prefill answered in 19x its time alone, #55)."""
    sched, pool, kv = make_long(threshold=8, budget=32)
    sched.add(req("long", 60, max_tokens=1))
    assert step_shape(sched) == [("long", 8)]
    sched.add(req("short", 5, max_tokens=20, base=500))
    assert step_shape(sched) == [("short", 5)]  # 5 tokens owed to nobody yet
    assert step_shape(sched) == [("short", 1)]
    assert step_shape(sched) == [("short", 1)]
    assert step_shape(sched) == [("short", 1)]  # 8 tokens since the long chunk: its turn next
    assert step_shape(sched) == [("long", 8), ("short", 1)]
    assert step_shape(sched) == [("short", 1)]
    check(sched, pool, kv)


def test_without_a_threshold_the_running_prefill_takes_the_budget_first():
    """--long-prefill-token-threshold 0 (CUDA's default, vLLM's with one partial prefill): as before."""
    sched, pool, kv = make_long(threshold=0, budget=16)
    sched.add(req("long", 60, max_tokens=1))
    assert step_shape(sched) == [("long", 16)]
    sched.add(req("short", 5, max_tokens=4, base=500))
    assert step_shape(sched) == [("long", 16)]  # the short one waits for the whole prefill
    check(sched, pool, kv)


def test_a_second_long_prompt_waits_for_the_first_and_a_short_one_passes_it():
    """--max-long-partial-prefills 1: the second long prompt stays queued while the first is prefilled; a short
    prompt behind it is admitted. With 2 both long prompts go (in the same long turn)."""
    sched, pool, kv = make_long(threshold=8, budget=32)
    for r in (req("a", 40, max_tokens=1), req("b", 40, max_tokens=1, base=100), req("c", 4, base=200)):
        sched.add(r)
    assert step_shape(sched) == [("a", 8), ("c", 4)]
    assert [r.request_id for r in sched.waiting] == ["b"]
    sched, pool, kv = make_long(threshold=8, max_long=2, budget=32)
    for r in (req("a", 40, max_tokens=1), req("b", 40, max_tokens=1, base=100), req("c", 4, base=200)):
        sched.add(r)
    assert step_shape(sched) == [("a", 8), ("b", 8), ("c", 4)]
    check(sched, pool, kv)


def test_a_long_prompt_runs_when_what_it_yields_to_cannot():
    """A yielding long prompt never leaves a step empty: with --max-num-seqs 1 held by it, the waiting short request
    cannot be admitted, so the long prompt's chunk runs (a step without it would run nothing, for ever)."""
    sched, pool, kv = make_long(threshold=8, budget=32, max_seqs=1)
    sched.add(req("long", 30, max_tokens=1))
    assert step_shape(sched) == [("long", 8)]
    sched.add(req("short", 4, base=500))
    assert step_shape(sched) == [("long", 8)]
    assert step_shape(sched) == [("long", 8)]
    check(sched, pool, kv)


def test_a_prompt_mostly_cached_is_not_long():
    """Long means tokens left to compute: a long prompt whose prefix is cached (an agent's next turn) runs at once,
    even with another long prompt being prefilled."""
    sched, pool, kv = make_long(threshold=8, budget=32)
    sched.add(req("first", 40, max_tokens=1))
    while num_unfinished(sched):
        step_shape(sched)
    sched.add(req("other", 60, max_tokens=1, base=1000))
    assert step_shape(sched) == [("other", 8)]
    sched.add(req("next-turn", 44, max_tokens=1))  # 40 tokens cached: 4 to compute (+ the last block's)
    assert step_shape(sched) == [("next-turn", 4)]
    check(sched, pool, kv)


def test_a_long_prompts_chunks_shrink_as_its_context_grows():
    """With the model's attention break-even K (the context at which a token's attention costs as much as its matrix
    products), a long prompt's chunk at context P is threshold x K / (K + P), so each step costs about the same, and at
    least a block; the prompt stays long (yielding) while more than one chunk is left."""
    layout = make_kv_cache_layout((None,))
    pool = BlockPool(129, num_groups=layout.num_groups)
    kv = KVCacheManager(pool, 4, layout=layout)
    sched = Scheduler(kv, 4, 64, 512, long_prefill_token_threshold=16, attention_break_even_tokens=32)
    sched.add(req("long", 120, max_tokens=1))
    chunks = [n for _ in range(9) for _, n in step_shape(sched)]
    assert chunks == [16, 10, 8, 7, 7, 6, 5, 5, 5]  # 16 x 32 // (32 + P) at P = 0, 16, 26, 34, 41, 48, 54, 59, 64
    sched.add(req("short", 4, max_tokens=3, base=900))  # the long prompt yields to it
    assert step_shape(sched) == [("short", 4)]
    while num_unfinished(sched):
        chunks += [n for rid, n in step_shape(sched) if rid == "long"]
    # each step's cost alike, but never less than a block (4 tokens)
    assert chunks[9:] == [5] + [4] * 11 + [2] and sum(chunks) == 120
    check(sched, pool, kv)


def test_the_attention_break_even_of_a_models_shape():
    """Qwen2.5-Coder-0.5B's shape: 24 layers of 896 wide, 14 heads / 2 KV heads of 64, MLP 4864: 2 x 357.8M FLOPs of
    matrix products a token against 4 x 14 x 64 x 24 a key of context: 8,320. Sliding-window layers do not grow with
    the context (Gemma 3: 3 of 18 count); none that attends to it all: 0."""
    from kvserve.model.config import ModelConfig

    shape = dict(family="qwen2", vocab_size=151936, hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2)
    shape |= dict(head_dim=64, intermediate_size=4864, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=32768)
    shape |= dict(tie_word_embeddings=True, bos_token_id=None, eos_token_ids=[151645])
    assert ModelConfig(**shape).attention_break_even_tokens == 8320
    windows = [None if i % 6 == 5 else 512 for i in range(24)]
    assert ModelConfig(**shape, sliding_windows=windows).attention_break_even_tokens == 8320 * 6
    assert ModelConfig(**shape, sliding_windows=[512] * 24).attention_break_even_tokens == 0
