"""What one forward step tells every attention layer about the flat batch and the paged cache."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.capacity import NULL_BLOCK_ID


@dataclass(slots=True)
class AttentionMetadata:
    """Describes one flat batch of T new tokens belonging to S sequences.

    The tokens of sequence i are rows query_start_loc[i]:query_start_loc[i+1] of the batch; they are the
    last query_lens[i] tokens of a context of seq_lens[i] tokens, so their positions are
    seq_lens[i] - query_lens[i] ... seq_lens[i] - 1. Each layer first writes the new tokens' K/V at
    slot_mapping (slot = block_id * block_size + offset in block), then reads the whole context of
    sequence i through block_tables[i].
    """

    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [S, max_blocks_per_seq] int64, padded with the null block (never holds KV)
    seq_lens: torch.Tensor  # [S] int64, context length after this step
    query_start_loc: torch.Tensor  # [S + 1] int64
    seq_lens_cpu: list[int]
    query_lens_cpu: list[int]
    block_size: int
    # Index tensors a backend derives from this step's metadata, shared by every layer (they differ only by
    # sliding window): computed by the first layer, reused by the other layers. Lives and dies with the step.
    derived: dict[tuple, Any] = field(default_factory=dict)

    def memo(self, key: tuple, make: Callable[[], Any]) -> Any:
        """`make()` once per step per key."""
        if key not in self.derived:
            self.derived[key] = make()
        return self.derived[key]

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.query_lens_cpu)

    @classmethod
    def build(
        cls,
        block_tables: list[list[int]],
        seq_lens: list[int],
        query_lens: list[int],
        block_size: int,
        device: torch.device,
    ) -> "AttentionMetadata":
        """Derive slot mapping and offsets from per-sequence block tables and lengths."""
        slots: list[int] = []
        for table, seq_len, q_len in zip(block_tables, seq_lens, query_lens):
            for pos in range(seq_len - q_len, seq_len):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        width = max((len(t) for t in block_tables), default=0)
        padded = [t + [NULL_BLOCK_ID] * (width - len(t)) for t in block_tables]
        starts = [0]
        for q_len in query_lens:
            starts.append(starts[-1] + q_len)
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
        return cls(
            slot_mapping=as_tensor(slots),
            block_tables=as_tensor(padded).reshape(len(block_tables), width),
            seq_lens=as_tensor(seq_lens),
            query_start_loc=as_tensor(starts),
            seq_lens_cpu=list(seq_lens),
            query_lens_cpu=list(query_lens),
            block_size=block_size,
        )


# What a model's forward is told: one AttentionMetadata for every layer (a single KV cache group), or one per layer
# (each layer its group's: with KV cache groups, kv/groups.py, every group has its own block tables and slot mapping).
StepMetadata = AttentionMetadata | Sequence[AttentionMetadata]


def per_layer(meta: StepMetadata, num_layers: int) -> Sequence[AttentionMetadata]:
    """Each layer's metadata."""
    if isinstance(meta, AttentionMetadata):
        return [meta] * num_layers
    if len(meta) != num_layers:
        raise ValueError(f"{len(meta)} attention metadata for {num_layers} layers")
    return meta
