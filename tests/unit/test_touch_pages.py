"""#43 item 16: the offload tier's start-up page touching (kv/cache.py touch_pages) took 29 s for 4.25 GiB on a busy
host with nothing on screen; it now shows a progress bar in bytes (for caches of a GiB or more), zeroing in chunks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvserve.kv import cache


class Bar:
    """tqdm's interface as touch_pages uses it, recording what it was told."""

    made: list[Bar] = []

    def __init__(self, total: int, disable: bool = False, **kwargs: Any) -> None:
        self.total, self.disable, self.counted, self.updates = total, disable, 0, 0
        Bar.made.append(self)

    def __enter__(self) -> Bar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def update(self, n: int) -> None:
        self.counted += n
        self.updates += 1


@pytest.fixture
def bars(monkeypatch: pytest.MonkeyPatch) -> list[Bar]:
    made: list[Bar] = []
    monkeypatch.setattr(Bar, "made", made)
    monkeypatch.setattr(cache, "tqdm", Bar)
    return made


def test_touching_shows_its_bytes_in_chunks_and_zeroes_every_one(bars: list[Bar], monkeypatch) -> None:
    monkeypatch.setattr(cache, "_TOUCH_CHUNK_BYTES", 1024)
    monkeypatch.setattr(cache, "_TOUCH_PROGRESS_MIN_BYTES", 0)
    big, small = torch.ones(10, 100), torch.ones(3, dtype=torch.int8)  # 4,000 bytes: 4 chunks; 3 bytes: 1
    strided = torch.ones(8, 8)[:, ::2]  # not contiguous: touched whole
    device = torch.ones(4, device="meta")  # not host memory: left alone
    assert cache.touch_pages([big, small, strided, device]) == 4000 + 3 + 128
    assert not big.any() and not small.any() and not strided.any()
    (bar,) = bars
    assert (bar.total, bar.counted, bar.updates, bar.disable) == (4131, 4131, 6, False)


def test_small_caches_show_no_bar(bars: list[Bar]) -> None:
    t = torch.ones(16)
    cache.touch_pages([t])
    assert not t.any() and [b.disable for b in bars] == [True]
