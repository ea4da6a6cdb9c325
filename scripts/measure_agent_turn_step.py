"""An agent's later turn as the engine sees it, on the instruct model: M new tokens over N cached (the prompt is
computed once first, so that the second request hits it), against the same M tokens alone (the weights and the
step's overhead without the context's attention). The step figures of docs/PERFORMANCE_NOTES.md attempt 64 and
docs/BENCHMARKS.md's "At llama.cpp's own precision". Random token ids (speed does not depend on them). Fastest of 3.
Not run by CI.

Usage: python scripts/measure_agent_turn_step.py [--kv-cache-dtype bfloat16] [--activation-quantization int8]
"""

from __future__ import annotations

import argparse
import random
import time

from kvserve.engine.llm import LLM
from kvserve.sampling_params import SamplingParams


def fastest_ms(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> float:
    times = []
    for prompt in prompts:
        start = time.perf_counter()
        llm.generate([prompt], params)
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-cache-dtype", default="float32")
    parser.add_argument("--activation-quantization", default="none")
    parser.add_argument("--shapes", default="9000x90,19000x52,9000x12", help="CACHEDxNEW")
    args = parser.parse_args()
    llm = LLM(
        "qwen2.5-coder-0.5b-instruct",
        kv_cache_dtype=args.kv_cache_dtype,
        activation_quantization=args.activation_quantization,
        max_model_len=32768,
        kv_cache_memory_bytes=2 << 30,
    )
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=1)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1000, 100_000) for _ in range(n)]

    for shape in args.shapes.split(","):
        cached, new = map(int, shape.split("x"))
        base = tokens(cached)
        llm.generate([base], params)
        over = fastest_ms(llm, [base + tokens(new) for _ in range(3)], params)
        alone = fastest_ms(llm, [tokens(new) for _ in range(3)], params)
        print(f"{new} new over {cached} cached: {over:.0f} ms; the {new} alone: {alone:.0f} ms", flush=True)


if __name__ == "__main__":
    main()
