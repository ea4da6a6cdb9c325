"""State slots: where a hybrid model's state layers keep each running request's state (vLLM's MambaSpec, in the
plain form this engine needs today).

Why a slot and not blocks: a state layer (LFM2's short convolution) does not keep one entry per token, as attention's
KV does; it keeps one fixed-size state per sequence, overwritten by every step. So a request holds exactly one slot
from its first scheduled step to its end, in every state layer at once (slot i of each layer's state tensor), and the
slots' bytes come out of the same KV memory budget as the blocks (engine/build.py plans both). There is one slot for
every sequence the scheduler may run at once (--max-num-seqs): a request that is admitted always finds one.

What a state cannot do that KV can: go back. A preempted request gives its slot back and recomputes from its first
token when it is resumed (preemption by recompute, as for KV); a prefix hit needs the state at the hit point, which
nothing keeps yet, so a model with state layers reads no prefix cache (its prompts are computed whole).

Pure Python (no torch): `kvserve estimate` sizes the slots from StateSpec.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StateSpec:
    """One sequence's state in every state layer: a short convolution keeps its last `conv_kernel - 1` inputs of
    `conv_channels` channels (LFM2: the hidden size), each `element_bytes` bytes."""

    num_layers: int
    conv_kernel: int
    conv_channels: int
    element_bytes: int = 4

    @property
    def conv_tokens(self) -> int:
        return self.conv_kernel - 1

    @property
    def bytes_per_layer(self) -> int:
        return self.conv_tokens * self.conv_channels * self.element_bytes

    @property
    def bytes_per_slot(self) -> int:
        """One sequence's state, every state layer."""
        return self.num_layers * self.bytes_per_layer

    def describe(self) -> str:
        return (
            f"{self.num_layers} short-conv layers x {self.conv_tokens} tokens x {self.conv_channels} channels x "
            f"{self.element_bytes} bytes = {self.bytes_per_slot} bytes a sequence"
        )


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
