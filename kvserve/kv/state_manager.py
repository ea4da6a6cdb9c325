"""StateManager: a hybrid model's state layers as the KV manager sees them (vLLM's MambaManager, for this engine's
snapshot scheme): the slot each scheduled request holds, the snapshots prefix hits start from, and the copies a step
makes between them.

A prompt of 13 tokens with 4-token blocks (|) and a budget of 8 tokens a step:

    tokens   0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12
    step 1   computes 0-7    -> after it, its slot copied into a snapshot of block 1 (a chunk end: overwritten first)
    step 2   computes 8-11   -> the chunk is cut at the prompt's hit point (12): a snapshot of block 2
    step 3   computes 12     -> samples; no boundary

The same prompt sent again hits 3 blocks: before its first step, block 2's snapshot is copied into its slot, and it
computes token 12 only. The rule that keeps this right when several requests reserve, restore and save in one step
lives in StateSnapshots (kv/state.py): a slot the step names is not reassigned before the step ends.

Which boundaries get a snapshot (`chunk` cuts prefill chunks there): the next multiple of SNAPSHOT_INTERVAL_BLOCKS
blocks (a long prompt leaves one every interval: a later prompt sharing only its start, a system prompt, hits at the
last one before they part), the prompt's own hit point (its last block boundary before its last token: the same
prompt sent again hits there), each cache_control mark's last block boundary (its pin needs a state to restore), and
in the reply, the latest boundary only (the next chat turn starts after the reply; each new one takes the previous
one's slot). A step that ends elsewhere on a boundary (a chunk the token budget cut) leaves one too, reserved as the
least recently used: the first to be overwritten.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvserve.kv.hashing import BlockKey, KeyedRequest, RequestKeys
from kvserve.kv.state import SNAPSHOT_INTERVAL_BLOCKS, StateSlots, StateSnapshots


class StateRequest(KeyedRequest, Protocol):
    """What the state manager reads of a request (the engine's Request satisfies it)."""

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def cache_marks(self) -> tuple[int, ...]: ...


@dataclass(frozen=True, slots=True)
class SnapshotSaved:
    """A snapshot a step saved: its slot, the hash and content key of the block it ends at, and whether it lies in
    the prompt (what the offload tier stores as the step ends; a reply's latest is stored as its request lets go)."""

    slot: int
    block_hash: bytes
    key: BlockKey
    in_prompt: bool


class StateManager:
    """Slots, snapshots and each step's copies (see the module docstring). `snapshots` None: no prefix caching (no
    state hits)."""

    def __init__(
        self, slots: StateSlots, snapshots: StateSnapshots | None, block_size: int, caching: bool = True
    ) -> None:
        self.slots = slots
        self.snapshots = snapshots if caching else None
        self.block_size = block_size
        self.interval_blocks = SNAPSHOT_INTERVAL_BLOCKS
        # The copies around the next step (slot pairs (from, to)): restores before it, saves after it, and the
        # snapshots those saves write (pending until the step ran).
        self.restores: list[tuple[int, int]] = []
        self.saves: list[tuple[int, int]] = []
        self.save_records: list[SnapshotSaved] = []
        self.saving: list[SnapshotSaved] = []  # those the runner took for the step now running
        self.saved: list[SnapshotSaved] = []  # saved by the last step (until take_saved or the next step's end)
        self.reply_snapshot: dict[str, bytes] = {}  # each request's reply's latest snapshot (replaced by the next)

    # ---- slots -------------------------------------------------------------------------------------------

    def acquire(self, request_id: str) -> bool:
        return self.slots.acquire(request_id) is not None

    def slot(self, request_id: str) -> int:
        slot = self.slots.slot_of(request_id)
        if slot is None:
            raise KeyError(f"request {request_id} holds no state slot")
        return slot

    def release(self, request_id: str) -> None:
        self.slots.release(request_id)

    def forget(self, request_id: str) -> None:
        self.reply_snapshot.pop(request_id, None)

    # ---- hits --------------------------------------------------------------------------------------------

    def serves(self, block_hash: bytes, key: BlockKey) -> bool:
        """Whether a prefix hit may end at this block: a saved snapshot of this very content ends there."""
        return self.snapshots is not None and self.snapshots.serves(block_hash, key)

    def keep(self, block_hash: bytes) -> None:
        """A waiting request would start from this snapshot: the most recently used now (keep_state_hit)."""
        if self.snapshots is not None:
            self.snapshots.use(block_hash)

    def reply_tail(self, request_id: str) -> SnapshotSaved | None:
        """The request's reply's latest snapshot, while it is saved (stored in the tier as the request lets go)."""
        snapshots, block_hash = self.snapshots, self.reply_snapshot.get(request_id)
        if snapshots is None or block_hash is None:
            return None
        slot = snapshots.slot_of(block_hash)
        return None if slot is None else SnapshotSaved(slot, block_hash, snapshots.keys[block_hash], False)

    # ---- where prefills stop ---------------------------------------------------------------------------------

    def chunk(self, request: StateRequest, start: int, num_new: int) -> int:
        """How many of `num_new` tokens from `start` the next step computes, so that it ends where a snapshot is worth
        taking (`stops`), else, for a chunk short of the request's end, at the chunk's last block boundary (vLLM's
        aligned chunks). Unchanged when the cut would leave nothing."""
        if self.snapshots is None:
            return num_new
        end = start + num_new
        cut = min((s for s in self.stops(request, start) if start < s < end), default=None)
        if cut is not None:
            return cut - start
        aligned = end // self.block_size * self.block_size
        if end < request.num_tokens and aligned > start:
            return aligned - start
        return num_new

    def stops(self, request: StateRequest, start: int) -> list[int]:
        """The prompt positions past `start` where a snapshot is worth taking (see the module docstring)."""
        bs = self.block_size
        interval = self.interval_blocks * bs
        stops = [(start // interval + 1) * interval, (request.num_prompt_tokens - 1) // bs * bs]
        return stops + [m // bs * bs for m in request.cache_marks]

    def _lasting(self, request: StateRequest, num_tokens: int) -> bool:
        """Whether a snapshot where a step ends at `num_tokens` is one a later request is likely to start from: at a
        stop, at the prompt's end, and in the reply. One at a chunk end the token budget cut elsewhere is saved too,
        but overwritten first (measured: saved like the others, the chunk ends of 8 prompts under
        --max-num-batched-tokens 256 pushed 7 of their 8 prompt-end snapshots out of 32 slots)."""
        return num_tokens >= request.num_prompt_tokens or num_tokens in self.stops(request, num_tokens - 1)

    # ---- a step's copies ---------------------------------------------------------------------------------

    def plan_step(self, request: StateRequest, num_hit_blocks: int, end: int, keys: RequestKeys | None) -> None:
        """The copies around the request's next step: before it, its slot filled from the snapshot its prefix hit of
        `num_hit_blocks` blocks ends at; after it, when the step ends on a block boundary (`end` tokens computed then),
        that state saved as the boundary block's snapshot. `keys`: the request's block hashes and keys (None: no
        prefix caching, no snapshots)."""
        snapshots, rid, bs = self.snapshots, request.request_id, self.block_size
        if snapshots is None or keys is None:
            return
        slot = self.slot(rid)
        hashes = keys.hashes(request, end if not end % bs and end <= request.num_tokens else num_hit_blocks * bs)
        if num_hit_blocks:
            source = snapshots.read(hashes[num_hit_blocks - 1])
            if source is None:
                raise ValueError(f"request {rid}: the state snapshot of its prefix hit is gone")
            self.restores.append((source, slot))
        if end % bs or end > request.num_tokens:
            return
        block_hash, key = hashes[end // bs - 1], keys.key(request, hashes, end // bs - 1)
        in_reply = end > request.num_prompt_tokens
        if in_reply:  # a boundary inside the reply: the next chat turn starts here, not at the reply's previous one
            previous = self.reply_snapshot.get(rid)
            if previous == block_hash and block_hash in snapshots.by_hash:  # planned again (a recompute): ours
                return
            if previous is not None:
                del self.reply_snapshot[rid]
                if previous != block_hash:
                    snapshots.drop(previous)  # first, so that its slot takes the new one
        target = snapshots.reserve(block_hash, key, lasting=self._lasting(request, end))
        if target is None:  # it exists already (the same tokens: another's, never to be dropped as ours) or no room
            return
        if in_reply:
            self.reply_snapshot[rid] = block_hash
        self.saves.append((slot, target))
        self.save_records.append(SnapshotSaved(target, block_hash, key, not in_reply))

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The runner starts the step: its copies, (restores before it, saves after it), each (from, to) slots."""
        copies = (self.restores, self.saves)
        self.saving = self.save_records
        self.restores, self.saves, self.save_records = [], [], []
        return copies

    def end_step(self) -> None:
        """The runner saved what it took: hits may start from those snapshots, and the slots the step named may be
        reassigned."""
        if self.snapshots is not None:
            self.snapshots.saved([s.block_hash for s in self.saving])
            self.snapshots.end_step()
        self.saved, self.saving = self.saving, []

    def take_saved(self) -> list[SnapshotSaved]:
        """The snapshots the last step saved (it succeeded: the offload tier may copy them before the next step)."""
        saved, self.saved = self.saved, []
        return saved

    def reset(self) -> None:
        """A step failed or the prefix cache is dropped: every snapshot but pinned ones and restores in flight goes,
        with the copies planned for a step that did not run."""
        if self.snapshots is not None:
            self.snapshots.clear()
        self.restores, self.saves, self.save_records, self.saving, self.saved = [], [], [], [], []
        self.reply_snapshot.clear()

    def check(self) -> None:
        if self.snapshots is not None:
            self.snapshots.check()
