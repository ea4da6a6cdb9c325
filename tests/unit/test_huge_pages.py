"""kv/huge_pages.py: the KV cache's host tensors are carved at 2 MiB boundaries and advised for transparent huge
pages before their first touch; small tensors, devices and systems without madvise get a plain torch.empty."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kvserve.kv.cache import KVCacheConfig, allocate_kv_cache
from kvserve.kv.huge_pages import HUGE_PAGE_BYTES, advise_huge_pages, empty_huge

CPU = torch.device("cpu")
LINUX_THP = sys.platform.startswith("linux") and Path("/sys/kernel/mm/transparent_hugepage/enabled").exists()


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_large_host_tensor_is_aligned_contiguous_and_holds_data(dtype: torch.dtype) -> None:
    shape = (300, 16, 2, 64)  # 0.6 / 1.2 / 2.4 MiB: only float32 is over the threshold (carved); the rest plain
    t = empty_huge(shape, dtype, CPU)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    nbytes = t.numel() * t.element_size()
    if nbytes >= HUGE_PAGE_BYTES and LINUX_THP:
        assert t.data_ptr() % HUGE_PAGE_BYTES == 0
    values = torch.arange(t.numel()).remainder(100).to(dtype).view(shape)
    t.copy_(values)
    assert torch.equal(t, values)
    assert torch.equal(t[7, 3], values[7, 3])


def test_small_tensor_is_plain() -> None:
    t = empty_huge((4, 16, 1, 64), torch.float32, CPU)
    assert t.shape == (4, 16, 1, 64) and t.is_contiguous()
    assert t.untyped_storage().nbytes() == t.numel() * 4  # no slack around it


@pytest.mark.skipif(not LINUX_THP, reason="transparent huge pages are a Linux feature")
def test_the_range_is_advised_for_huge_pages() -> None:
    """The kernel marks an advised mapping `hg` (MADV_HUGEPAGE) in /proc/self/smaps, whatever it later backs it with."""
    t = empty_huge((8 * HUGE_PAGE_BYTES,), torch.uint8, CPU)
    if "[never]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text():
        pytest.skip("THP is set to never here")
    assert "hg" in _vm_flags(t.data_ptr())
    assert "hg" in _vm_flags(t.data_ptr() + t.numel() - 1)


def test_advice_is_refused_quietly_for_an_unaligned_range() -> None:
    """madvise takes page-aligned ranges only: a refusal is a False, never an exception (huge pages are a speed-up)."""
    buffer = torch.empty(2 * HUGE_PAGE_BYTES, dtype=torch.uint8)
    assert advise_huge_pages(buffer.data_ptr() | 1, 4096) is False


def test_kv_cache_tensors_are_on_huge_page_boundaries() -> None:
    spec = KVCacheConfig(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16)
    caches = allocate_kv_cache(spec, 600, CPU)  # 600 blocks x 4 KiB: 2.3 MiB a tensor
    for cache in caches:
        for t in (cache.key, cache.value):
            assert t.shape == (600, 16, 2, 64) and t.is_contiguous()
            if LINUX_THP:
                assert t.data_ptr() % HUGE_PAGE_BYTES == 0
