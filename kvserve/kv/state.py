"""State slots: where a hybrid model's state layers keep each running request's state (vLLM's MambaSpec, in the
plain form this engine needs today).

Why a slot and not blocks: a state layer (LFM2's short convolution) does not keep one entry per token, as attention's
KV does; it keeps one fixed-size state per sequence, overwritten by every step. So a request holds exactly one slot
from its first scheduled step to its end, in every state layer at once (slot i of each layer's state tensor), and the
slots' bytes come out of the same KV memory budget as the blocks (engine/build.py plans both). There is one slot for
every sequence the scheduler may run at once (--max-num-seqs): a request that is admitted always finds one.

What a state cannot do that KV can: go back. A prefix hit needs the state at the hit point, so states are copied into
snapshots (StateSnapshots) at block boundaries, keyed by the chained hash of the block they end at (so cache_salt
separates them as it separates blocks): a hit is the longest prefix whose blocks are cached *and* whose last block has
a snapshot; the request's slot is filled from that snapshot before its first step. Which boundaries get one: every
step that ends on a block boundary leaves one, and the scheduler makes prefill chunks end on them (KVCacheManager.
state_chunk: at the prompt's own hit point, and each chunk that does not finish the prompt cut back to a boundary);
during decode, a request keeps only its latest boundary's (the next chat turn starts after the reply). A preempted
request gives its slot back and resumes from its longest snapshot hit, else from its first token.

Pure Python (no torch): `kvserve estimate` sizes the slots from StateSpec.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvserve.kv.events import BlockRemoved, BlockStored, KVEventBuffer
from kvserve.kv.hashing import BlockKey


@dataclass(frozen=True, slots=True)
class StateSpec:
    """One sequence's state in every state layer: a convolution keeps its last `conv_kernel - 1` inputs of
    `conv_channels` channels (LFM2: the hidden size; Qwen3.5: its q, k and v), and a linear-attention layer a matrix
    per value head, `recurrent_shape` = (value heads, key dim, value dim) (none for LFM2); `element_bytes` each."""

    num_layers: int
    conv_kernel: int
    conv_channels: int
    recurrent_shape: tuple[int, ...] = ()
    element_bytes: int = 4

    @property
    def conv_tokens(self) -> int:
        return self.conv_kernel - 1

    @property
    def recurrent_elements(self) -> int:
        n = 1
        for d in self.recurrent_shape:
            n *= d
        return n if self.recurrent_shape else 0

    @property
    def bytes_per_layer(self) -> int:
        return (self.conv_tokens * self.conv_channels + self.recurrent_elements) * self.element_bytes

    @property
    def bytes_per_slot(self) -> int:
        """One sequence's state, every state layer."""
        return self.num_layers * self.bytes_per_layer

    def describe(self) -> str:
        if not self.recurrent_shape:
            return (
                f"{self.num_layers} short-conv layers x {self.conv_tokens} tokens x {self.conv_channels} channels x "
                f"{self.element_bytes} bytes = {self.bytes_per_slot} bytes a sequence"
            )
        heads = " x ".join(map(str, self.recurrent_shape))
        return (
            f"{self.num_layers} linear-attention layers x ({self.conv_tokens} tokens x {self.conv_channels} conv "
            f"channels + {heads} recurrent) x {self.element_bytes} bytes = {self.bytes_per_slot} bytes a sequence"
        )


# The most of the KV budget sequence slots may take; state snapshots per sequence slot, and the most of the budget
# they may take (state_reservation).
SEQUENCE_BUDGET_FRACTION = 0.5
# A long prefill leaves a state snapshot every this many blocks (KVCacheManager.state_chunk); docs/MODELS.md counts
# what that costs (a state copy every 256 tokens of prefill).
SNAPSHOT_INTERVAL_BLOCKS = 16
SNAPSHOTS_PER_SEQUENCE = 4
SNAPSHOT_BUDGET_FRACTION = 0.25


