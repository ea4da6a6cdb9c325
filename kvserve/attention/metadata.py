"""What one forward step tells every attention layer about the flat batch and the paged cache."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
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
        block_tables: Sequence[Sequence[int]],
        seq_lens: list[int],
        query_lens: list[int],
        block_size: int,
        device: torch.device,
        leading_nulls: Sequence[int] | None = None,
    ) -> "AttentionMetadata":
        """Derive slot mapping and offsets from per-sequence block tables and lengths.

        With `leading_nulls`, table i is that many null entries followed by block_tables[i] (a sliding KV cache
        group's table past its window: the runner sends only the entries after the nulls, so a step's host work per
        sliding group follows the window, not the context). The tables are filled into one numpy array and the slots
        computed from it in a few vectorized operations: building them as nested Python lists through torch.tensor
        cost ~140 ns an entry, once per KV cache group (6 for Gemma 3) every step."""
        num_seqs = len(block_tables)
        leads = list(leading_nulls) if leading_nulls is not None else [0] * num_seqs
        lens = [lead + len(t) for lead, t in zip(leads, block_tables, strict=True)]
        width = max(lens, default=0)
        tables = np.full((num_seqs, width), NULL_BLOCK_ID, dtype=np.int64)
        for i, (lead, table) in enumerate(zip(leads, block_tables)):
            if len(table):
                tables[i, lead : lead + len(table)] = table
        q_lens = np.asarray(query_lens, dtype=np.int64)
        starts = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=starts[1:])
        rows = np.repeat(np.arange(num_seqs), q_lens)
        # Each token's position: its sequence's first new position plus its offset within the sequence's rows.
        first = np.asarray(seq_lens, dtype=np.int64) - q_lens
        positions = np.arange(int(starts[-1]), dtype=np.int64) + np.repeat(first - starts[:-1], q_lens)
        entries = positions // block_size
        if entries.size and (positions.min() < 0 or (entries >= np.asarray(lens, dtype=np.int64)[rows]).any()):
            raise IndexError("a block table is shorter than its sequence's context")
        slots = tables[rows, entries] * block_size + positions % block_size

        def as_tensor(xs: Any) -> torch.Tensor:
            t = torch.from_numpy(np.ascontiguousarray(xs, dtype=np.int64))
            return t if device.type == "cpu" else t.to(device)

        return cls(
            slot_mapping=as_tensor(slots),
            block_tables=as_tensor(tables),
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
