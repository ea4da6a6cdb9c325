"""Where one decode step goes: the step's wall time, the model's forward, the LM head (compute_logits) and the
time inside the q8_0 matmul kernel, averaged over decode steps of BATCH requests at a 64-token context.
The breakdown quoted in docs/PERFORMANCE_NOTES.md. Not run by CI.

Usage: python scripts/profile_decode_step.py [BATCH] [--quantization none|q8_0]
"""

from __future__ import annotations

import argparse
import time

from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.kernels.ops import NativeKernels
from kvserve.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("batch", type=int, nargs="?", default=1)
    parser.add_argument("--quantization", default="q8_0")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    engine = LLMEngine.from_config(EngineConfig(kv_cache_memory_bytes=1 << 30, quantization=args.quantization))
    params = SamplingParams(max_tokens=args.steps + 10, ignore_eos=True, temperature=0)
    for i in range(args.batch):
        engine.add_request(str(i), list(range(100 + i, 164 + i)), params)
    for _ in range(3):  # the prefill and a warm-up decode
        engine.step()

    spent = {"kernel": 0.0, "forward": 0.0, "logits": 0.0}

    def timed(key: str, fn):  # type: ignore[no-untyped-def]
        def wrapper(*a, **k):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[key] += time.perf_counter() - start
        return wrapper

    model = engine.runner.model
    NativeKernels.q8_matmul = timed("kernel", NativeKernels.q8_matmul)  # type: ignore[method-assign]
    model.forward = timed("forward", model.forward)  # type: ignore[method-assign]
    model.compute_logits = timed("logits", model.compute_logits)  # type: ignore[method-assign]
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    n = args.steps
    print(f"batch {args.batch}, {args.quantization}: step {1e3 * (time.perf_counter() - start) / n:.1f} ms; "
          f"forward {1e3 * spent['forward'] / n:.1f} ms, LM head {1e3 * spent['logits'] / n:.1f} ms, "
          f"q8_0 kernel (body and LM head) {1e3 * spent['kernel'] / n:.1f} ms")


if __name__ == "__main__":
    main()
