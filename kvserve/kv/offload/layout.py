"""BlockLayout: one block's K/V across every layer as one flat payload of bytes, copied out of the cache and back in
for many blocks at once.

Why batched: a block's bytes live in 2 (or, with 8-bit scales, 4) tensors per layer, 36 slices for Gemma 3 270M.
Copied one block at a time, each of those slices is a few torch calls (about 1.7 ms a block, measured: a 512-token
prefill's 32 blocks would have cost the engine thread 50 ms). Copied for all of a step's blocks at once, it is one
gather per tensor whatever the number of blocks, plus one copy a block. Where the model runs on the native kernels
and the cache is stored as it is, one call copies every part of every block between the cache and the payload rows,
across the threads (NativeKernels.copy_rows: a 70-block restore of Gemma 3 270M in 1.8 ms against 4.5 on the torch
path below, scripts/ab_kernel_shapes.py); the torch paths are for the rest (int8 records, other devices, the torch
kernels)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from kvserve.kv.cache import LayerKVCache
from kvserve.kv.offload.record import RecordError
from kvserve.kv.quant import KV_QUANT_FORMATS, compute_scales, dequantize, quantize


class BlockLayout:
    """The payload of a block: each layer's key, value, key scales, value scales in turn, each that tensor's
    [block_size, ...] slice of the block as bytes.

    `compress` (--kv-offloading-dtype int8, for a cache that is not 8-bit already): each K and V slice is stored as
    int8 values followed by a float32 scale per token and KV head (kv/quant.py's int8 format, as --kv-cache-dtype
    int8 stores it), about 4x fewer bytes than float32; a restore dequantizes into the cache's dtype, so it is close,
    not bit-exact."""

    def __init__(
        self, caches: Sequence[LayerKVCache], compress: bool = False, copy_rows: RowCopy | None = None
    ) -> None:
        tensors: list[torch.Tensor] = []
        for cache in caches:
            tensors += [cache.key, cache.value]
            if cache.key_scale is not None and cache.value_scale is not None:
                tensors += [cache.key_scale, cache.value_scale]
        self._init(tensors, compress and not any(c.is_quantized for c in caches), copy_rows)

    @classmethod
    def of_rows(cls, tensors: Sequence[torch.Tensor], copy_rows: RowCopy | None = None) -> BlockLayout:
        """The layout of row i of every tensor (indexed by their first dimension), stored as it is: a hybrid model's
        state snapshots, one slot of every state layer's tensors a record (kv/state_cache.py)."""
        layout = cls.__new__(cls)
        layout._init(list(tensors), False, copy_rows)
        return layout

    def _init(self, tensors: list[torch.Tensor], compress: bool, copy_rows: RowCopy | None) -> None:
        self.tensors = tensors
        self.compress = compress
        self.format = KV_QUANT_FORMATS["int8"]
        self.values = [t[0].numel() for t in tensors]  # elements of one block's slice of each tensor
        self.sizes = [
            n + 4 * (n // t.shape[-1]) if self.compress else n * t.element_size() for t, n in zip(tensors, self.values)
        ]
        self.block_bytes = sum(self.sizes)
        self.offsets = np.cumsum([0, *self.sizes[:-1]]).tolist()  # each part's first byte in a payload
        self._buffers: dict[str, torch.Tensor] = {}  # see _scratch
        self._host_rows: list[np.ndarray] | None = None  # see block_views
        # The native kernels' one-call copy (NativeKernels.copy_rows) where the cache is in host memory and stored as
        # it is: the cache's parts as [blocks, bytes a block] uint8, copied to and from payload rows directly.
        direct = copy_rows is not None and not self.compress and tensors[0].device.type == "cpu"
        self._copy_rows = copy_rows if direct else None
        self._parts = [_bytes(t.view(t.shape[0], v)) for t, v in zip(tensors, self.values)] if direct else []

    def _scratch(self, which: str, n: int, size: int) -> torch.Tensor:
        """n x size bytes of a buffer kept between calls (grown as needed): each tensor's rows pass through it, since a
        fresh tensor a call is fresh pages from the OS, whose faults cost more than the copies themselves. One buffer
        per direction: the engine thread gathers while a disk tier's loader thread scatters."""
        buffer = self._buffers.get(which)
        if buffer is None or buffer.numel() < n * size:
            buffer = self._buffers[which] = torch.empty(n * size, dtype=torch.uint8, device=self.tensors[0].device)
        return buffer[: n * size].view(n, size)

    @property
    def reads_in_place(self) -> bool:
        """Whether a disk restore may read a record straight into its block's slices of the cache (block_views): the
        payload is the cache's own bytes (not int8 records), the cache is in host memory, and its parts fit one
        vectored read."""
        return not self.compress and self.tensors[0].device.type == "cpu" and len(self.tensors) + 2 <= _IOV_MAX

    def block_views(self, block_id: int) -> list[memoryview]:
        """The block's own bytes in the cache, one writable view per payload part in the payload's order (see
        reads_in_place)."""
        if self._host_rows is None:  # each cache tensor as [blocks, bytes a block] numpy, made once: a view a part
            self._host_rows = [_bytes(t.view(t.shape[0], -1)).numpy() for t in self.tensors]  # is then ~0.3 us
        return [rows[block_id].data for rows in self._host_rows]

    def load_buffer(self, n: int) -> torch.Tensor:
        """[n, block_bytes] uint8 kept between calls, for a disk tier's loader to read records into (its thread's)."""
        return self._scratch("load", n, self.block_bytes)

    def _rows(self, block_ids: Sequence[int]) -> Iterator[tuple[int, torch.Tensor]]:
        """For each part of the payload in order: its offset and the blocks' bytes of it, [n, part size] uint8 on the
        host (valid until the next part is asked for: it may live in the scratch buffer)."""
        n = len(block_ids)
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.tensors[0].device)
        offset = 0
        for t, values, size in zip(self.tensors, self.values, self.sizes):
            raw = self._scratch("gather", n, values * t.element_size())
            source = t.view(t.shape[0], values)
            if _aligned(raw, _bytes(source)):
                torch.index_select(_words(source), 0, ids, out=_words(raw))
            else:
                torch.index_select(_bytes(source), 0, ids, out=raw)
            rows = raw.cpu()
            if self.compress:
                x = rows.view(t.dtype).float().reshape(n, values // t.shape[-1], t.shape[-1])
                scale = compute_scales(x, self.format)
                yield offset, quantize(x, scale, self.format).reshape(n, values).view(torch.uint8)
                yield offset + values, scale.reshape(n, -1).view(torch.uint8)
            else:
                yield offset, rows
            offset += size

    def gather(self, block_ids: Sequence[int], out: torch.Tensor) -> torch.Tensor:
        """Copies of the blocks into `out`, [len(block_ids), block_bytes] uint8 on the host (one row a block,
        contiguous)."""
        if block_ids:
            for offset, rows in self._rows(block_ids):
                _copy(out[:, offset : offset + rows.shape[1]], rows)
        return out

    def gather_into(self, block_ids: Sequence[int], dest: torch.Tensor, dest_rows: Sequence[int]) -> None:
        """Copy the blocks into rows `dest_rows` of `dest` ([rows, block_bytes] uint8: the host tier's slab): gathered
        into a scratch buffer, then whole rows copied, with no allocation."""
        if not block_ids:
            return
        if self._copy_rows is not None and dest.device.type == "cpu":
            self._copy_rows(self._payload_parts(dest), self._parts, dest_rows, block_ids)
            return
        staged = self.gather(block_ids, self._scratch("rows", len(block_ids), self.block_bytes))
        where = torch.tensor(dest_rows, dtype=torch.int64)
        if _aligned(dest, staged):
            _words(dest).index_copy_(0, where, _words(staged))
        else:
            dest.index_copy_(0, where, staged)

    def scatter(self, block_ids: Sequence[int], payloads: torch.Tensor, rows: Sequence[int] | None = None) -> None:
        """Write payloads into the blocks: rows `rows` of `payloads` ([*, block_bytes] uint8), or with rows None, its
        rows in order (then exactly one a block)."""
        n = len(block_ids)
        if payloads.dim() != 2 or payloads.shape[1] != self.block_bytes or (rows is None and payloads.shape[0] != n):
            raise RecordError(f"payloads of shape {tuple(payloads.shape)}, expected ({n}, {self.block_bytes})")
        if n == 0:
            return
        device = self.tensors[0].device
        if self._copy_rows is not None and payloads.device.type == "cpu":
            self._copy_rows(self._parts, self._payload_parts(payloads), block_ids, range(n) if rows is None else rows)
            return
        if rows is not None and not self.compress and device == payloads.device:
            runs = _runs(rows)
            if len(runs) <= _MAX_RUNS:
                self._scatter_runs(block_ids, payloads, rows, runs)
                return
        ids = torch.tensor(block_ids, dtype=torch.int64, device=device)
        picked = None if rows is None else torch.tensor(rows, dtype=torch.int64)
        offset = 0
        for t, values, size in zip(self.tensors, self.values, self.sizes):
            part = payloads[:, offset : offset + size]
            staged = self._scratch("scatter", n, size)
            if picked is None and not self.compress and _aligned(part):
                staged = part  # rows in order, word-aligned: copied from where they are
            elif picked is None:
                _copy(staged, part)
            elif _aligned(staged, part):
                torch.index_select(_words(part), 0, picked, out=_words(staged))
            else:
                torch.index_select(part, 0, picked, out=staged)
            if self.compress:
                width = t.shape[-1]
                q = staged[:, :values].contiguous().view(torch.int8).reshape(n, values // width, width)
                scale = staged[:, values:].contiguous().view(torch.float32).reshape(n, values // width, 1)
                source = _bytes(dequantize(q, scale, t.dtype).reshape(n, values))
            else:
                source = staged
            target = t.view(t.shape[0], values)
            if _aligned(_bytes(target), source):
                _words(target).index_copy_(0, ids, _words(source).to(device))
            else:
                _bytes(target).index_copy_(0, ids, source.to(device))
            offset += size

    def _payload_parts(self, payloads: torch.Tensor) -> list[torch.Tensor]:
        """Each part's columns of payload rows [n, block_bytes] uint8, in the payload's order."""
        return [payloads[:, o : o + size] for o, size in zip(self.offsets, self.sizes)]

    def _scatter_runs(
        self, block_ids: Sequence[int], payloads: torch.Tensor, rows: Sequence[int], runs: list[tuple[int, int]]
    ) -> None:
        """scatter's one copy for rows that lie in few runs of consecutive slab rows (a chain stored in one step sits
        in consecutive slots): each run's part of each tensor is copied from where it lies in the slab, a slice copy
        where the blocks are consecutive too, else an index copy, with no staging copy in between (a 67-block
        restore of Gemma 3 270M: 1.8 or 2.7 ms, against 3.5-4.7 through staging)."""
        offset = 0
        for t, values, size in zip(self.tensors, self.values, self.sizes):
            target = t.view(t.shape[0], values)
            for start, length in runs:
                source = payloads[rows[start] : rows[start] + length, offset : offset + size]
                ids = block_ids[start : start + length]
                words = _aligned(_bytes(target), source)
                dst, src = (_words(target), _words(source)) if words else (_bytes(target), source)
                if all(ids[i + 1] == ids[i] + 1 for i in range(length - 1)):
                    dst[ids[0] : ids[0] + length].copy_(src)
                else:
                    dst.index_copy_(0, torch.tensor(ids, dtype=torch.int64, device=t.device), src)
            offset += size


# NativeKernels.copy_rows: row dst_rows[i] of each destination part <- row src_rows[i] of its source part.
RowCopy = Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor], Sequence[int], Sequence[int]], None]

