"""The KV budget on a GPU, as vLLM sizes it: profile one step at its largest, then give the rest to KV blocks.

`--gpu-memory-utilization U` is the share of the device's TOTAL memory this engine may use (vLLM's meaning). After
the weights are loaded, one forward of `--max-num-batched-tokens` dummy tokens (one sequence: the largest prefill
chunk a step can hold, so also the largest attention intermediates) plus the LM head on `--max-num-seqs` rows is
run, and torch's peak allocation above what was allocated before it is the activation peak. Then

    KV bytes = U x total - weights - peak activations - non-torch memory

where non-torch memory is what the device reports as used beyond torch's reserved pool (the CUDA context, cuBLAS
workspaces, and other processes on the same device: counting them keeps this engine from taking memory that is not
free). The arithmetic is `gpu_kv_budget`, a pure function of the device facts, tested on CPU; the reading of the
facts is behind the `DeviceMemory` protocol, so that the profile itself also runs on CPU in tests with fake facts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from kvserve.attention.metadata import AttentionMetadata
from kvserve.capacity import NULL_BLOCK_ID
from kvserve.kv.cache import KVCacheConfig, allocate_kv_cache
from kvserve.model.quantization import weight_bytes
from kvserve.units import cdiv, format_gib

if TYPE_CHECKING:
    from kvserve.model.protocol import Model

logger = logging.getLogger(__name__)

# The flags that change the answer, named in every "does not fit" error.
_FLAGS_TO_CHANGE = (
    "raise --gpu-memory-utilization, lower --max-num-batched-tokens or --max-num-seqs (they size "
    "the profiled peak), use a smaller --dtype, or set the KV budget yourself with "
    "--kv-cache-memory-bytes or --num-gpu-blocks-override"
)


@dataclass(frozen=True, slots=True)
class GpuMemoryFacts:
    """What the plan needs to know about the device after the profile, in bytes."""

    total: int  # the device's memory
    weights: int  # what the loaded model holds on the device
    peak_activations: int  # torch's peak allocation during the profile, above what was allocated before it
    non_torch: int  # used on the device beyond torch's reserved pool (context, workspaces, other processes)


@dataclass(frozen=True, slots=True)
class GpuMemoryPlan:
    facts: GpuMemoryFacts
    utilization: float
    kv_bytes: int

    def describe(self) -> str:
        f = self.facts
        return (
            f"GPU memory: {self.utilization} (--gpu-memory-utilization) x {format_gib(f.total)} total - "
            f"{format_gib(f.weights)} weights - {format_gib(f.peak_activations)} peak activations - "
            f"{format_gib(f.non_torch)} non-torch = {format_gib(self.kv_bytes)} for the KV cache"
        )


def gpu_kv_budget(facts: GpuMemoryFacts, utilization: float, bytes_per_block: int) -> GpuMemoryPlan:
    """utilization x total - weights - peak activations - non-torch, in bytes for KV blocks. A budget that does not
    hold two blocks (the null block and one usable) is an error naming every number and the flags to change."""
    # capacity.budget_from_memory's rule (what `kvserve estimate --memory` assumes), with the overhead measured
    kv = int(facts.total * utilization) - facts.weights - facts.peak_activations - facts.non_torch
    plan = GpuMemoryPlan(facts, utilization, kv)
    if kv < 2 * bytes_per_block:
        raise ValueError(
            f"not enough GPU memory for the KV cache: {plan.describe()}, and the cache needs at least "
            f"2 blocks of {bytes_per_block} bytes; {_FLAGS_TO_CHANGE}"
        )
    return plan


class DeviceMemory(Protocol):
    """The device's memory counters (torch.cuda's on a GPU; fakes in tests)."""

    def total_and_free(self) -> tuple[int, int]: ...
    def allocated(self) -> int: ...
    def reserved(self) -> int: ...
    def reset_peak(self) -> None: ...
    def peak_allocated(self) -> int: ...


@dataclass(frozen=True, slots=True)
class CudaMemory:
    """DeviceMemory of one CUDA device."""

    device: torch.device

    def total_and_free(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self.device)
        return total, free

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # so that `reserved` after the profile is what the engine keeps, not leftovers
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_allocated(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)


@torch.inference_mode()
def dummy_step(model: Model, spec: KVCacheConfig, num_tokens: int, num_logit_rows: int, device: torch.device) -> None:
    """One forward of `num_tokens` tokens as one sequence (into a scratch KV cache just big enough), then the LM
    head on `num_logit_rows` rows: the largest step the scheduler can make, for the activation peak."""
    blocks = cdiv(num_tokens, spec.block_size)
    caches = allocate_kv_cache(spec, blocks + 1, device)  # + the null block, which the table never names
    table = [b for b in range(blocks + 1) if b != NULL_BLOCK_ID]
    meta = AttentionMetadata.build([table], [num_tokens], [num_tokens], spec.block_size, device)
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    positions = torch.arange(num_tokens, dtype=torch.int64, device=device)
    hidden = model(ids, positions, caches, meta)
    model.compute_logits(hidden[-1:].expand(num_logit_rows, -1).contiguous())


def profile_gpu_memory(
    model: Model,
    spec: KVCacheConfig,
    num_tokens: int,
    num_logit_rows: int,
    device: torch.device,
    memory: DeviceMemory,
) -> GpuMemoryFacts:
    """Run `dummy_step` and read the facts `gpu_kv_budget` needs."""
    memory.reset_peak()
    before = memory.allocated()
    logger.info(
        "profiling one step of %d tokens (--max-num-batched-tokens) and %d LM-head rows (--max-num-seqs) "
        "for the KV budget",
        num_tokens,
        num_logit_rows,
    )
    dummy_step(model, spec, num_tokens, num_logit_rows, device)
    peak = max(memory.peak_allocated() - before, 0)
    total, free = memory.total_and_free()
    return GpuMemoryFacts(
        total=total,
        weights=weight_bytes(model),
        peak_activations=peak,
        non_torch=max(total - free - memory.reserved(), 0),
    )
