"""A prefill of one request on three engines whose loaders lay the GGUF weights out differently, alternated in one
process (scripts/ab_decode_step.py's engine_with_layout): the file's layout, rows interleaved four at a time without
Q5_0 tiles, and the engine's own layout (rows interleaved, Q5_0 in tiles): docs/BENCHMARKS.md's check that the
layouts of docs/PERFORMANCE_NOTES.md attempts 73-74 did not slow the prefill. Each round a fresh random prompt per
engine (prefix caching off), timed to its first token. Not run by CI.

Usage: python scripts/ab_prefill_layouts.py [--model qwen2.5-coder-0.5b-instruct] [--prompt-len 512] [--rounds 5]
       [--activation-quantization int8]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

from kvserve.config import EngineConfig
from kvserve.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_decode_step import LAYOUTS, engine_with_layout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--activation-quantization", default="int8")
    args = parser.parse_args()
    config = EngineConfig(
        model=args.model,
        kv_cache_memory_bytes=1 << 30,
        activation_quantization=args.activation_quantization,
        kv_cache_dtype="bfloat16",
        enable_prefix_caching=False,
    )
    engines = {layout: engine_with_layout(config, layout) for layout in LAYOUTS}
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for round_ in range(args.rounds):
        for name, engine in engines.items():
            engine.add_request(f"{round_}-{name}", [rng.randrange(1000, 30000) for _ in range(args.prompt_len)], params)
            start = time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
            times[name].append(1e3 * (time.perf_counter() - start))
    print(f"prefill of {args.prompt_len} tokens, {args.activation_quantization} activations, {args.rounds} rounds:")
    for name, ms in times.items():
        print(f"  {name}: median {statistics.median(ms):.0f} ms, fastest {min(ms):.0f} ms")


if __name__ == "__main__":
    main()
