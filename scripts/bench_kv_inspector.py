"""What the KV inspector costs: one snapshot of a ~7,000-block pool, its JSON, and decode steps with and without a
watcher (interleaved runs, medians), on the tiny test model so that it runs anywhere in seconds.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python scripts/bench_kv_inspector.py
"""

from __future__ import annotations

import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "server"), str(ROOT / "tests" / "models")]

from server_support import make_engine  # noqa: E402
from tiny_models import build_tiny_hf_model  # noqa: E402
from tiny_tokenizer import write_char_tokenizer  # noqa: E402

from kvserve.engine.engine import LLMEngine  # noqa: E402
from kvserve.engine.kv_publisher import KVPublisher  # noqa: E402
from kvserve.sampling_params import SamplingParams  # noqa: E402

STEPS = 150  # per run: long against the snapshot interval, so that a run sees the steady publishing rate


def busy_engine(model_dir: Path, num_blocks: int = 7000, batch: int = 32) -> LLMEngine:
    """A pool mostly full of cached prefixes, and `batch` requests decoding with a shared system prompt."""
    engine = make_engine(model_dir, num_gpu_blocks_override=num_blocks, block_size=16, max_num_seqs=batch,
                         max_num_batched_tokens=8192)
    rng = random.Random(0)
    for i in range(300):
        engine.add_request(f"fill{i}", [rng.randrange(3, 250) for _ in range(250)], SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    system = [rng.randrange(3, 250) for _ in range(64)]
    for i in range(batch):
        prompt = system + [rng.randrange(3, 250) for _ in range(60)]
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=120, ignore_eos=True))
    for _ in range(3):
        engine.step()
    return engine


def top_up(engine: LLMEngine, batch: int, rng: random.Random) -> None:
    """Keep `batch` requests decoding: replace finished ones with fresh ones (sharing the system prompt)."""
    while len(engine.groups) < batch:
        prompt = [7] * 64 + [rng.randrange(3, 250) for _ in range(8)]
        engine.add_request(f"r{rng.random()}", prompt, SamplingParams(max_tokens=150, ignore_eos=True))


def steps_per_s(engine: LLMEngine, publisher: KVPublisher, steps: int, watched: bool, rng: random.Random) -> float:
    """Decode steps per second over `steps` steps (with top-ups), with or without a watcher on the publisher."""
    batch = engine.config.max_num_seqs
    with contextlib.ExitStack() as stack:
        if watched:
            stack.enter_context(publisher.watch())
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
            publisher.tick(True)
            top_up(engine, batch, rng)
        return steps / (time.perf_counter() - start)


def main() -> None:
    model_dir = Path(tempfile.mkdtemp())
    build_tiny_hf_model("llama_gqa").save_pretrained(model_dir)
    write_char_tokenizer(model_dir)
    engine = busy_engine(model_dir)
    snap = engine.kv_snapshot(False)
    states = {c: snap["block_states"].count(c) for c in "nfucs"}
    build = []
    for _ in range(20):
        start = time.perf_counter()
        engine.kv_snapshot(False)
        build.append(time.perf_counter() - start)
    encode = []
    for _ in range(5):
        start = time.perf_counter()
        text = json.dumps(snap)
        encode.append(time.perf_counter() - start)
    publisher = KVPublisher(engine, lambda: None)
    off, on = [], []
    rng = random.Random(1)
    for _ in range(5):  # interleaved, so that drift (other load, the sequences growing) hits both alike
        off.append(steps_per_s(engine, publisher, STEPS, False, rng))
        on.append(steps_per_s(engine, publisher, STEPS, True, rng))
    print(f"pool {engine.pool.num_blocks} blocks {states}, {len(snap['requests'])} requests")
    print(f"snapshot {statistics.median(build) * 1e3:.2f} ms (median of 20); "
          f"JSON {statistics.median(encode) * 1e3:.2f} ms, {len(text) / 1024:.0f} KiB")
    ratio = statistics.median(on) / statistics.median(off)
    print(f"decode steps/s at batch {len(engine.scheduler.running)}: without a watcher {statistics.median(off):.1f}, "
          f"with {statistics.median(on):.1f} (ratio {ratio:.3f})")


if __name__ == "__main__":
    main()
