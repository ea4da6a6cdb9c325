"""Host tensors on transparent huge pages (2 MiB) for the KV cache, and for the GGUF weights the native kernels
interleave at load (NativeKernels.interleave_rows: a new tensor, where the file's numpy copies are on huge pages
by numpy's own advice).

Why: decode attention walks a sequence's blocks in block-table order, which in memory is any order, and a block of a
KV head's rows is a few KiB, so with 4 KiB pages nearly every block is its own TLB miss (under a hypervisor a
two-level page walk), and the hardware prefetchers stop at page edges. One step at 16k tokens touches ~50,000 such
pages on Qwen2.5-0.5B's shapes. On a 2-core Zen 3 VM, where that attention is bound by its arithmetic rather than its
misses, one decode step's attention over 16k cached tokens (24 layers' bfloat16 caches in shuffled block order) took
2-5% less on huge pages, alternated in one process (`scripts/ab_decode_attention_depth.py --pages both`;
docs/PERFORMANCE_NOTES.md attempt 72).

How: the tensor is carved from a byte buffer 2 MiB longer at a 2 MiB boundary, and the range is advised with
madvise(MADV_HUGEPAGE) before anything touches it, so that its first-touch faults map huge pages wherever the
kernel's THP mode is `madvise` (the usual default) or `always` (under `never` the advice changes nothing). Off Linux, on
a device, or for a tensor under 2 MiB it is a plain torch.empty. The slack past the tensor is never touched, so it
costs address space, not memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
from collections.abc import Callable
from functools import cache

import torch

from kvserve.units import MiB

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 * MiB
_MADV_HUGEPAGE = 14  # <linux/mman.h> (the same value on every Linux architecture)


@cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise, typed; None off Linux or where libc cannot be found."""
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    fn = ctypes.CDLL(name, use_errno=True).madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def advise_huge_pages(address: int, length: int) -> bool:
    """madvise(MADV_HUGEPAGE) over [address, address + length), which must start on a page; False where the call is
    unavailable or refused (a kernel without THP answers EINVAL), with a debug line: huge pages are a speed-up, never
    a requirement."""
    madvise = _madvise()
    if madvise is None:
        return False
    if madvise(address, length, _MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) refused: errno %d", ctypes.get_errno())
        return False
    return True


def empty_huge(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.empty(shape, dtype, device), on huge pages where it is a host tensor of at least HUGE_PAGE_BYTES and the
    OS takes the advice (see the module's docstring); contiguous, its data 2 MiB-aligned, not zero-filled."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if device.type != "cpu" or nbytes < HUGE_PAGE_BYTES or _madvise() is None:
        return torch.empty(shape, dtype=dtype, device=device)
    buffer = torch.empty(nbytes + HUGE_PAGE_BYTES, dtype=torch.uint8)
    offset = -buffer.data_ptr() % HUGE_PAGE_BYTES
    region = buffer[offset : offset + nbytes]
    advise_huge_pages(region.data_ptr(), nbytes)
    return region.view(dtype).view(shape)
