"""GFLOP/s of the q8_0 matmul kernel on the default model's shapes (the LM head and the four body projections) at
several batch sizes, minimum of repeated calls into a reused output: the per-shape figures of
docs/PERFORMANCE_NOTES.md. Not run by CI.

Usage: python scripts/bench_q8_matmul.py [--rows 1,8,32,64,512]
"""

from __future__ import annotations

import argparse
import time

import torch

from kvserve.kernels.ops import NativeKernels, load_kernels
from kvserve.kernels.q8 import quantize_q8
from kvserve.model.tokenizer import default_cache_dir

SHAPES = {
    "LM head": (262_144, 640),
    "qkv": (1536, 640),
    "gate_up": (4096, 640),
    "o_proj": (640, 1024),
    "down": (640, 2048),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,32,64,512")
    args = parser.parse_args()
    kernels = load_kernels(default_cache_dir() / "kernels")
    if not isinstance(kernels, NativeKernels):
        raise SystemExit("the native kernels did not build here")
    for name, (n, k) in SHAPES.items():
        q, s = quantize_q8(torch.randn(n, k))
        for m in map(int, args.rows.split(",")):
            if n > 100_000 and m > 64:
                continue  # the LM head runs on sampled rows only
            x, out = torch.randn(m, k), torch.empty(m, n)
            best = float("inf")
            for _ in range(5 if n > 100_000 else 20):
                start = time.perf_counter()
                kernels.q8_matmul(x, q, s, out)
                best = min(best, time.perf_counter() - start)
            gflops = 2 * m * n * k / best / 1e9
            print(f"{name:8} {n:>7} x {k:<5} rows {m:>4}: {1e3 * best:8.3f} ms  {gflops:6.1f} GFLOP/s")


if __name__ == "__main__":
    main()
