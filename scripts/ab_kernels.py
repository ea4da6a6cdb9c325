"""Prefill and decode of the default model with the current kernels against an older build of them, alternated in
one process (the machine's speed drifts more between runs than most kernel changes gain). The "old and new
alternated" figures of docs/PERFORMANCE_NOTES.md. Not run by CI.

Usage: python scripts/ab_kernels.py OLD.so [--rounds 5] [--decode-contexts 32,512,2000] [--model NAME]
       [--activation-quantization none|int8]
(an older library is any kvserve_kernels_*.so under ~/.cache/kvserve/kernels, e.g. the second newest)
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.kernels.native import load_native_library
from kvserve.kernels.ops import NativeKernels
from kvserve.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", type=Path, help="the older kernel library (.so)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--decode-contexts", default="32,512,2000")
    parser.add_argument("--decode-steps", type=int, default=20)
    parser.add_argument("--model", default=None, help="a packaged model's name (default: the default model)")
    parser.add_argument("--activation-quantization", default="none", choices=["none", "int8"])
    args = parser.parse_args()
    engine = LLMEngine.from_config(
        EngineConfig(
            model=args.model,
            kv_cache_memory_bytes=1 << 30,
            enable_prefix_caching=False,
            activation_quantization=args.activation_quantization,
        )
    )
    model = engine.core.runner.model
    old = NativeKernels(load_native_library(args.old), activation_quantization=args.activation_quantization)
    kernels = {"new": model.embed_tokens.kernels, "old": old}
    serial = iter(range(10**9))

    def run(prompt_len: int, max_tokens: int) -> float:
        """Seconds for the prefill (max_tokens 1), else per decode step after it."""
        i = next(serial)
        ids = [2] + [(1000 + 7 * j + 13 * i) % 200_000 + 100 for j in range(prompt_len - 1)]
        engine.add_request(str(i), ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0))
        if max_tokens > 1:
            engine.step()
            engine.step()
        start, steps = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        return (time.perf_counter() - start) / (1 if max_tokens == 1 else steps)

    run(args.prompt_len, 1)  # warm-up
    cases = [(f"prefill {args.prompt_len}", args.prompt_len, 1)]
    cases += [(f"decode b1, context {n}", int(n), args.decode_steps + 2) for n in args.decode_contexts.split(",")]
    for label, prompt_len, max_tokens in cases:
        times: dict[str, list[float]] = {name: [] for name in kernels}
        for _ in range(args.rounds):
            for name, k in kernels.items():
                model.use_kernels(k)
                times[name].append(run(prompt_len, max_tokens))
        print(
            f"{label}: "
            + "; ".join(f"{name} {', '.join(f'{1e3 * t:.1f}' for t in sorted(ts))} ms" for name, ts in times.items())
        )
    model.use_kernels(kernels["new"])


if __name__ == "__main__":
    main()
