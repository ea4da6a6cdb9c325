"""The gated delta rule's recurrence (kernels/recurrent.cpp) on Qwen3.5-0.8B's shapes: a prefill of N tokens of one
sequence and a decode step, per layer (16 value heads of 128 x 128), with the flop rate it reaches; docs/MODELS.md and
docs/BENCHMARKS.md quote it. Median of repeats, native kernels. Not run by CI.

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


if __name__ == "__main__":
    main()
