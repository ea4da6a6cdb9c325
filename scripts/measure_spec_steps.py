"""What a verifying step costs against a plain decode step (docs/SPECULATIVE.md, "What a verifying step costs").

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python scripts/measure_spec_steps.py --batch-sizes 1,2,4 --rounds 3 \
        --output-len 32 --threads 1 --clock cpu

Loads the default model once, then runs the code-edit workload of `kvserve bench spec` on a plain engine and on a
drafting sibling (k = 4, drafting forced on at every batch size) in alternation, `--rounds` times after a warm-up
round; it times `engine.step()` (`--clock cpu`: the process's CPU time, which a loaded machine disturbs less; `wall`:
wall time) over the decode-only steps in which every request decodes plainly (plain engine) or every request
verifies drafts (drafting engine), and prints the medians over rounds of each run's mean, their ratio, and whether
both engines produced the same tokens. Run it in a checkout of an earlier commit to compare runners.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from kvserve.bench.spec import render_prompt, workload_prompts
from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.sampling_params import SamplingParams

SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 2,
    "disable_by_batch_size": 1 << 20,
}


def step_times(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, clock: Callable[[], float]
) -> tuple[list[float], list[float], list[tuple[int, ...]]]:
    """(plain decode step times, verifying step times, each request's tokens) of one run of `prompts`."""
    ids = [f"r{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    plain: list[float] = []
    verifying: list[float] = []
    tokens: dict[str, tuple[int, ...]] = {}
    while engine.has_unfinished_requests():
        running = engine.core.scheduler.running
        decoding = (
            len(running) == len(prompts)
            and not engine.core.scheduler.waiting
            and all(r.num_computed_tokens + 1 >= r.num_tokens for r in running)
        )
        drafts_before = engine.stats().spec_decode_num_drafts
        start = clock()
        outputs = engine.step()
        elapsed = clock() - start
        for output in outputs:
            if output.finished:
                tokens[output.request_id] = tuple(output.outputs[0].token_ids)
        drafts = engine.stats().spec_decode_num_drafts - drafts_before
        if decoding and drafts == 0:
            plain.append(elapsed)
        elif decoding and drafts == len(prompts):
            verifying.append(elapsed)
    return plain, verifying, [tokens[i] for i in ids]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,2,4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    args = parser.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    base = LLMEngine.from_config(EngineConfig(cpu_threads=args.threads, num_gpu_blocks_override=2048))
    plain = base.sibling(enable_prefix_caching=False)
    drafting = base.sibling(speculative_config=SPEC, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        prompts = [
            render_prompt(base.tokenizer, p, base.core.max_model_len - args.output_len)
            for p in workload_prompts("code-edit", batch)
        ]
        plain_means: list[float] = []
        verify_means: list[float] = []
        same = True
        for round_index in range(args.rounds + 1):
            plain_steps, _, plain_tokens = step_times(plain, prompts, params, clock)
            _, verify_steps, drafted_tokens = step_times(drafting, prompts, params, clock)
            same = same and plain_tokens == drafted_tokens
            if round_index and plain_steps and verify_steps:  # round 0 warms up
                plain_means.append(statistics.mean(plain_steps))
                verify_means.append(statistics.mean(verify_steps))
        if not plain_means:
            print(f"batch {batch}: no round had both plain and verifying decode steps")
            continue
        p, v = statistics.median(plain_means) * 1000, statistics.median(verify_means) * 1000
        print(
            f"batch {batch}: plain step {p:.1f} ms, verifying step {v:.1f} ms ({v / p:.2f}x); same tokens: {same}",
            flush=True,
        )


if __name__ == "__main__":
    main()
