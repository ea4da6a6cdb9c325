"""Where one decode step goes: the step's wall time, the engine core's share of it (what a server's engine thread
runs; the rest is the front end's detokenizing and output building), the model's forward, the LM head
(compute_logits) and the time inside q8_0 matmul calls made from Python (the LM head; on the torch layer path the
body's too: the native layer path calls the kernel from C++), averaged over decode steps of BATCH requests at a
--context-token context (64 by default) of --model (the default model by default) with its KV cache in
--kv-cache-dtype. The breakdown quoted in docs/PERFORMANCE_NOTES.md. Not run by CI.

`--layers native,torch` alternates the native layer path (one call per decoder layer) and the torch modules in
rounds in one process, so that a noisy machine's drift hits both alike; the minimum over rounds is printed last.

Usage: python scripts/profile_decode_step.py [BATCH] [--quantization none|q8_0|gguf] [--layers native,torch]
       [--activation-quantization none|int8] [--model NAME] [--context N] [--kv-cache-dtype DTYPE]
"""

from __future__ import annotations

import argparse
import os
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
    parser.add_argument("--layers", default="native", help="comma-separated: native, torch (alternated)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--activation-quantization", default="none")
    parser.add_argument("--model", default=None, help="a packaged model's name or a path (default: the default model)")
    parser.add_argument("--context", type=int, default=64, help="prompt tokens before the timed decode steps")
    parser.add_argument("--kv-cache-dtype", default="auto")
    args = parser.parse_args()
    modes = args.layers.split(",")
    total = (args.steps + 1) * len(modes) * args.rounds  # each round's steps and its untimed first one
    engine = LLMEngine.from_config(
        EngineConfig(
            model=args.model,
            kv_cache_memory_bytes=max(1 << 30, 2 * args.batch * (args.context + total + 16) * 48 * 1024),
            quantization=args.quantization,
            activation_quantization=args.activation_quantization,
            kv_cache_dtype=args.kv_cache_dtype,
        )
    )
    params = SamplingParams(max_tokens=total + 10, ignore_eos=True, temperature=0)
    for i in range(args.batch):
        engine.add_request(str(i), [100 + (i + 7919 * t) % 20000 for t in range(args.context)], params)
    scheduler = engine.core.scheduler
    while scheduler.waiting or any(r.num_computed_tokens < args.context for r in scheduler.running):  # the prefill
        engine.step()
    for _ in range(2):  # warm-up decodes
        engine.step()

    spent = {"kernel": 0.0, "forward": 0.0, "logits": 0.0, "core": 0.0}

    def timed(key: str, fn):  # type: ignore[no-untyped-def]
        def wrapper(*a, **k):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[key] += time.perf_counter() - start

        return wrapper

    model = engine.core.runner.model
    kernels = model.kernels
    NativeKernels.q8_matmul = timed("kernel", NativeKernels.q8_matmul)  # type: ignore[method-assign]
    model.forward = timed("forward", model.forward)  # type: ignore[method-assign]
    model.compute_logits = timed("logits", model.compute_logits)  # type: ignore[method-assign]
    # The core's step is what a server's engine thread runs; the rest of LLMEngine.step is the front end's text work.
    engine.core.step = timed("core", engine.core.step)  # type: ignore[method-assign]
    best: dict[str, float] = {}
    n = args.steps
    for _ in range(args.rounds):
        for mode in modes:
            if mode == "torch":
                model.use_torch_layers()
            else:
                model.use_kernels(kernels)  # chooses again: the native layers where the model allows them
            engine.step()  # one untimed step in this mode
            spent.update(kernel=0.0, forward=0.0, logits=0.0, core=0.0)
            start = time.perf_counter()
            for _ in range(n):
                engine.step()
            step_ms = 1e3 * (time.perf_counter() - start) / n
            core_ms = 1e3 * spent["core"] / n
            best[mode] = min(best.get(mode, step_ms), step_ms)
            path = "native layers" if model.native_layers is not None else "torch layers"
            print(
                f"batch {args.batch}, context {args.context}, {args.quantization}, {args.activation_quantization} "
                f"activations, {args.kv_cache_dtype} KV, {path}: "
                f"step {step_ms:.1f} ms "
                f"(engine core {core_ms:.1f} ms, front end {step_ms - core_ms:.1f} ms); "
                f"forward {1e3 * spent['forward'] / n:.1f} ms, LM head {1e3 * spent['logits'] / n:.1f} ms, "
                f"q8_0 kernel called from Python {1e3 * spent['kernel'] / n:.1f} ms",
                flush=True,
            )
    print(
        f"min step over {args.rounds} round(s): "
        + ", ".join(f"{mode} {ms:.1f} ms" for mode, ms in best.items())
        + f" (load average {os.getloadavg()[0]:.2f})"
    )


if __name__ == "__main__":
    main()
