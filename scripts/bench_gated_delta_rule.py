"""The gated delta rule's recurrence (kernels/recurrent.cpp) on Qwen3.5-0.8B's shapes: a prefill of N tokens of one
sequence and a decode step, per layer (16 value heads of 128 x 128), with the flop rate it reaches; beside it, what
the chunked form's matrix products alone cost on the same shapes through torch's BLAS (chunks of 64: per chunk and
head W S, Q S and K^T V of [64, 128] x [128, 128], and the six [64, 64] products of the intra-chunk part; its
triangular solve and element-wise work not counted), the floor under a chunked prefill on this CPU. docs/MODELS.md
and docs/BENCHMARKS.md quote it. Median of repeats, native kernels. Not run by CI.

Usage: python scripts/bench_gated_delta_rule.py [--tokens 512] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from kvserve.kernels.ops import load_kernels


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--layers", type=int, default=18, help="Gated DeltaNet layers of the model (Qwen3.5-0.8B: 18)")
    args = p.parse_args()
    kernels = load_kernels(Path.home() / ".cache" / "kvserve" / "kernels")
    t, heads, key_dim, value_dim = args.tokens, 16, 128, 128
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(t, heads, key_dim, generator=g), torch.randn(t, heads, key_dim, generator=g)
    v = torch.randn(t, heads, value_dim, generator=g)
    decay, beta = -torch.rand(t, heads, generator=g), torch.rand(t, heads, generator=g)
    states, slots = torch.zeros(1, heads, key_dim, value_dim), torch.tensor([0])

    def timed(n: int, continues: bool) -> float:
        runs = []
        for _ in range(args.repeats + 1):
            start = time.perf_counter()
            kernels.gated_delta_rule(q[:n], k[:n], v[:n], decay[:n], beta[:n], states, slots, [0, n], [continues])
            runs.append(time.perf_counter() - start)
        return statistics.median(runs[1:]) * 1000

    prefill, step = timed(t, False), timed(1, True)
    gflops = 4 * key_dim * value_dim * heads * t / prefill / 1e6
    print(
        f"{kernels.name}: prefill of {t} tokens {prefill:.1f} ms a layer ({gflops:.1f} GFLOP/s), "
        f"x {args.layers} layers = {prefill * args.layers:.0f} ms; decode step {step:.3f} ms a layer"
    )
    chunked = chunked_matmuls_ms(t, heads, key_dim, value_dim, args.repeats)
    print(f"the chunked form's matrix products alone (torch, chunks of 64): {chunked:.1f} ms a layer")


def chunked_matmuls_ms(tokens: int, heads: int, key_dim: int, value_dim: int, repeats: int, chunk: int = 64) -> float:
    """The matrix products a chunked gated delta rule does for `tokens` tokens, timed through torch's BLAS."""
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(heads, chunk, key_dim, generator=g)  # W, Q or K of a chunk
    cols = torch.randn(heads, key_dim, chunk, generator=g)  # K^T
    state = torch.randn(heads, key_dim, value_dim, generator=g)
    values = torch.randn(heads, chunk, value_dim, generator=g)
    square = torch.randn(heads, chunk, chunk, generator=g)  # the masked intra-chunk matrices
    runs = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for _ in range(-(-tokens // chunk)):
            torch.bmm(rows, state)  # W S
            torch.bmm(rows, state)  # Q S
            torch.baddbmm(state, cols, values)  # S += K^T v_new
            for _ in range(3):  # K K^T, Q K^T, and the WY form's K K^T
                torch.bmm(rows, cols)
            torch.bmm(square, values)  # U
            torch.bmm(square, rows)  # W
            torch.bmm(square, values)  # (Q K^T) v_new
        runs.append(time.perf_counter() - start)
    return statistics.median(runs[1:]) * 1000


if __name__ == "__main__":
    main()
