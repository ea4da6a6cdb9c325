"""KVOffloadConfig: vLLM's `--kv-offloading-size` / `--kv-offloading-backend`, and kvserve's `--kv-offloading-path`.

Why its own module: the flags are parsed and checked where the engine's config is built (kvserve/config.py), which
must not import the tier's threads, files and torch code (kv/offload/tier.py) to do it."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from kvserve.units import GiB, MiB, format_bytes, parse_size

# vLLM's backends: "native" (its own offloading connector, and the one kvserve implements) and "lmcache".
OFFLOAD_BACKENDS: tuple[str, ...] = ("native", "lmcache")
# How the tier stores a block: "auto", the cache's own dtype (a restore is bit-exact), or "int8", 8 bits a value with
# a float32 scale per token and KV head (about 4x the blocks of a float32 cache; a restore is close, not exact).
OFFLOAD_DTYPES: tuple[str, ...] = ("auto", "int8")


# More bytes than any machine's memory or disk: a size past it is a slip (`1e12` is 10^12 GiB, a bare number being GiB).
_MAX_SIZE = 1 << 63


def parse_offloading_size(value: str | int | float) -> int:
    """vLLM's meaning for a bare number, GiB (`16`, `0.5`); kvserve also takes a unit (`16GiB`, `512MiB`). Anything
    that is no size a machine has (inf, nan, 1e400, 10^12 GiB) is a ValueError naming the flag, never an
    OverflowError's traceback."""
    number: float | None
    if isinstance(value, bool):
        number = None
    elif isinstance(value, (int, float)):
        number = float(value)
    else:
        try:
            number = float(str(value).strip())
        except ValueError:
            number = None
    if number is None:
        try:
            size = parse_size(str(value))
        except ValueError as e:
            raise ValueError(f"--kv-offloading-size: {e}") from None
    elif not math.isfinite(number) or abs(number) * GiB >= _MAX_SIZE:
        raise ValueError(
            f"--kv-offloading-size {value!r} is no size a machine has (a bare number is GiB, as in vLLM): pass a "
            "number of GiB such as 16, or a size with its unit such as 512MiB"
        )
    else:
        size = int(number * GiB)
    if size <= 0:
        raise ValueError(f"--kv-offloading-size must be positive, got {value!r}")
    if size >= _MAX_SIZE:
        raise ValueError(f"--kv-offloading-size {value!r} is no size a machine has")
    return size


def check_host_tier_fits(config: KVOffloadConfig | None, available: int | None, pool_bytes: int) -> None:
    """A tier in host memory must fit in the machine's available memory beside the KV pool (`pool_bytes`: its size on
    CPU, 0 where the pool is in device memory), checked before either is allocated, as the pool alone is
    (engine/build.py plan_cache): else the allocator fails with a traceback, or the machine swaps. `available` None:
    unknown (not Linux), not checked."""
    if config is None or config.path is not None or available is None:
        return
    if config.size_bytes + pool_bytes <= available:
        return
    room = available - pool_bytes
    pool = f" and the KV cache's {format_bytes(pool_bytes)}" if pool_bytes else ""
    hint = f"pass a smaller size, e.g. {room // 2 // MiB}MiB, " if room >= 2 * MiB else ""
    raise ValueError(
        f"--kv-offloading-size {format_bytes(config.size_bytes)} (a tier in host memory){pool} exceed this machine's "
        f"available memory ({format_bytes(available)}); {hint}or put the tier on disk with --kv-offloading-path"
    )


