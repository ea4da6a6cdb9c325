"""CUDA graphs for decode-only steps, at bucketed batch sizes (vLLM's --cuda-graph-sizes, --enforce-eager).

Why: a decode step of a small model on a GPU is hundreds of tiny kernels, each launched from Python; replaying a
recorded graph launches them all at once. A graph replays fixed tensor addresses and shapes, so:
- The model reads its inputs from static buffers (ids, positions, and per KV cache group a slot mapping and block
  tables padded to max-model-len / block-size columns; seq lens, query start locs) sized for the largest captured
  batch; a step copies its real rows in and runs the graph of the next captured size up. Each layer reads its own
  group's tables (kv/groups.py), as in an eager step.
- Padding rows are harmless: their token is id 0 at position 0, their one slot is slot 0 of the null block
  (capacity.NULL_BLOCK_ID, never allocated, so no request's K/V is touched), their block table is all null
  blocks and their context is 1 token (the slot they just wrote). Their outputs are dropped.
- Block-table columns beyond this step's widest table keep the previous step's (valid) block ids: a backend may
  read a row's table only below cdiv(seq_len, block_size).
- The metadata's Python lists (seq_lens_cpu, query_lens_cpu) are frozen at capture (all 1), and nothing computed
  on the host during capture is recomputed on replay: the captured attention backend must read the step only
  from the metadata's tensors, never branch on the lists. The reference and cpu backends do not qualify (they
  loop over seq_lens_cpu), so graphs are used only with backends in CUDA_GRAPH_BACKENDS.
The capture itself is injected (`GraphCapture`): `CudaGraphCapture` on a GPU, and in CPU tests `replay_by_call`,
which re-runs the recorded function on the same static buffers and the same frozen metadata object (clearing only
its per-step memo, whose tensor ops a real graph would re-run), so that padding, buffers and replay are tested
without a GPU.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from kvserve.attention.metadata import AttentionMetadata
from kvserve.capacity import NULL_BLOCK_ID
from kvserve.kv.cache import LayerKVCache
from kvserve.kv.groups import KVCacheLayout
from kvserve.units import cdiv

if TYPE_CHECKING:
    from kvserve.config import EngineConfig
    from kvserve.model.protocol import Model

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512  # vLLM's cap: larger decode batches run eagerly
# Backends whose decode path reads only the metadata's tensors (see the module docstring): the Triton decode
# kernel is written to be capturable.
CUDA_GRAPH_BACKENDS: tuple[str, ...] = ("triton",)

Replay = Callable[[], torch.Tensor]


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's buckets, 1, 2, 4, then every multiple of 8, up to the first that holds max_num_seqs (at most 512)."""
    candidates = [1, 2, 4, *range(8, MAX_CAPTURE_SIZE + 1, 8)]
    cap = min(max_num_seqs, MAX_CAPTURE_SIZE)
    return [s for s in candidates if s < cap] + [next(s for s in candidates if s >= cap)]


