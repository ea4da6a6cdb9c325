"""Decode attention at Qwen2.5-0.5B's shapes (14 query heads over 2 KV heads of 64) for one sequence over a long
context, over 24 layers' caches so that K and V come from memory as in the model: one decode step's attention. The
figures of docs/PERFORMANCE_NOTES.md's decode-at-depth attempts: the avx512bf16 build's bfloat16 dot products against
the avx512vnni build (which widens a bfloat16 cache to float32 in registers), on the same cache; with OLD.so, this
build against an older one (as in scripts/ab_prefill_attention_depth.py); with --pages both, the caches on huge pages
(as the engine allocates them, kvserve/kv/huge_pages.py) against the same caches on 4 KiB pages. Fastest and median of
alternated repeats (on a noisy VM, medians of a few hundred repeats told 5-10% apart where the fastest did not: a
step's attention takes tens of ms, so --repeats 200 costs under a minute). Not run by CI.

Usage: python scripts/ab_decode_attention_depth.py [--old OLD.so] [--dtype bfloat16|float32|float16]
           [--contexts 4096,16384,32000] [--pages huge|small|both]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_prefill_attention_depth import DIM, HEADS, LAYERS, kernel_builds, layer_caches

from kvserve.kernels.ops import NativeKernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path, default=None, help="an older kernel library to compare with")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--contexts", default="4096,16384,32000", help="cached tokens, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pages", default="huge", choices=["huge", "small", "both"], help="the caches' pages")
    args = parser.parse_args()
    builds = kernel_builds(args.old, "kvserve_paged_decode_attention")
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    print(f"new build: {builds['new'].isa}; {args.dtype} cache, {LAYERS} layers' caches")
    pages = {"huge": [True], "small": [False], "both": [True, False]}[args.pages]
    for seq_len in map(int, args.contexts.split(",")):
        caches = {huge: layer_caches(seq_len, dtype, torch.Generator().manual_seed(seq_len), huge) for huge in pages}
        table = torch.randperm(caches[pages[0]][0][0].shape[0], generator=g).view(1, -1)
        lens = torch.tensor([seq_len], dtype=torch.int64)
        q = torch.randn(1, HEADS, DIM, generator=g)
        runs = {
            f"{name}{'' if len(pages) == 1 else ' huge pages' if huge else ' 4 KiB pages'}": (kernels, caches[huge])
            for name, kernels in builds.items()
            for huge in pages
        }

        def run(kernels: NativeKernels, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
            for k, v in layers:
                kernels.paged_decode_attention(q, k, v, table, lens, None, DIM**-0.5)  # noqa: B023

        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.repeats):
            for name, (kernels, layers) in runs.items():
                start = time.perf_counter()
                run(kernels, layers)
                times[name].append(time.perf_counter() - start)
        print(
            f"{seq_len} cached, fastest / median: "
            + ", ".join(f"{n} {1e3 * min(t):.2f} / {1e3 * statistics.median(t):.2f} ms" for n, t in times.items())
        )


if __name__ == "__main__":
    main()
