"""A decode step of one engine on two kernel builds, alternated: OLD.so (a library built from an earlier commit; see
scripts/ab_kernel_shapes.py for how to get one) against the current sources' build, swapped under the same model,
KV cache and requests, so that the drift of a noisy VM hits both alike. Each round runs fresh requests (a 32-token
prompt, as `kvserve bench latency`'s batched decode) through their prefill and two steps untimed, then STEPS timed
decode steps, then aborts them, so the context stays short. Prints each build's median and fastest round, and the
median time of the step's LM head (the model's compute_logits). The step figures of docs/PERFORMANCE_NOTES.md
attempts 51-52 and 70. Not run by CI.

The two builds must share kernels.h's structs (the engine's layer descriptions are built once).

`file-layout` in OLD.so's place compares the weights' layouts instead, on the current build: "old" is a second
engine whose loader leaves the GGUF blocks as the file stores them (interleave_gguf_rows skipped), "new" the
usual one (rows interleaved four at a time); both engines live in the process, their rounds alternated.
`plain-rows` the same, "old" with the rows interleaved but no Q5_0 tiles (gguf_blocks.py's Q5_TILES).

Usage: python scripts/ab_decode_step.py OLD.so|file-layout|plain-rows [--batch 1] [--activation-quantization int8]
       [--rounds 12] [--steps 40] [--model NAME]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.kernels import ops
from kvserve.kernels.native import load_native_library
from kvserve.kernels.ops import NativeKernels
from kvserve.model import loader
from kvserve.sampling_params import SamplingParams

LAYOUTS = ("file-layout", "plain-rows", "tiles")


def engine_with_layout(config: EngineConfig, layout: str) -> LLMEngine:
    """An engine whose loader lays the GGUF weights out as `layout` says: "file-layout" as the file stores them
    (interleave_gguf_rows skipped), "plain-rows" interleaved four at a time without Q5_0 tiles, "tiles" as the
    engine's own loader does (interleaved, Q5_0 in tiles)."""
    if layout == "file-layout":
        interleave = loader.interleave_gguf_rows
        loader.interleave_gguf_rows = lambda model, kernels: 0  # type: ignore[assignment]
        try:
            return LLMEngine.from_config(config)
        finally:
            loader.interleave_gguf_rows = interleave
    if layout == "plain-rows":
        tiles_fit = ops.q5_tiles_fit
        ops.q5_tiles_fit = lambda qtype, k: False  # type: ignore[assignment]
        try:
            return LLMEngine.from_config(config)
        finally:
            ops.q5_tiles_fit = tiles_fit
    return LLMEngine.from_config(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", help="an earlier build's .so, file-layout or plain-rows")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--activation-quantization", default="int8")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--model", default=None, help="a packaged model's name (default: the default model)")
    args = parser.parse_args()
    config = EngineConfig(
        model=args.model,
        kv_cache_memory_bytes=1 << 30,
        quantization="auto",
        activation_quantization=args.activation_quantization,
    )
    other_layout = engine_with_layout(config, args.old) if args.old in ("file-layout", "plain-rows") else None
    engine = LLMEngine.from_config(config)
    kernels = engine.core.runner.model.kernels
    assert isinstance(kernels, NativeKernels), "needs the native kernels"
    # name -> (engine, the library its kernels call)
    builds = {
        "old": (other_layout, kernels.library) if other_layout else (engine, load_native_library(Path(args.old))),
        "new": (engine, kernels.library),
    }
    lm_head: list[float] = []
    for each in {id(e): e for e, _ in builds.values()}.values():
        model = each.core.runner.model
        compute_logits = model.compute_logits

        def timed_logits(*a: Any, compute_logits: Any = compute_logits, **k: Any) -> Any:
            start = time.perf_counter()
            logits = compute_logits(*a, **k)
            lm_head.append(time.perf_counter() - start)
            return logits

        model.compute_logits = timed_logits  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=args.steps + 10, ignore_eos=True, temperature=0)
    times: dict[str, list[float]] = {name: [] for name in builds}
    heads: dict[str, list[float]] = {name: [] for name in builds}
    for round_ in range(args.rounds):
        for name, (engine, library) in builds.items():
            # the one object every layer and the LM head call
            object.__setattr__(engine.core.runner.model.kernels, "library", library)
            ids = [f"{round_}-{name}-{i}" for i in range(args.batch)]
            for i, request_id in enumerate(ids):
                engine.add_request(request_id, list(range(100 + i, 132 + i)), params)
            for _ in range(3):  # the prefill and two decode steps
                engine.step()
            lm_head.clear()
            start = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            times[name].append(1e3 * (time.perf_counter() - start) / args.steps)
            heads[name].append(1e3 * statistics.fmean(lm_head))
            for request_id in ids:
                engine.abort_request(request_id)
            engine.step()
    object.__setattr__(kernels, "library", builds["new"][1])
    print(f"decode step at batch {args.batch}, {args.activation_quantization} activations, {args.rounds} rounds:")
    for name, ms in times.items():
        print(
            f"  {name}: median {statistics.median(ms):.2f} ms, fastest round {min(ms):.2f} ms; "
            f"LM head median {statistics.median(heads[name]):.2f} ms"
        )
    print(f"  old / new: {statistics.median(times['old']) / statistics.median(times['new']):.3f}x")


if __name__ == "__main__":
    main()