@dataclass(frozen=True, slots=True)
class KVOffloadConfig:
    """The tier's settings. `path` None: the tier lives in this process's memory (lost at exit); a directory: on disk
    there, shared by every process that uses it with the same model and settings, and kept across restarts.
    `size_bytes` bounds what the tier holds (its memory, or its disk budget), least recently used first out."""

    size_bytes: int
    path: Path | None = None
    backend: str = "native"
    dtype: str = "auto"
    # Stored records waiting for the disk writer, at most; past it a block is dropped (counted), never waited for.
    max_queued_bytes: int = 256 * MiB
    # --kv-offloading-allow-other-writers: use a directory other users can write, or another user's (refused
    # otherwise: whoever can write there can plant records that pass every check; kv/offload/safedir.py).
    allow_other_writers: bool = False

    def __post_init__(self) -> None:
        if self.size_bytes <= 0:
            raise ValueError(f"--kv-offloading-size must be positive, got {self.size_bytes}")
        if self.backend not in OFFLOAD_BACKENDS:
            raise ValueError(
                f"--kv-offloading-backend must be one of {', '.join(OFFLOAD_BACKENDS)}, got {self.backend!r}"
            )
        if self.backend == "lmcache":
            raise ValueError(
                "--kv-offloading-backend lmcache is not available in kvserve: LMCache is a GPU-side library for vLLM; "
                "use native (the default), kvserve's own tier in host memory or, with --kv-offloading-path, on disk"
            )
        if self.dtype not in OFFLOAD_DTYPES:
            raise ValueError(f"--kv-offloading-dtype must be one of {', '.join(OFFLOAD_DTYPES)}, got {self.dtype!r}")
        if self.max_queued_bytes <= 0:
            raise ValueError(f"max_queued_bytes must be positive, got {self.max_queued_bytes}")
        if self.allow_other_writers and self.path is None:
            raise ValueError("--kv-offloading-allow-other-writers needs --kv-offloading-path (it is about a directory)")

    @property
    def medium(self) -> str:
        """Where the tier keeps blocks, in vLLM's KV-event terms: "CPU" (host memory) or "DISK"."""
        return "CPU" if self.path is None else "DISK"


def make_offload_config(
    size: str | int | float | None,
    path: str | Path | None = None,
    backend: str | None = None,
    dtype: str = "auto",
    allow_other_writers: bool = False,
) -> KVOffloadConfig | None:
    """The config of the flags; None (no tier) without a size. A path, backend or other flag without a size is an
    error, not a silent no-op."""
    if size is None:
        if path is not None:
            raise ValueError(
                "--kv-offloading-path needs --kv-offloading-size (the tier's disk budget, e.g. 16 for 16 GiB)"
            )
        if backend not in (None, "native"):
            raise ValueError("--kv-offloading-backend needs --kv-offloading-size")
        if dtype != "auto":
            raise ValueError("--kv-offloading-dtype needs --kv-offloading-size")
        if allow_other_writers:
            raise ValueError("--kv-offloading-allow-other-writers needs --kv-offloading-size and --kv-offloading-path")
        return None
    return KVOffloadConfig(
        size_bytes=parse_offloading_size(size),
        path=None if path is None else Path(path).expanduser(),
        backend=backend or "native",
        dtype=dtype,
        allow_other_writers=allow_other_writers,
    )


def split_for_state_snapshots(
    config: KVOffloadConfig, pool_block_bytes: int, pool_snapshot_bytes: int, snapshot_bytes: int
) -> tuple[KVOffloadConfig, KVOffloadConfig | None]:
    """A hybrid model's tier in two: its blocks' share and its state snapshots' (kv/state.py), in the proportions the
    pool splits its budget between them (LFM2-350M: ~2% for snapshots; Qwen3.5-0.8B, whose 19 MiB states dwarf its
    blocks: about half), with room for at least 4 snapshots where that takes at most half the size. The writers' queue
    is split alike. None for the snapshots: the tier has no room for 4 (then only the pool's snapshots serve hits)."""
    total = pool_block_bytes + pool_snapshot_bytes
    share = pool_snapshot_bytes / total if total else 0.0
    state_size, least = int(config.size_bytes * share), 4 * snapshot_bytes
    if state_size < least:
        if least > config.size_bytes // 2:
            return config, None
        state_size = least
    queued = max(int(config.max_queued_bytes * share), 4 * snapshot_bytes)
    return replace(config, size_bytes=config.size_bytes - state_size), replace(
        config, size_bytes=state_size, max_queued_bytes=queued
    )
