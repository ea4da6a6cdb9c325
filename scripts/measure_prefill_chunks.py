"""What one step of a long prompt's prefill costs on this CPU, by chunk size and by how much context precedes the chunk,
beside a decode step: the figures --long-prefill-token-threshold's CPU default is chosen from (docs/KV_CACHE.md, "Long
prompts beside short requests"). A short request that arrives during a long prefill waits for the step in progress, so
the chunk's time is the wait it adds; the step's fixed cost (a decode step's time) over the chunk's time is what small
chunks cost the long prompt.

How: one prompt of --context tokens is prefilled once; then for each context length p and chunk size C, a request of
that prompt's first p tokens plus C new ones hits the cached p and computes C in one step (median of --repeats). The
engine runs in this process, native layers, as `kvserve serve` would. Not run by CI; time it on a quiet machine.

Usage: python scripts/measure_prefill_chunks.py [--model qwen2.5-coder-0.5b-instruct] [--context 16384]
       [--chunks 64,128,256,512] [--at 0,4096,8192,16384] [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.sampling_params import SamplingParams


def run_alone(engine: LLMEngine, rid: str, prompt: list[int], max_tokens: int) -> list[float]:
    """Run one request to its end; the seconds of each step."""
    engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    return steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--chunks", default="64,128,256,512")
    p.add_argument("--at", default="0,4096,8192,16384", help="context lengths before the chunk")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    chunks = [int(c) for c in args.chunks.split(",")]
    points = [int(a) for a in args.at.split(",")]
    longest = max(chunks)
    engine = LLMEngine.from_config(
        EngineConfig.parse(
            model=args.model,
            max_model_len=args.context + 2 * longest + 64,
            max_num_batched_tokens=2048,
            long_prefill_token_threshold=0,
            kv_cache_memory_bytes="3GiB",
        )
    )
    rng = random.Random(0)
    vocab = min(engine.core.model_config.vocab_size, 150_000)
    base = [rng.randrange(1000, vocab) for _ in range(max(points) + 1)]
    start = time.perf_counter()
    run_alone(engine, "warm", base, 1)
    print(f"prefill of {len(base)} tokens in 2048-token steps: {time.perf_counter() - start:.1f} s")
    decode = run_alone(engine, "decode", base[:64], 33)[2:]
    print(f"decode step, batch 1, short prompt: {1e3 * statistics.median(decode):.1f} ms")
    print("chunk step ms (median of repeats) by context before it:")
    print("chunk " + " ".join(f"{a:>9}" for a in points))
    for c in chunks:
        row = []
        for a in points:
            times = []
            for r in range(args.repeats):
                fresh = [rng.randrange(1000, vocab) for _ in range(c)]
                steps = run_alone(engine, f"c{c}-{a}-{r}", base[:a] + fresh, 1)
                times.append(steps[0])
            row.append(1e3 * statistics.median(times))
        print(f"{c:>5} " + " ".join(f"{t:>9.0f}" for t in row))


if __name__ == "__main__":
    main()