def capture_sizes(requested: Sequence[int] | None, max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """The sizes to capture, ascending: `requested` (--cuda-graph-sizes) or the default, without sizes a decode step
    can never reach (more rows than --max-num-batched-tokens)."""
    sizes = sorted(set(requested if requested is not None else default_capture_sizes(max_num_seqs)))
    return [s for s in sizes if s <= max_num_batched_tokens]


class GraphCapture(Protocol):
    def __call__(self, fn: Replay) -> Replay:
        """Record `fn` (which returns the model's output); returns a replay that re-runs what was recorded."""
        ...


def replay_by_call(fn: Replay) -> Replay:
    """The CPU stand-in for a CUDA graph: run once at 'capture', and 'replay' by calling `fn` again."""
    fn()
    return fn


class CudaGraphCapture:
    """Records with torch.cuda.graph, every graph in one shared memory pool (captured largest first, so the
    smaller graphs reuse the largest one's blocks), after a warm-up run on a side stream (lazy cuBLAS and
    allocator initialization must not happen during capture)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, fn: Replay) -> Replay:
        side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]  # torch's stub is untyped
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


@dataclass(slots=True)
class DecodeBuffers:
    """The static inputs every captured graph reads, sized for the largest captured batch; slot mappings and block
    tables one per KV cache group."""

    input_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B]
    slot_mapping: torch.Tensor  # [G, B]
    block_tables: torch.Tensor  # [G, B, max_blocks_per_seq]
    seq_lens: torch.Tensor  # [B]
    query_start_loc: torch.Tensor  # [B + 1]: 0, 1, ..., B (decode: one token per sequence), never rewritten

    @classmethod
    def allocate(
        cls, max_batch: int, max_blocks_per_seq: int, block_size: int, num_groups: int, device: torch.device
    ) -> "DecodeBuffers":
        """Buffers holding a batch of padding rows (see the module docstring)."""

        def full(value: int, *shape: int) -> torch.Tensor:
            return torch.full(shape, value, dtype=torch.int64, device=device)

        return cls(
            full(0, max_batch),
            full(0, max_batch),
            full(NULL_BLOCK_ID * block_size, num_groups, max_batch),
            full(NULL_BLOCK_ID, num_groups, max_batch, max_blocks_per_seq),
            full(1, max_batch),
            torch.arange(max_batch + 1, dtype=torch.int64, device=device),
        )

    def metadata(self, size: int, block_size: int) -> list[AttentionMetadata]:
        """Per group, the metadata a graph of `size` rows is captured with: views of the buffers; lists frozen at
        1s."""
        return [
            AttentionMetadata(
                slot_mapping=self.slot_mapping[g, :size],
                block_tables=self.block_tables[g, :size],
                seq_lens=self.seq_lens[:size],
                query_start_loc=self.query_start_loc[: size + 1],
                seq_lens_cpu=[1] * size,
                query_lens_cpu=[1] * size,
                block_size=block_size,
            )
            for g in range(self.slot_mapping.shape[0])
        ]


@dataclass(slots=True)
class PaddedDecode:
    """A decode batch padded to a captured size (module docstring), as tensors to copy into DecodeBuffers."""

    input_ids: torch.Tensor  # [size]
    positions: torch.Tensor  # [size]
    slot_mapping: torch.Tensor  # [G, size]
    block_tables: torch.Tensor  # [G, size, width]
    seq_lens: torch.Tensor  # [size]

    def tensors(self) -> list[torch.Tensor]:
        return [self.input_ids, self.positions, self.slot_mapping, self.block_tables, self.seq_lens]

    @staticmethod
    def from_tensors(tensors: Sequence[torch.Tensor]) -> PaddedDecode:
        """The inverse of tensors() (after a move to the device)."""
        return PaddedDecode(*tensors)


def pad_decode_inputs(
    size: int,
    block_size: int,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    metas: Sequence[AttentionMetadata],
) -> PaddedDecode:
    """A decode batch of n <= size rows (host tensors; one metadata per KV cache group) padded to `size` rows of
    padding (module docstring)."""
    n = input_ids.shape[0]
    if n > size:
        raise ValueError(f"a decode batch of {n} rows does not fit a graph of {size}")

    def pad(t: torch.Tensor, value: int) -> torch.Tensor:
        return torch.cat([t, torch.full((size - n, *t.shape[1:]), value, dtype=t.dtype)])

    return PaddedDecode(
        pad(input_ids, 0),
        pad(positions, 0),
        torch.stack([pad(m.slot_mapping, NULL_BLOCK_ID * block_size) for m in metas]),
        torch.stack([pad(m.block_tables, NULL_BLOCK_ID) for m in metas]),
        pad(metas[0].seq_lens, 1),
    )


class DecodeGraphs:
    """One recorded forward per capture size, over shared static buffers."""

    def __init__(
        self,
        model: Model,
        kv_caches: list[LayerKVCache],
        sizes: list[int],
        max_model_len: int,
        block_size: int,
        device: torch.device,
        capture: GraphCapture,
        layout: KVCacheLayout | None = None,
    ) -> None:
        if not sizes:
            raise ValueError("DecodeGraphs needs at least one capture size")
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = sorted(sizes)
        self.block_size = block_size
        self.layer_group = layout.layer_group if layout is not None else (0,) * len(kv_caches)
        num_groups = layout.num_groups if layout is not None else 1
        self.buffers = DecodeBuffers.allocate(
            self.sizes[-1], cdiv(max_model_len, block_size), block_size, num_groups, device
        )
        self._replays: dict[int, Replay] = {}
        start = time.perf_counter()
        with torch.inference_mode():
            for size in reversed(self.sizes):  # largest first: the shared pool is sized once
                self._replays[size] = capture(self._forward_fn(size))
        logger.info(
            "captured %d decode graphs (batch sizes %s) in %.2f s",
            len(self.sizes),
            " ".join(map(str, self.sizes)),
            time.perf_counter() - start,
        )

    def _forward_fn(self, size: int) -> Replay:
        b = self.buffers
        metas = b.metadata(size, self.block_size)
        layer_metas = [metas[g] for g in self.layer_group]

        def forward() -> torch.Tensor:
            for meta in metas:
                meta.derived.clear()  # a backend's per-step memo: recomputed from the buffers, as a replay would
            return self.model(b.input_ids[:size], b.positions[:size], self.kv_caches, layer_metas)

        return forward

    def size_for(self, num_rows: int) -> int | None:
        """The smallest captured size holding `num_rows` rows, or None (run eagerly)."""
        i = bisect.bisect_left(self.sizes, num_rows)
        return self.sizes[i] if i < len(self.sizes) else None

    def replay(self, size: int, padded: PaddedDecode) -> torch.Tensor:
        """Copy a padded batch (device tensors of `size` rows; tables as wide as this step needs) into the buffers
        and replay; returns the graph's output ([size, hidden], overwritten by the next replay)."""
        b = self.buffers
        b.input_ids[:size].copy_(padded.input_ids)
        b.positions[:size].copy_(padded.positions)
        b.slot_mapping[:, :size].copy_(padded.slot_mapping)
        b.block_tables[:, :size, : padded.block_tables.shape[2]].copy_(padded.block_tables)
        b.seq_lens[:size].copy_(padded.seq_lens)
        return self._replays[size]()


def build_decode_graphs(
    config: EngineConfig,
    model: Model,
    kv_caches: list[LayerKVCache],
    layout: KVCacheLayout,
    max_model_len: int,
    device: torch.device,
) -> DecodeGraphs | None:
    """The engine's graphs: on CUDA, unless --enforce-eager, with a backend that can be captured; else None (and
    a log line saying why, where graphs were possible)."""
    if device.type != "cuda" or config.enforce_eager:
        return None
    if config.attention_backend not in CUDA_GRAPH_BACKENDS:
        logger.info(
            "CUDA graphs off: the %s attention backend reads the step's Python lists, which a graph "
            "freezes (capturable: %s)",
            config.attention_backend,
            ", ".join(CUDA_GRAPH_BACKENDS),
        )
        return None
    sizes = capture_sizes(config.cuda_graph_sizes, config.max_num_seqs, config.max_num_batched_tokens)
    if not sizes:
        return None
    return DecodeGraphs(
        model, kv_caches, sizes, max_model_len, config.block_size, device, CudaGraphCapture(device), layout
    )