# Past this many runs of consecutive rows, scatter gathers the rows into a staging buffer first (one gather and one
# index copy per tensor, however scattered the rows are).
_MAX_RUNS = 8


def _runs(rows: Sequence[int]) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of consecutive values in `rows`, in order."""
    runs: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i] != rows[i - 1] + 1:
            runs.append((start, i - start))
            start = i
    return runs


# How many buffers one vectored read (os.preadv) may fill.
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 16

# Why words: torch copies and index ops on 1-byte elements run about 10x slower than on 4-byte ones (measured here:
# index_copy_ of 576 KiB rows, 0.88 against 0.09 ms a row), so byte buffers are moved as int32 wherever their rows'
# lengths and offsets allow (every KV dtype's block slices do; the byte path is the fallback).


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A 2-D tensor whose rows are contiguous, as its bytes: [n, row bytes] uint8 (the same memory)."""
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _word_aligned(t: torch.Tensor) -> bool:
    b = _bytes(t)
    return b.shape[1] % 4 == 0 and b.stride(0) % 4 == 0 and b.storage_offset() % 4 == 0


def _aligned(*tensors: torch.Tensor) -> bool:
    return all(_word_aligned(t) for t in tensors)


def _words(t: torch.Tensor) -> torch.Tensor:
    """A word-aligned 2-D tensor (see _aligned) as [n, row bytes / 4] int32 (the same memory)."""
    return _bytes(t).view(torch.int32)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy uint8 [n, m] `src` into `dst`, as words where both allow."""
    if _aligned(dst, src):
        _words(dst).copy_(_words(src))
    else:
        dst.copy_(src)
