"""Shuffled block tables for attention tests: sequences laid out over non-contiguous blocks, so that a kernel which
assumed a request's blocks were adjacent, or in order, reads the wrong K/V and fails its comparison."""

from __future__ import annotations

import random

import torch

from kvserve.attention.metadata import AttentionMetadata


def shuffled_block_tables(
    seqs: list[tuple[int, int]], block_size: int, seed: int, spare_blocks: int
) -> tuple[list[list[int]], AttentionMetadata, int]:
    """The tables and metadata for sequences given as (seq_len, query_len) whose blocks are drawn in a seeded random
    order from 1..num_blocks-1 (block 0 is the table padding, never handed out), and num_blocks: the blocks they need
    plus `spare_blocks` that no table names (kernels must never read them)."""
    need = [-(-s // block_size) for s, _ in seqs]
    num_blocks = sum(need) + spare_blocks
    ids = list(range(1, num_blocks))
    random.Random(seed).shuffle(ids)
    tables, at = [], 0
    for n in need:
        tables.append(ids[at : at + n])
        at += n
    meta = AttentionMetadata.build(tables, [s for s, _ in seqs], [q for _, q in seqs], block_size, torch.device("cpu"))
    return tables, meta, num_blocks


def context_slot_mask(
    tables: list[list[int]], seqs: list[tuple[int, int]], block_size: int, num_blocks: int
) -> torch.Tensor:
    """True at every cache slot some sequence's context occupies: tests poison the others (NaN), so that a kernel
    reading one, even masked, fails."""
    used = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for table, (seq_len, _) in zip(tables, seqs):
        for p in range(seq_len):
            used[table[p // block_size] * block_size + p % block_size] = True
    return used
