"""Prefill attention at Qwen2.5-0.5B's shapes (14 query heads over 2 KV heads of 64): an agent's new tokens over a long
cached context, over 24 layers' caches so that K and V come from memory as in the model. The figures of
docs/PERFORMANCE_NOTES.md attempts 63-64: the avx512bf16 build's bfloat16 dot products against the avx512vnni build
(which widens a bfloat16 cache to float32), on the same bfloat16 cache; and, with OLD.so, this build against an older
one (check out the commit before the change, run `pytest tests/unit/test_kernels.py -k prefill` once, and take the
newest ~/.cache/kvserve/kernels/kvserve_kernels_*.so; e.g. the commit before 7a36d39 for attempt 64's row tiles).
Fastest of alternated repeats. Not run by CI.

Usage: python scripts/ab_prefill_attention_depth.py [--old OLD.so] [--dtype bfloat16|float32] [--shapes 9000x90,...]
"""

from __future__ import annotations

import argparse
import ctypes
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvserve.kernels.native import SIGNATURES, supported_isas
from kvserve.kernels.ops import NativeKernels, load_kernels
from kvserve.kv.huge_pages import empty_huge
from kvserve.model.tokenizer import default_cache_dir

HEADS, KV_HEADS, DIM, BLOCK, LAYERS = 14, 2, 64, 16, 24


def kernel_builds(old: Path | None, entry: str) -> dict[str, NativeKernels]:
    """This build ("new"); the avx512vnni build where the CPU also has AVX512_BF16 (it widens a bfloat16 cache); and
    with `old`, an older library with only its `entry` bound (today's signature). Shared with
    scripts/ab_decode_attention_depth.py."""
    cache_dir = default_cache_dir() / "kernels"
    builds: dict[str, NativeKernels] = {}
    for name, isa in (("new", None), ("avx512vnni", "avx512vnni")):
        if isa is None or {"avx512bf16", isa} <= set(supported_isas()):
            kernels = load_kernels(cache_dir, isa=isa)
            if not isinstance(kernels, NativeKernels):
                raise SystemExit("the native kernels did not build on this machine")
            builds[name] = kernels
    if old:
        library = ctypes.CDLL(str(old))
        function = getattr(library, entry)
        function.argtypes, function.restype = SIGNATURES[entry], None
        builds["old"] = NativeKernels(library, isa="old")
    return builds


def layer_caches(
    seq_len: int, dtype: torch.dtype, g: torch.Generator, huge_pages: bool = True
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """LAYERS layers' K and V caches of seq_len random tokens (the callers shuffle the block table), on huge pages
    as the engine allocates them (kv/huge_pages.py) or, with huge_pages=False, on the default 4 KiB pages."""
    shape = (-(-seq_len // BLOCK), BLOCK, KV_HEADS, DIM)

    def cache() -> torch.Tensor:
        t = empty_huge(shape, dtype, torch.device("cpu")) if huge_pages else torch.empty(shape, dtype=dtype)
        return t.copy_(torch.randn(shape, generator=g))

    return [(cache(), cache()) for _ in range(LAYERS)]


def fastest_alternated(
    builds: dict[str, NativeKernels], repeats: int, run: Callable[[NativeKernels], None]
) -> dict[str, float]:
    """Each build's fastest of `repeats` timings of run(kernels), the builds alternated within each repeat."""
    times: dict[str, list[float]] = {name: [] for name in builds}
    for _ in range(repeats):
        for name, kernels in builds.items():
            start = time.perf_counter()
            run(kernels)
            times[name].append(time.perf_counter() - start)
    return {name: min(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path, default=None, help="an older kernel library to compare with")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the KV cache's dtype")
    parser.add_argument(
        "--shapes",
        default="9000x61,9000x90,19000x52,19000x17,16000x512,4000x300",
        help="CONTEXTxNEW: cached keys and new queries",
    )
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    builds = kernel_builds(args.old, "kvserve_paged_prefill_attention")
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    print(f"new build: {builds['new'].isa}; {args.dtype} cache, {LAYERS} layers' caches")
    for shape in args.shapes.split(","):
        seq_len, q_len = map(int, shape.split("x"))
        caches = layer_caches(seq_len, dtype, g)
        table = torch.randperm(caches[0][0].shape[0], generator=g)
        q = torch.randn(q_len, HEADS, DIM, generator=g)

        def run(kernels: NativeKernels) -> None:
            for k, v in caches:  # noqa: B023 - run is called in this iteration only
                kernels.paged_prefill_attention(q, k, v, table, seq_len, None, DIM**-0.5)  # noqa: B023

        best = fastest_alternated(builds, args.repeats, run)
        print(f"{q_len} new x {seq_len} cached: " + ", ".join(f"{n} {1e3 * t:.0f} ms" for n, t in best.items()))


if __name__ == "__main__":
    main()
