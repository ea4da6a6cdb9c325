"""A random workload on a tiny engine, snapshotted as the KV inspector's publisher does: shared system prompts
(prefix hits, shared blocks), a small pool (evictions, preemptions, refused admissions) and aborts. Used by the
delta property test and by the browser test that feeds the page's delta code the same snapshots."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from server_support import make_engine

from kvserve.sampling_params import SamplingParams


def random_snapshots(model_dir: Path, seed: int, rounds: int = 30) -> list[dict[str, Any]]:
    """Snapshots (without token ids, as the stream has them) taken every 1-3 engine steps of a random workload."""
    rng = random.Random(seed)
    engine = make_engine(model_dir, num_gpu_blocks_override=rng.choice([14, 24, 48]), max_num_seqs=6, max_model_len=48)
    systems = [[rng.randrange(3, 200) for _ in range(rng.choice([4, 9, 12]))] for _ in range(3)]
    snaps = [engine.kv_snapshot(False)]
    live: list[str] = []
    for n in range(rounds):
        for _ in range(rng.choice([0, 0, 1, 2])):
            prompt = rng.choice(systems) + [rng.randrange(3, 200) for _ in range(rng.randrange(1, 10))]
            live.append(f"r{n}-{len(live)}")
            engine.add_request(
                live[-1], prompt, SamplingParams(max_tokens=rng.randrange(1, 24), ignore_eos=True, temperature=0.0)
            )
        if live and rng.random() < 0.15:
            engine.abort_request(live.pop(rng.randrange(len(live))))
        for _ in range(rng.randrange(1, 4)):
            if engine.has_unfinished_requests():
                engine.step()
        snaps.append(engine.kv_snapshot(False))
    return snaps
