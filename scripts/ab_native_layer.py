"""One forward of the default model through the native layer path (kernels/decoder_layer.cpp) and through the
torch modules, alternated in rounds in one process (minimum of each printed): a prefill of N tokens, or with
--decode N sequences of one new token at a 65-token context. Also prints the largest difference between the two
paths' hidden states. The prefill figures of docs/PERFORMANCE_NOTES.md attempt 31. Not run by CI.

Usage: python scripts/ab_native_layer.py N [--decode] [--quantization q8_0|none|gguf] [--rounds 6]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from kvserve.attention.metadata import AttentionMetadata
from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine

BLOCK = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("n", type=int)
    parser.add_argument("--decode", action="store_true")
    parser.add_argument("--quantization", default="q8_0")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    engine = LLMEngine.from_config(
        EngineConfig(kv_cache_memory_bytes=1 << 29, quantization=args.quantization, block_size=BLOCK)
    )
    runner, n = engine.core.runner, args.n
    model, kernels = runner.model, runner.model.kernels
    if args.decode:  # n sequences of 65 tokens, the last one new (the cache holds whatever it holds: timing only)
        tables = [list(range(1 + 5 * i, 6 + 5 * i)) for i in range(n)]
        shape = (tables, [65] * n, [1] * n)
        pos = torch.full((n,), 64)
    else:
        shape = ([list(range(1, n // BLOCK + 2))], [n], [n])
        pos = torch.arange(n)
    ids = torch.arange(100, 100 + n)
    best: dict[str, float] = {}
    hidden: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for mode in ("native", "torch"):
                if mode == "torch":
                    model.use_torch_layers()
                else:
                    model.use_kernels(kernels)
                meta = AttentionMetadata.build(*shape, BLOCK, torch.device("cpu"))
                start = time.perf_counter()
                hidden[mode] = model(ids, pos, runner.kv_caches, meta)
                best[mode] = min(best.get(mode, float("inf")), 1e3 * (time.perf_counter() - start))
    diff = (hidden["native"] - hidden["torch"]).abs().max().item()
    print(
        f"{'decode batch' if args.decode else 'prefill'} {n}, {args.quantization}: forward "
        + ", ".join(f"{mode} {ms:.1f} ms" for mode, ms in best.items())
        + f" (min of {args.rounds}); max |native - torch| {diff:.3g}; load average {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
