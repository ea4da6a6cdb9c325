"""One layer's decode attention on the paged cache (`NativeKernels.paged_decode_attention`) for BATCH sequences of
CONTEXT tokens on the default model's shape (4 query heads over 1 KV head of 256), K/V blocks shuffled as a busy
cache leaves them: the minimum over repeated calls, and the K/V bytes read per second. The figure quoted in
docs/PERFORMANCE_NOTES.md attempt 35. Not run by CI.

Usage: OMP_NUM_THREADS=2 python scripts/bench_decode_attention.py [--batch 32] [--context 140,1000]
"""

from __future__ import annotations

import argparse
import time

import torch

from kvserve.kernels.ops import NativeKernels, load_kernels
from kvserve.model.tokenizer import default_cache_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", default="140,1000", help="comma-separated context lengths")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()
    kernels = load_kernels(default_cache_dir() / "kernels")
    if not isinstance(kernels, NativeKernels):
        raise SystemExit("the native kernels did not build on this machine")
    g = torch.Generator().manual_seed(0)
    for context in map(int, args.context.split(",")):
        per_seq = -(-context // args.block_size)
        blocks = args.batch * per_seq + 1  # block 0 is the table padding
        shape = (blocks, args.block_size, args.kv_heads, args.head_dim)
        k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        tables = (torch.randperm(blocks - 1, generator=g) + 1).view(args.batch, per_seq)
        q = torch.randn(args.batch, args.heads, args.head_dim, generator=g)
        lens = torch.full((args.batch,), context, dtype=torch.int64)
        scale = args.head_dim**-0.5
        kernels.paged_decode_attention(q, k, v, tables, lens, None, scale)
        best = float("inf")
        for _ in range(args.calls):
            start = time.perf_counter()
            kernels.paged_decode_attention(q, k, v, tables, lens, None, scale)
            best = min(best, time.perf_counter() - start)
        kv_bytes = 2 * args.batch * context * args.kv_heads * args.head_dim * 4
        print(
            f"batch {args.batch}, context {context}: {best * 1e3:.3f} ms, {kv_bytes / 1e6:.1f} MB of K/V, "
            f"{kv_bytes / 1e9 / best:.1f} GB/s"
        )


if __name__ == "__main__":
    main()
