"""Which replica serves a request: round robin, least loaded, or the one whose prefix cache already holds the
longest run of the request's KV blocks (prefix aware), balanced against load.

Why precise, not guessed: the router computes the request's chained block hashes with the engines' own
function (kvserve.kv.hashing: same block size, algorithm and `cache_salt` key), and its index is fed by each
replica's KV events (BlockStored / BlockRemoved / AllBlocksCleared), so "replica r holds block h" is what the
engine reported, not an estimate from characters (as SGLang's approximate radix tree or a character-level
router would have it; llm-d's precise prefix scorer is the model).

The rule (prefix_aware), after SGLang's cache_aware policy:
1. Load is a replica's running + waiting requests. If the replica with the longest match is busier than the
   least-loaded one by more than `balance_abs` requests and by more than `balance_rel` times, the system is
   imbalanced: the request goes to the least-loaded replica (reason "imbalanced").
2. Otherwise the longest match wins (reason "prefix_hit"); ties go to the less loaded, then the lower KV usage.
3. No replica holds even the first block: the least-loaded replica, ties broken by KV usage, then round robin
   (reason "no_prefix_hit"), which spreads new prefixes over the replicas instead of piling them on one.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvserve.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvserve.kv.hashing import BlockHasher, salt_key

ROUTER_POLICIES = ("prefix_aware", "least_loaded", "round_robin")
DEFAULT_BALANCE_ABS = 8  # requests: below this gap, cache locality always wins
DEFAULT_BALANCE_REL = 1.5  # and the busier replica must carry 1.5x the lighter one's load
MAX_CACHE_KEYS = 65536  # prompt_cache_key -> replica entries kept (least recently used dropped)


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """What a replica reports about its load (from its EngineStats)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0

    @property
    def requests(self) -> int:
        return self.num_running + self.num_waiting


@dataclass(frozen=True, slots=True)
class RouteDecision:
    replica: str
    reason: str  # prefix_hit | imbalanced | no_prefix_hit | least_loaded | round_robin
    matched_blocks: int  # of the request's full blocks, how many the chosen replica holds (prefix_aware only)


@dataclass(slots=True)
class PrefixIndex:
    """Block hash (hex, as in KV events) -> the replicas whose prefix cache holds it."""

    holders: dict[str, set[str]] = field(default_factory=dict)
    blocks_of: dict[str, set[str]] = field(default_factory=dict)  # replica -> its hashes, to forget it at once

    def apply(self, replica: str, event: KVEvent) -> None:
        """One of `replica`'s KV events; events that are not about the prefix cache are ignored, and so are an offload
        tier's (a medium of their own): the index is of what each replica's pool holds. A shared disk tier holds the
        same blocks for every replica, so it cannot tell them apart (docs/KV_OFFLOAD.md, "Replicas"). Of a model with
        several KV cache groups, the index follows group 0's blocks (a full-attention group where the model has one:
        each prefix's whole chain, kv/groups.py); the other groups' events are ignored."""
        if isinstance(event, (BlockStored, BlockRemoved)) and (event.medium is not None or event.group_idx != 0):
            return
        if isinstance(event, BlockStored):
            self.holders.setdefault(event.block_hash, set()).add(replica)
            self.blocks_of.setdefault(replica, set()).add(event.block_hash)
        elif isinstance(event, BlockRemoved):
            self._remove(replica, event.block_hash)
            self.blocks_of.get(replica, set()).discard(event.block_hash)
        elif isinstance(event, AllBlocksCleared):
            self.forget(replica)

    def forget(self, replica: str) -> None:
        """Drop everything `replica` held (it was cleared, died or left)."""
        for block_hash in self.blocks_of.pop(replica, set()):
            self._remove(replica, block_hash)

    def replace(self, replica: str, block_hashes: Iterable[str]) -> None:
        """Set what `replica` holds to exactly `block_hashes` (a resync after lost events)."""
        self.forget(replica)
        for block_hash in block_hashes:
            self.holders.setdefault(block_hash, set()).add(replica)
            self.blocks_of.setdefault(replica, set()).add(block_hash)

    def matched_blocks(self, block_hashes: Sequence[str], replica: str) -> int:
        """How many of the leading `block_hashes` `replica` holds, stopping at the first it lacks: only a
        leading run is a prefix hit."""
        count = 0
        for block_hash in block_hashes:
            if replica not in self.holders.get(block_hash, ()):
                break
            count += 1
        return count

    def num_blocks(self, replica: str) -> int:
        return len(self.blocks_of.get(replica, ()))

    def _remove(self, replica: str, block_hash: str) -> None:
        replicas = self.holders.get(block_hash)
        if replicas is not None:
            replicas.discard(replica)
            if not replicas:
                del self.holders[block_hash]


