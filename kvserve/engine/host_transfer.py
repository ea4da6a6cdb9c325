"""Host <-> device copies of a step's small tensors without stalling the GPU.

Why: `torch.tensor(list, device="cuda")` and `t.to("cuda")` from ordinary (pageable) host memory make the host wait
for the copy, and the copy waits for every kernel queued before it, so each such call is a full host-device sync.
A step that built its metadata that way would sync half a dozen times. Here a step's int64 tensors are packed into
one pinned host buffer and sent with one non_blocking copy; results come back the same way, with one wait for
all of them. On the CPU every function returns the tensors as they are (no copies, no pinned memory).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _staged(device: torch.device) -> bool:
    return device.type != "cpu"


def to_device(values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small list as a tensor on `device`; on CUDA through pinned memory and a non_blocking copy (torch's caching
    host allocator keeps the pinned block alive until the copy has run)."""
    host = torch.tensor(values, dtype=dtype)
    return host if not _staged(device) else host.pin_memory().to(device, non_blocking=True)


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` (see to_device); on the CPU, `t` itself."""
    return t if not _staged(device) else t.pin_memory().to(device, non_blocking=True)


def fetch_to_host(tensors: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Device tensors as host tensors after ONE wait: every copy is queued non_blocking into pinned memory, then the
    stream is synchronized once (the step's single host sync). CPU tensors (and None) come back as they are."""
    out: list[torch.Tensor | None] = []
    stream_device: torch.device | None = None
    for t in tensors:
        if t is None or t.device.type == "cpu":
            out.append(t)
            continue
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        out.append(host)
        stream_device = t.device
    if stream_device is not None:
        torch.cuda.current_stream(stream_device).synchronize()
    return out


class HostToDevice:
    """Moves a step's int64 host tensors to `device` in one copy.

    On CUDA (or with `staged=True`, which tests use on CPU) the tensors are packed into one host staging buffer
    (pinned on CUDA, grown as needed and kept between steps), copied with one non_blocking copy into a fresh device
    tensor, and returned as views of it in their own shapes. Before the buffer is overwritten by the next step the
    previous copy out of it must have run: an event recorded after the copy is waited on first (it has long
    completed by then, as every step ends with the sampler's host sync). Without staging (the CPU), the tensors
    are returned as they are."""

    def __init__(self, device: torch.device, staged: bool | None = None) -> None:
        self.device = device
        self.staged = _staged(device) if staged is None else staged
        self._pin = device.type == "cuda"
        self._host: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    def move(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if not self.staged:
            return list(tensors)
        if any(t.dtype != torch.int64 for t in tensors):
            raise TypeError("HostToDevice.move takes int64 tensors only (a step's ids, positions and metadata)")
        total = sum(t.numel() for t in tensors)
        host = self._buffer(total)
        offset = 0
        for t in tensors:
            host[offset : offset + t.numel()].copy_(t.reshape(-1))
            offset += t.numel()
        flat = torch.empty(total, dtype=torch.int64, device=self.device)
        flat.copy_(host[:total], non_blocking=self._pin)
        if self._pin:
            self._copied = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch's stub is untyped
            self._copied.record()
        out, offset = [], 0
        for t in tensors:
            out.append(flat[offset : offset + t.numel()].view(t.shape))
            offset += t.numel()
        return out

    def _buffer(self, numel: int) -> torch.Tensor:
        """The staging buffer, at least `numel` long, once the previous copy out of it has run."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        if self._host is None or self._host.numel() < numel:
            self._host = torch.empty(
                max(numel, 2 * (0 if self._host is None else self._host.numel())),
                dtype=torch.int64,
                pin_memory=self._pin,
            )
        return self._host