@dataclass(frozen=True, slots=True)
class StateReservation:
    """What a model's state layers take out of the KV budget before its blocks are counted: a slot for each of
    `num_sequences` running sequences and `num_snapshots` snapshot slots, `bytes` in all."""

    spec: StateSpec
    num_sequences: int
    num_snapshots: int

    @property
    def num_slots(self) -> int:
        return self.num_sequences + self.num_snapshots

    @property
    def bytes(self) -> int:
        return self.num_slots * self.spec.bytes_per_slot

    def to_json(self) -> dict[str, int | str]:
        """As estimate and advise report it."""
        return {
            "num_sequences": self.num_sequences,
            "num_snapshots": self.num_snapshots,
            "bytes": self.bytes,
            "formula": self.describe(),
        }

    def describe(self) -> str:
        return (
            f"{self.num_sequences} sequence slots + {self.num_snapshots} snapshot slots x "
            f"{self.spec.bytes_per_slot} bytes = {self.bytes} bytes"
        )


def state_reservation(
    spec: StateSpec,
    max_num_seqs: int,
    budget_bytes: int | None,
    prefix_caching: bool = True,
    bytes_per_block: int | None = None,
) -> StateReservation:
    """The engine's sizing rule for state slots (estimate and serve share it): a slot for each of --max-num-seqs
    sequences, as many as SEQUENCE_BUDGET_FRACTION of the budget holds (a request waits for a free slot as it waits for
    blocks), and for prefix hits SNAPSHOTS_PER_SEQUENCE snapshots a sequence slot, or, given the pool's
    `bytes_per_block`, one for every SNAPSHOT_INTERVAL_BLOCKS blocks the rest of the budget holds where that is more
    (a conversation's cached blocks are worth a hit only with a snapshot at their end, and a server that runs 8
    sequences at once may hold the histories of hundreds), at most SNAPSHOT_BUDGET_FRACTION of the budget. LFM2-350M's
    80 KiB states in 4 GiB: 256 sequences and 1024 snapshots (100 MiB; with --max-num-seqs 8, 682 snapshots instead
    of 32); Qwen3.5-0.8B's 19.3 MiB states: 106 sequences and 53 snapshots (3 GiB), leaving 1 GiB for its attention
    layers' KV."""
    sequences = max_num_seqs
    if budget_bytes is not None:
        sequences = max(1, min(max_num_seqs, int(budget_bytes * SEQUENCE_BUDGET_FRACTION) // spec.bytes_per_slot))
    snapshots = SNAPSHOTS_PER_SEQUENCE * sequences if prefix_caching else 0
    if budget_bytes is not None:
        if prefix_caching and bytes_per_block:
            blocks = max(budget_bytes - sequences * spec.bytes_per_slot, 0) // bytes_per_block
            snapshots = max(snapshots, blocks // SNAPSHOT_INTERVAL_BLOCKS)
        snapshots = min(snapshots, int(budget_bytes * SNAPSHOT_BUDGET_FRACTION) // spec.bytes_per_slot)
    return StateReservation(spec, sequences, snapshots)


class StateSlots:
    """Hands out state slots to requests: at most one each, freed when the request lets go of its blocks."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a model with state layers needs at least one state slot, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self.held: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def slot_of(self, request_id: str) -> int | None:
        return self.held.get(request_id)

    def acquire(self, request_id: str) -> int | None:
        """The request's slot (a new one the first time); None when every slot is held by another request."""
        slot = self.held.get(request_id)
        if slot is None and self._free:
            slot = self.held[request_id] = self._free.pop()
        return slot

    def release(self, request_id: str) -> None:
        slot = self.held.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)


class StateSnapshots:
    """States at block boundaries, in slots of their own ([first_slot, first_slot + num_slots) of every state layer's
    tensor), keyed by the chained hash of the block they end at and checked against that block's content (as a pool
    block is: a hash collision never hands one request another's state); the least recently used one is overwritten
    first.

    The rule of a step (asserted by `check`): a slot the step names (a restore reads it before the forward pass, a save
    writes it after, a tier restore writes it meanwhile) is not reassigned before the step ends (`end_step`). So
    `reserve` never takes a `pending` snapshot's slot (a save or a load queued for it) nor a `named` one (a restore
    source of this step), and a named snapshot dropped meanwhile keeps its slot until the step ends. Without it, two
    reservations of one step shared a slot (both saves wrote it; with a tier, one hash's record held another's state),
    and a tier restore overwrote a slot another request of the step was about to start from.

    A snapshot reserved for a step is `pending` until the runner has saved it after that step: a request admitted in
    the same step (sharing the prefix's blocks at once) must not start from a slot not yet written. One reserved for a
    restore from the offload tier is pending and `loading` until the copy ends (reserve_for_load, loaded), which may
    take several steps (from disk, on the loader thread).

    KV events (`events`): a saved snapshot is published as a BlockStored of group `group_idx` (the one past the KV
    cache groups) whose block id is its slot, and one overwritten or dropped as a BlockRemoved (docs/KV_CACHE.md)."""

    def __init__(
        self,
        first_slot: int,
        num_slots: int,
        protected: Callable[[bytes], bool] | None = None,
        events: KVEventBuffer | None = None,
        group_idx: int = 0,
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"state snapshots need at least one slot, got {num_slots}")
        # Keys whose snapshots are never overwritten or dropped (the ends of pinned prefixes, kv/pins.py).
        self.protected: Callable[[bytes], bool] = protected or (lambda block_hash: False)
        self.first_slot = first_slot
        self.num_slots = num_slots
        self.events = events
        self.group_idx = group_idx
        self.by_hash: OrderedDict[bytes, int] = OrderedDict()
        self.keys: dict[bytes, BlockKey] = {}  # what each snapshot's block holds (hits compare it, events carry it)
        self._free = list(range(first_slot + num_slots - 1, first_slot - 1, -1))
        self.pending: set[bytes] = set()
        self.loading: set[bytes] = set()
        self.named: set[int] = set()  # slots this step reads (restore sources): not reassigned until end_step
        self._released: list[int] = []  # named slots whose snapshots were dropped: free once the step ends
        self.num_evictions = 0
        self.num_saved = 0
        self.num_restored = 0
        self.num_loaded = 0  # restored from the offload tier

    def __len__(self) -> int:
        return len(self.by_hash)

    def __contains__(self, block_hash: bytes) -> bool:
        """Whether a saved snapshot ends at this block (a pending one does not count)."""
        return block_hash in self.by_hash and block_hash not in self.pending

    def serves(self, block_hash: bytes, key: BlockKey) -> bool:
        """Whether a saved snapshot ends at the block hashed `block_hash` holding `key` (a prefix hit's question)."""
        return block_hash in self and self.keys.get(block_hash) == key

    def slot_of(self, block_hash: bytes) -> int | None:
        """The saved snapshot's slot, its place in the LRU order unchanged; None if there is none."""
        return self.by_hash[block_hash] if block_hash in self else None

    def use(self, block_hash: bytes) -> int | None:
        """The saved snapshot's slot, now the most recently used; None if there is none."""
        if block_hash not in self:
            return None
        self.by_hash.move_to_end(block_hash)
        return self.by_hash[block_hash]

    def read(self, block_hash: bytes) -> int | None:
        """The slot a restore of this step reads (`use`, and named until the step ends); None if there is none."""
        slot = self.use(block_hash)
        if slot is not None:
            self.named.add(slot)
            self.num_restored += 1
        return slot

    def _evictable(self, block_hash: bytes) -> bool:
        return (
            block_hash not in self.pending
            and self.by_hash[block_hash] not in self.named
            and not self.protected(block_hash)
        )

    def reserve(self, block_hash: bytes, key: BlockKey, lasting: bool = True) -> int | None:
        """A slot to save the state ending at `block_hash` (a block holding `key`) into: a free one, else the least
        recently used snapshot's that the step does not name (see the class). None when that snapshot exists already
        (the same tokens give the same state: nothing to save) or no slot can be taken. A snapshot not `lasting` (one
        few requests will start from) goes in as the least recently used: the next to be overwritten, unless a hit
        uses it first."""
        if block_hash in self.by_hash:
            if lasting:
                self.by_hash.move_to_end(block_hash)
            return None
        if self._free:
            slot = self._free.pop()
        else:
            evicted = next((h for h in self.by_hash if self._evictable(h)), None)
            if evicted is None:  # every snapshot is pinned, queued or read this step: this state is not saved
                return None
            slot = self._remove(evicted)
            self.num_evictions += 1
        self.by_hash[block_hash] = slot
        if not lasting:
            self.by_hash.move_to_end(block_hash, last=False)
        self.keys[block_hash] = key
        self.pending.add(block_hash)
        return slot

    def reserve_for_load(self, block_hash: bytes, key: BlockKey) -> int | None:
        """A slot for the offload tier to restore the snapshot ending at `block_hash` into (see reserve); loaded()
        says how the copy ended."""
        slot = self.reserve(block_hash, key)
        if slot is not None:
            self.loading.add(block_hash)
        return slot

    def loaded(self, block_hash: bytes, restored: bool) -> None:
        """A restore into the slot reserve_for_load gave ended: hits may start from it, or (it failed a check, or was
        cancelled) the slot holds nothing and is free again."""
        self.loading.discard(block_hash)
        if restored:
            self.num_loaded += 1
            self.saved([block_hash])
        elif block_hash in self.pending:
            self._release(self._remove(block_hash))

    def saved(self, hashes: list[bytes]) -> None:
        """The runner has written these snapshots: hits may start from them."""
        for h in hashes:
            if h in self.pending:
                self.pending.discard(h)
                self.num_saved += 1
                self._publish_stored(h)

    def end_step(self) -> None:
        """The step ran: the slots it read may be reassigned, and those whose snapshots it dropped are free."""
        self.named.clear()
        self._free.extend(self._released)
        self._released.clear()

    def _release(self, slot: int) -> None:
        (self._released if slot in self.named else self._free).append(slot)

    def _publish_stored(self, block_hash: bytes) -> None:
        if self.events is None or not self.events.enabled:
            return
        key = self.keys[block_hash]
        parent = key.parent.hex() if key.parent is not None else None
        slot = self.by_hash[block_hash]
        self.events.append(
            BlockStored(slot, block_hash.hex(), parent, key.token_ids, len(key.token_ids), group_idx=self.group_idx)
        )

    def _remove(self, block_hash: bytes, publish: bool = True) -> int:
        """Forget a snapshot; returns its slot (the caller reuses or frees it). A saved one leaves a BlockRemoved."""
        slot = self.by_hash.pop(block_hash)
        was_saved = block_hash not in self.pending
        self.pending.discard(block_hash)
        self.keys.pop(block_hash, None)
        if publish and was_saved and self.events is not None and self.events.enabled:
            self.events.append(BlockRemoved(slot, block_hash.hex(), group_idx=self.group_idx))
        return slot

    def drop(self, block_hash: bytes, publish: bool = True) -> None:
        """Forget a saved snapshot (a pinned one, or one queued for a save or a load, stays)."""
        if self.protected(block_hash) or block_hash in self.pending or block_hash not in self.by_hash:
            return
        self._release(self._remove(block_hash, publish))

    def clear(self) -> None:
        """Drop every snapshot but those of pins and of restores in flight, and forget what the step named (a failed
        step's saves never ran: their snapshots go too). The pool's AllBlocksCleared covers the events."""
        for block_hash in list(self.by_hash):
            if block_hash in self.pending and block_hash not in self.loading:
                self._release(self._remove(block_hash, publish=False))
            else:
                self.drop(block_hash, publish=False)
        self.end_step()

    def check(self) -> None:
        """The invariant: every slot is free, released at the step's end or holds one snapshot; a restore's snapshot
        is pending until it ends; no named slot is free."""
        held = list(self.by_hash.values())
        free = set(self._free)
        released = set(self._released)
        total = len(held) + len(self._free) + len(self._released)
        if len(set(held)) != len(held) or (set(held) & (free | released)) or free & released or total != self.num_slots:
            raise AssertionError(
                f"state snapshots: {len(self._free)} free + {len(self._released)} released + {len(held)} held != "
                f"{self.num_slots}"
            )
        if not self.loading <= self.pending or not self.pending <= set(self.by_hash):
            raise AssertionError("state snapshots: a loading or pending snapshot is not held")
        if self.named & free:
            raise AssertionError(f"state snapshots: slot(s) {sorted(self.named & free)} read this step are free")