class RequestHasher:
    """The chained hashes of a prompt's full blocks, exactly as each engine's KV manager computes them."""

    def __init__(self, block_size: int, hash_algo: str = "sha256") -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._hasher = BlockHasher(hash_algo)

    def block_hashes(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[str]:
        """Hex hashes of the full blocks an engine could serve from its cache: those among all tokens but the
        last (whose logits must always be computed), as the engine's lookup does."""
        num_tokens = len(token_ids) - 1
        hashes = self._hasher.extend(
            lambda start, end: token_ids[start:end], num_tokens, self.block_size, [], salt_key(cache_salt)
        )
        return [h.hex() for h in hashes]


class Router:
    """Chooses a replica per request under one policy; `index` is fed with the replicas' KV events."""

    def __init__(
        self,
        policy: str,
        hasher: RequestHasher,
        balance_abs: int = DEFAULT_BALANCE_ABS,
        balance_rel: float = DEFAULT_BALANCE_REL,
    ) -> None:
        if policy not in ROUTER_POLICIES:
            raise ValueError(f"--router must be one of {', '.join(ROUTER_POLICIES)}, got {policy!r}")
        if balance_abs < 0 or balance_rel < 1.0:
            raise ValueError(f"balance thresholds must be >= 0 and >= 1.0, got {balance_abs} and {balance_rel}")
        self.policy = policy
        self.hasher = hasher
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.index = PrefixIndex()
        self._turn = itertools.count()
        # prompt_cache_key (and the salt it is scoped by) -> the replica its requests went to, the last MAX_CACHE_KEYS
        self.cache_keys: OrderedDict[tuple[str | None, str], str] = OrderedDict()

    def choose(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None,
        loads: Mapping[str, ReplicaLoad],
        cache_key: str | None = None,
    ) -> RouteDecision:
        """The replica for a request with these prompt tokens, among the healthy replicas in `loads`. A request with
        a `cache_key` (OpenAI's prompt_cache_key) goes where that key's requests went, while that replica is up and
        not out of balance with the lightest (the same rule as a prefix hit's), under every policy; the choice made
        otherwise becomes the key's."""
        if not loads:
            raise RuntimeError("no healthy replica to route to")
        if cache_key is None:
            return self._choose(token_ids, cache_salt, loads)
        scope = (cache_salt, cache_key)
        kept = self.cache_keys.get(scope)
        if kept is not None and kept in loads:
            lightest = self._least_loaded(sorted(loads), loads)
            if not self._imbalanced(loads[kept].requests, loads[lightest].requests):
                self.cache_keys.move_to_end(scope)
                matched = self.index.matched_blocks(self.hasher.block_hashes(token_ids, cache_salt), kept)
                return RouteDecision(kept, "prompt_cache_key", matched)
        decision = self._choose(token_ids, cache_salt, loads)
        self.cache_keys[scope] = decision.replica
        self.cache_keys.move_to_end(scope)
        while len(self.cache_keys) > MAX_CACHE_KEYS:
            self.cache_keys.popitem(last=False)
        return decision

    def _choose(
        self, token_ids: Sequence[int], cache_salt: str | None, loads: Mapping[str, ReplicaLoad]
    ) -> RouteDecision:
        replicas = sorted(loads)
        if self.policy == "round_robin":
            return RouteDecision(replicas[next(self._turn) % len(replicas)], "round_robin", 0)
        if self.policy == "least_loaded":
            return RouteDecision(self._least_loaded(replicas, loads), "least_loaded", 0)
        hashes = self.hasher.block_hashes(token_ids, cache_salt)
        matched = {r: self.index.matched_blocks(hashes, r) for r in replicas}
        lightest = self._least_loaded(replicas, loads)
        best = min(replicas, key=lambda r: (-matched[r], loads[r].requests, loads[r].kv_cache_usage, r))
        if matched[best] == 0:
            return RouteDecision(lightest, "no_prefix_hit", matched[lightest])
        if self._imbalanced(loads[best].requests, loads[lightest].requests):
            return RouteDecision(lightest, "imbalanced", matched[lightest])
        return RouteDecision(best, "prefix_hit", matched[best])

    def forget(self, replicas: Iterable[str]) -> None:
        for replica in replicas:
            self.index.forget(replica)

    def _imbalanced(self, busy: int, light: int) -> bool:
        return busy - light > self.balance_abs and busy > light * self.balance_rel

    def _least_loaded(self, replicas: list[str], loads: Mapping[str, ReplicaLoad]) -> str:
        """Fewest requests, then lowest KV usage; among equals, taking turns."""
        key = {r: (loads[r].requests, loads[r].kv_cache_usage) for r in replicas}
        lowest = min(key.values())
        tied = [r for r in replicas if key[r] == lowest]
        return tied[next(self._turn) % len(tied)]
