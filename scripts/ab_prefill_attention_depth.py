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
from pathlib import Path

import torch

from kvserve.kernels.native import SIGNATURES, supported_isas
from kvserve.kernels.ops import NativeKernels, load_kernels
from kvserve.model.tokenizer import default_cache_dir

HEADS, KV_HEADS, DIM, BLOCK, LAYERS = 14, 2, 64, 16, 24


def older_build(path: Path) -> NativeKernels:
    """An older library with only its prefill attention bound (today's signature)."""
    library = ctypes.CDLL(str(path))
    function = library.kvserve_paged_prefill_attention
    function.argtypes, function.restype = SIGNATURES["kvserve_paged_prefill_attention"], None
    return NativeKernels(library, isa="old")


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
    cache_dir = default_cache_dir() / "kernels"
    builds = {"new": load_kernels(cache_dir)}
    if "avx512bf16" in supported_isas() and "avx512vnni" in supported_isas():
        builds["avx512vnni"] = load_kernels(cache_dir, isa="avx512vnni")
    if args.old:
        builds["old"] = older_build(args.old)
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    print(f"new build: {getattr(builds['new'], 'isa', 'torch')}; {args.dtype} cache, {LAYERS} layers' caches")
    for shape in args.shapes.split(","):
        seq_len, q_len = map(int, shape.split("x"))
        per = -(-seq_len // BLOCK)
        caches = [
            tuple(torch.randn(per, BLOCK, KV_HEADS, DIM, generator=g).to(dtype) for _ in range(2))
            for _ in range(LAYERS)
        ]
        table = torch.randperm(per, generator=g)
        q = torch.randn(q_len, HEADS, DIM, generator=g)
        times: dict[str, list[float]] = {name: [] for name in builds}
        for _ in range(args.repeats):
            for name, kernels in builds.items():
                start = time.perf_counter()
                for k, v in caches:
                    kernels.paged_prefill_attention(q, k, v, table, seq_len, None, DIM**-0.5)
                times[name].append(time.perf_counter() - start)
        print(f"{q_len} new x {seq_len} cached: " + ", ".join(f"{n} {1e3 * min(t):.0f} ms" for n, t in times.items()))


if __name__ == "__main__":
    main()
