"""Decode attention at Qwen2.5-0.5B's shapes (14 query heads over 2 KV heads of 64) for one sequence over a long
context, over 24 layers' caches so that K and V come from memory as in the model: one decode step's attention. The
figures of docs/PERFORMANCE_NOTES.md's decode-at-depth attempts: the avx512bf16 build's bfloat16 dot products against
the avx512vnni build (which widens a bfloat16 cache to float32 in registers), on the same cache; with OLD.so, this
build against an older one (as in scripts/ab_prefill_attention_depth.py). Fastest of alternated repeats. Not run by CI.

Usage: python scripts/ab_decode_attention_depth.py [--old OLD.so] [--dtype bfloat16|float32|float16]
           [--contexts 4096,16384,32000]
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
    """An older library with only its decode attention bound (today's signature)."""
    library = ctypes.CDLL(str(path))
    function = library.kvserve_paged_decode_attention
    function.argtypes, function.restype = SIGNATURES["kvserve_paged_decode_attention"], None
    return NativeKernels(library, isa="old")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path, default=None, help="an older kernel library to compare with")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--contexts", default="4096,16384,32000", help="cached tokens, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
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
    for seq_len in map(int, args.contexts.split(",")):
        per = -(-seq_len // BLOCK)
        caches = [
            tuple(torch.randn(per, BLOCK, KV_HEADS, DIM, generator=g).to(dtype) for _ in range(2))
            for _ in range(LAYERS)
        ]
        table = torch.randperm(per, generator=g).view(1, per)
        lens = torch.tensor([seq_len], dtype=torch.int64)
        q = torch.randn(1, HEADS, DIM, generator=g)
        times: dict[str, list[float]] = {name: [] for name in builds}
        for _ in range(args.repeats):
            for name, kernels in builds.items():
                start = time.perf_counter()
                for k, v in caches:
                    kernels.paged_decode_attention(q, k, v, table, lens, None, DIM**-0.5)
                times[name].append(time.perf_counter() - start)
        print(f"{seq_len} cached: " + ", ".join(f"{n} {1e3 * min(t):.2f} ms" for n, t in times.items()))


if __name__ == "__main__":
    main()
