"""The multi-round chat workload in LMCache's shape, run on several engines in one process: users with a system prompt
each and a history growing every round (the prompt, the engine's own reply, the next question), the engines taking
each request in a rotating order, so that none always goes first on a warm machine. `bench offload` and `bench
long-context` both measure it."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvserve.engine.engine import LLMEngine


@dataclass(frozen=True, slots=True)
class ChatWorkload:
    users: int
    rounds: int
    system_tokens: int
    question_tokens: int
    output_len: int


@dataclass(slots=True)
class Done:
    """One request run to its end: its TTFT, its output ids, and the prompt tokens an offload tier restored."""

    ttft_s: float
    output_ids: list[int]
    restored: int


@dataclass(slots=True)
class _Usage:
    wall_s: float = 0.0
    tokens: int = 0
    ttfts_ms: list[float] = field(default_factory=list)


def one_request(engine: LLMEngine, prompt: list[int], output_len: int, rid: str) -> Done:
    """One greedy request run to its end on its own."""
    from kvserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    start = time.perf_counter()
    engine.add_request(rid, prompt, params)
    ttft = None
    while True:
        for out in engine.step():
            if ttft is None and out.outputs[0].token_ids:
                ttft = time.perf_counter() - start
            if out.finished:
                return Done(ttft or 0.0, list(out.outputs[0].token_ids), out.num_restored_tokens)


# How long a round's end waits for an offload tier's writes (a host so busy that they take longer is reported, by the
# hit rates, as it is).
TIER_WRITES_WAIT_S = 120.0


def wait_for_tier_writes(engine: LLMEngine) -> None:
    """Wait until what the engine's offload tiers queued is stored. Why: a disk tier's writers run on idle cores only
    (DiskTier._write_loop), so on a host busy with other work the next round's restore found nothing written and the
    disk tier's hit rate came out 0.0; a chat's rounds are a user's think time apart, in which the writes are done."""
    for tier in (engine.core.offload, engine.core.state_offload):
        if tier is not None:
            tier.flush(TIER_WRITES_WAIT_S)


def multi_round_chat(
    engines: dict[str, LLMEngine],
    workload: ChatWorkload,
    rng: random.Random,
    vocab: int,
    exclude: list[int],
    bos: list[int],
) -> tuple[dict[str, dict[str, Any]], int]:
    """Round by round, user by user, every engine answers the same question on its own history (and between rounds
    the offload tiers finish their writes: wait_for_tier_writes). Per engine: TTFT
    p50/p90 (ms, every request's in `ttft_ms`), throughput (prompt + generated tokens over its wall time), and the
    share of prompt tokens served from the pool and from an offload tier; and the working set in tokens."""
    from kvserve.bench.stats import percentile
    from kvserve.bench.workload import random_token_ids

    w = workload
    user_systems = [bos + random_token_ids(rng, w.system_tokens, vocab, exclude) for _ in range(w.users)]
    histories = {name: [list(s) for s in user_systems] for name in engines}
    usage = {name: _Usage() for name in engines}
    before = {name: e.stats() for name, e in engines.items()}
    names = list(engines)
    for rnd in range(w.rounds):
        for user in range(w.users):
            question = random_token_ids(rng, w.question_tokens, vocab, exclude)
            k = (rnd * w.users + user) % len(names)
            for name in names[k:] + names[:k]:
                prompt = histories[name][user] + question
                start = time.perf_counter()
                done = one_request(engines[name], prompt, w.output_len, f"chat-{rnd}-{user}")
                u = usage[name]
                u.wall_s += time.perf_counter() - start
                u.tokens += len(prompt) + len(done.output_ids)
                u.ttfts_ms.append(1e3 * done.ttft_s)
                histories[name][user] = prompt + done.output_ids
        for engine in engines.values():  # users think between rounds: the tiers finish writing what they queued
            wait_for_tier_writes(engine)
    rows: dict[str, dict[str, Any]] = {}
    for name, engine in engines.items():
        s, b, u = engine.stats(), before[name], usage[name]
        queries = s.prefix_cache_queries_tokens - b.prefix_cache_queries_tokens
        tier_hits = s.external_prefix_cache_hits_tokens - b.external_prefix_cache_hits_tokens
        pool_hits = s.prefix_cache_hits_tokens - b.prefix_cache_hits_tokens - tier_hits
        rows[name] = {
            "ttft_ms_p50": percentile(u.ttfts_ms, 50),
            "ttft_ms_p90": percentile(u.ttfts_ms, 90),
            "throughput_tok_s": u.tokens / u.wall_s,
            "pool_hit_rate": pool_hits / queries if queries else 0.0,
            "tier_hit_rate": tier_hits / queries if queries else 0.0,
            "ttft_ms": u.ttfts_ms,
        }
    return rows, sum(len(h) for h in histories[names[0]])
