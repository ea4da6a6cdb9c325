"""The state tensors of a hybrid model's state layers, and what a step tells those layers about its sequences.

kv/state.py says why a state lives in a slot; this module holds the tensors (one per state layer, [num_slots,
conv_kernel - 1, channels]) and the per-step metadata: each sequence's rows of the flat batch, its slot, and whether
it continues a state (its first token is not the sequence's first: a later prefill chunk, or a decode step) or starts
from zeros. A slot is never read for a sequence that starts, so a slot handed on from a finished request needs no
clearing."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.kv.state import StateSpec


@dataclass(slots=True)
class LayerStateCache:
    """One state layer's states: conv[slot] holds the layer's last conv_kernel - 1 inputs of the slot's sequence."""

    conv: torch.Tensor  # [num_slots, conv_kernel - 1, channels]
    recurrent: torch.Tensor | None = None  # linear attention: [num_slots, value heads, key dim, value dim]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed by slot (what a state copy moves)."""
        return [self.conv] if self.recurrent is None else [self.conv, self.recurrent]


@dataclass(slots=True)
class StateMetadata:
    """The step's S sequences as the state layers see them (rows as in AttentionMetadata)."""

    slots: torch.Tensor  # [S] int64: each sequence's state slot
    query_start_loc_cpu: list[int]  # S + 1 row offsets
    continues_cpu: list[bool]  # per sequence: whether its state carries on (False: it starts from zeros)

    @classmethod
    def build(cls, slots: list[int], query_lens: list[int], starts: list[int], device: torch.device) -> StateMetadata:
        """From each sequence's slot, its new tokens this step and the position of its first new token."""
        offsets = [0]
        for n in query_lens:
            offsets.append(offsets[-1] + n)
        return cls(torch.tensor(slots, dtype=torch.int64, device=device), offsets, [s > 0 for s in starts])


@dataclass(slots=True)
class StepState:
    """What a model with state layers is given besides its KV caches: every state layer's cache, in layer order, and
    the step's metadata (one for all of them)."""

    caches: list[LayerStateCache]
    meta: StateMetadata


def allocate_state_cache(
    spec: StateSpec, num_slots: int, dtype: torch.dtype, device: torch.device
) -> list[LayerStateCache]:
    """Zeroed states for every state layer (zeros are never read as a state, but keep a stray read finite)."""
    shape = (num_slots, spec.conv_tokens, spec.conv_channels)

    def recurrent() -> torch.Tensor | None:
        if not spec.recurrent_shape:
            return None
        return torch.zeros((num_slots, *spec.recurrent_shape), dtype=dtype, device=device)

    return [
        LayerStateCache(torch.zeros(shape, dtype=dtype, device=device), recurrent()) for _ in range(spec.num_layers)
    ]
