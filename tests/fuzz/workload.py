"""Seeded random workloads over every cache layer: what the differential fuzzer runs (tests/fuzz/runner.py).

A workload is an engine configuration and rounds of requests. Everything is drawn from one seed, so a seed is a
replayable case; `only` (request indices) keeps a subset of its requests, which is how a failure is shrunk.

What a workload can hold, each drawn with a probability (see `generate`):
- a model of each layer kind kvserve runs: uniform attention (llama), Gemma-3-like sliding windows, LFM2's short
  convolutions and Qwen3.5's Gated DeltaNet (state snapshots);
- prompts that share system prompts, repeat exactly, or continue a conversation (the previous turn's prompt, its
  reply and a new message: a chain across rounds);
- cache salts, cache_control marks with TTLs on an injected clock (advanced between steps), prompt retention,
  n > 1, stop strings, aborts mid-prefill and mid-decode;
- pools and snapshot slots small enough to force eviction, preemption and pin pressure; token budgets down to one
  block; a partial-prefill limit; a long-prefill threshold; speculative decoding (n-gram); int8 / fp8 KV;
- a host or disk offload tier, with restarts (a new engine over the same directory) and records deleted or damaged
  between rounds.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import Any

# The tiny checkpoints (tests/models/tiny_models.py) a workload runs on, one per layer kind.
VARIANTS = ("llama_gqa", "gemma3_mqa_sliding", "lfm2_hybrid", "qwen3_5_hybrid")
STATE_VARIANTS = frozenset({"lfm2_hybrid", "qwen3_5_hybrid"})
BLOCK_SIZE = 4
MAX_MODEL_LEN = 96
VOCAB = range(4, 256)  # the tiny tokenizer's ordinary ids (0-3 are pad, eos, bos, unk)
BOS = 2


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """The engine under test: EngineConfig fields (a tier's path is filled in by the runner)."""

    variant: str
    num_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_num_partial_prefills: int | None = None
    kv_cache_dtype: str = "auto"
    speculative: bool = False
    tier: str | None = None  # None, "host" or "disk"
    max_pinned_kv_fraction: float = 0.5
    long_prefill_token_threshold: int = 0  # vLLM's flag (0: off); the scheduler's long-prompt rules

    def engine_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = dict(
            num_gpu_blocks_override=self.num_blocks,
            block_size=BLOCK_SIZE,
            max_model_len=MAX_MODEL_LEN,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            max_num_partial_prefills=self.max_num_partial_prefills,
            kv_cache_dtype=self.kv_cache_dtype,
            max_pinned_kv_fraction=self.max_pinned_kv_fraction,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
        )
        if self.speculative:
            kw["speculative_config"] = {
                "method": "ngram",
                "num_speculative_tokens": 3,
                "prompt_lookup_max": 3,
                "prompt_lookup_min": 1,
                "disable_by_batch_size": 64,
                "min_acceptance_rate": 0.0,
            }
        if self.tier is not None:
            kw["kv_offloading_size"] = "4MiB"
        return kw


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of a round. Its prompt is `prefix` (a shared system prompt, or empty), then `body`; a chained
    request (`continues` = the index of an earlier round's request) starts instead with that request's prompt and
    reply, then `body` (the new message)."""

    index: int  # its place in the whole workload (what `only` keeps)
    round: int
    arrival: int  # the step of its round at which it is added
    prefix: tuple[int, ...]
    body: tuple[int, ...]
    max_tokens: int
    continues: int | None = None
    salt: str | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    pin_tokens: tuple[int, ...] = ()  # cache_control marks: prompt tokens, each pinned for `pin_ttl` seconds
    pin_ttl: float = 30.0
    retain: bool = False  # prompt_cache_retention (with a tier)
    abort_after: int | None = None  # steps after its arrival at which it is aborted (mid-prefill or mid-decode)


@dataclass(frozen=True, slots=True)
class RoundEvents:
    """What happens before a round starts: the engine restarted over the same tier directory, some tier records
    deleted or damaged, the clock moved on (pins expire)."""

    restart: bool = False
    delete_records: int = 0
    damage_records: int = 0
    advance_clock: float = 0.0


@dataclass(frozen=True, slots=True)
class Workload:
    seed: int
    settings: EngineSettings
    requests: tuple[RequestSpec, ...]
    events: tuple[RoundEvents, ...]  # one per round
    clock_step: float = 1.0  # seconds the injected clock advances each engine step

    @property
    def num_rounds(self) -> int:
        return len(self.events)

    def keep(self, only: frozenset[int] | None) -> Workload:
        """The workload with only these requests (and those their kept requests continue from)."""
        if only is None:
            return self
        needed = set(only)
        for spec in sorted(self.requests, key=lambda s: -s.index):
            if spec.index in needed and spec.continues is not None:
                needed.add(spec.continues)
        return replace(self, requests=tuple(s for s in self.requests if s.index in needed))

    def describe(self) -> str:
        s = self.settings
        tier = s.tier or "no tier"
        return (
            f"seed {self.seed}: {s.variant}, {s.num_blocks} blocks, budget {s.max_num_batched_tokens} tokens, "
            f"{s.max_num_seqs} seqs, partial {s.max_num_partial_prefills}, kv {s.kv_cache_dtype}, "
            f"{'ngram' if s.speculative else 'no spec'}, long prefill {s.long_prefill_token_threshold}, {tier}; "
            f"{len(self.requests)} requests in "
            f"{self.num_rounds} rounds"
        )


def _tokens(rng: random.Random, lo: int, hi: int) -> tuple[int, ...]:
    return tuple(rng.choice(VOCAB) for _ in range(rng.randint(lo, hi)))


def generate(seed: int, variant: str | None = None) -> Workload:
    """The workload of `seed` (its model drawn too unless `variant` is given)."""
    rng = random.Random(seed)
    variant = variant or VARIANTS[seed % len(VARIANTS)]
    stateful = variant in STATE_VARIANTS
    settings = EngineSettings(
        variant=variant,
        num_blocks=rng.choice([40, 56, 80, 160]) * (2 if variant == "gemma3_mqa_sliding" else 1),
        max_num_batched_tokens=rng.choice([BLOCK_SIZE, 7, 16, 32, 96]),
        max_num_seqs=rng.choice([1, 2, 2, 3, 4, 8]),
        max_num_partial_prefills=rng.choice([None, None, 1]),
        kv_cache_dtype=rng.choice(["auto", "auto", "auto", "int8", "fp8"]),
        speculative=not stateful and rng.random() < 0.25,
        tier=rng.choice([None, "host", "disk", "disk"] if stateful else [None, None, "host", "disk"]),
        max_pinned_kv_fraction=rng.choice([0.5, 0.5, 0.25]),
        long_prefill_token_threshold=rng.choice([0, 0, 8, 16]),
    )
    system_prompts = [(BOS, *_tokens(rng, 3, 36)) for _ in range(rng.randint(1, 3))]
    salts = [None, None, None, "tenant-a", "tenant-b"]
    num_rounds = rng.randint(2, 4)
    requests: list[RequestSpec] = []
    events: list[RoundEvents] = []
    for r in range(num_rounds):
        events.append(
            RoundEvents(
                restart=settings.tier == "disk" and r > 0 and rng.random() < 0.4,
                delete_records=rng.choice([0, 0, 0, 1, 3]) if settings.tier and r else 0,
                damage_records=rng.choice([0, 0, 0, 1, 2]) if settings.tier == "disk" and r else 0,
                advance_clock=rng.choice([0.0, 0.0, 10.0, 100.0]),
            )
        )
        earlier = [s for s in requests if s.round == r - 1 and s.abort_after is None and s.n == 1 and not s.stop]
        for _ in range(rng.randint(2, 7)):
            index = len(requests)
            max_tokens = rng.randint(1, 10)
            continues = None
            prefix: tuple[int, ...] = ()
            if earlier and rng.random() < 0.45:
                parent = rng.choice(earlier)
                continues, salt = parent.index, parent.salt
                body = _tokens(rng, 1, 6)
            else:
                salt = rng.choice(salts)
                kind = rng.random()
                if kind < 0.15 and requests:  # an exact repeat of an earlier prompt
                    twin = rng.choice(requests)
                    if twin.continues is None:
                        prefix, body, salt = twin.prefix, twin.body, twin.salt
                    else:
                        body = (BOS, *_tokens(rng, 1, 30))
                elif kind < 0.75:
                    prefix, body = rng.choice(system_prompts), _tokens(rng, 1, 24)
                else:
                    body = (BOS, *_tokens(rng, 1, 40))
            pins: tuple[int, ...] = ()
            if rng.random() < 0.3:
                pins = tuple(sorted({rng.randint(1, 48) for _ in range(rng.randint(1, 2))}))
            requests.append(
                RequestSpec(
                    index=index,
                    round=r,
                    arrival=rng.choice([0, 0, 0, 1, 2, 4, 7]),
                    prefix=prefix,
                    body=body,
                    max_tokens=max_tokens,
                    continues=continues,
                    salt=salt,
                    n=2 if rng.random() < 0.1 else 1,
                    stop=(chr(rng.choice(range(40, 120))),) if rng.random() < 0.1 else (),
                    pin_tokens=pins,
                    pin_ttl=rng.choice([5.0, 30.0, 300.0]),
                    retain=settings.tier == "disk" and rng.random() < 0.2,
                    abort_after=rng.choice([1, 2, 3, 5]) if rng.random() < 0.1 else None,
                )
            )
    return Workload(seed, settings, tuple(requests), tuple(events), clock_step=rng.choice([0.5, 1.0, 3.0]))


def spec_of(workload: Workload, index: int) -> RequestSpec:
    return next(s for s in workload.requests if s.index == index)


@dataclass(slots=True)
class Transcript:
    """What the engine under test gave each request: its prompt and each sample's ids (the reference's inputs), filled
    in round by round (a chained request's prompt needs its parent's reply)."""

    prompts: dict[int, list[int]] = field(default_factory=dict)
    replies: dict[int, list[int]] = field(default_factory=dict)

    def prompt_of(self, spec: RequestSpec) -> list[int]:
        if spec.continues is None:
            tokens = [*spec.prefix, *spec.body]
        else:
            tokens = [*self.prompts[spec.continues], *self.replies[spec.continues], *spec.body]
        return tokens[: MAX_MODEL_LEN - spec.max_tokens]
