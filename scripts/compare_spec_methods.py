"""Drafting methods side by side at batch 1 (docs/SPECULATIVE_SUFFIX.md, "Measurement").

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python scripts/compare_spec_methods.py --rounds 2 --output-len 128
    ... --workload story [--repeat] [--suffix-config '{"num_speculative_tokens": 16}']

Loads the default model once (cpu_threads 1) and runs one greedy request at a time on sibling engines: no drafting,
n-gram (k 4) and suffix (its defaults, plus `--suffix-config`), in alternation (the order flips every round), each
round on a new prompt of a workload of `kvserve bench spec` (`--workload`, default code-edit; chat template), the
same prompt for every engine of the round. Per run it prints decode tokens/s (output tokens after the first over
the time from the first token to the last), drafted and accepted tokens, the time spent drafting
(SpecDecoder.propose), and whether the tokens equal the run without drafting. The suffix engine keeps its global
cache across rounds (earlier rounds' outputs); `--repeat` runs every round on the same prompt, to show what the
cache gives a repeated request.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from kvserve.bench.spec import render_prompt, workload_prompts
from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.sampling_params import SamplingParams

METHODS: dict[str, dict[str, Any] | None] = {
    "off": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
    "suffix": {"method": "suffix"},
}


def timed_run(engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams) -> dict[str, Any]:
    """One request alone: decode tokens/s, drafting counters and drafting time, and its tokens."""
    spec = engine.core.spec
    propose_s = 0.0
    if spec is not None:
        real = spec.propose

        def propose(*args: Any) -> None:
            nonlocal propose_s
            start = time.perf_counter()
            real(*args)
            propose_s += time.perf_counter() - start

        spec.propose = propose  # type: ignore[method-assign]
    before = engine.stats()
    engine.add_request(request_id, prompt, params)
    first = last = 0.0
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.outputs[0].token_ids and not first:
                first = now
            if out.finished:
                tokens, last = list(out.outputs[0].token_ids), now
    if spec is not None:
        spec.propose = real  # type: ignore[method-assign]
    after = engine.stats()
    drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    return {
        "tok_s": (len(tokens) - 1) / (last - first),
        "drafted": drafted,
        "accepted": accepted,
        "drafts": after.spec_decode_num_drafts - before.spec_decode_num_drafts,
        "propose_ms": propose_s * 1000,
        "tokens": tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--workload", default="code-edit", help="a workload of `kvserve bench spec`")
    parser.add_argument("--repeat", action="store_true", help="the same prompt every round")
    parser.add_argument("--suffix-config", default=None, help="JSON keys added to the suffix method's config")
    args = parser.parse_args()
    methods = dict(METHODS)
    if args.suffix_config:
        import json

        methods["suffix"] = {"method": "suffix", **json.loads(args.suffix_config)}
    base = LLMEngine.from_config(EngineConfig(cpu_threads=1, num_gpu_blocks_override=2048))
    engines = {
        name: base.sibling(speculative_config=spec, enable_prefix_caching=False) for name, spec in methods.items()
    }
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    prompts = [render_prompt(base.tokenizer, p, 4096) for p in workload_prompts(args.workload, args.rounds + 1)]
    warm = engines["off"]
    timed_run(warm, "warm", prompts[-1][:64], SamplingParams(temperature=0, max_tokens=8))
    results: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(args.rounds):
        prompt = prompts[0 if args.repeat else r]
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        runs = {name: timed_run(engines[name], f"{name}-{r}", prompt, params) for name in order}
        for name in order:
            run = runs[name]
            results[name].append(run["tok_s"])
            rate = run["accepted"] / run["drafted"] if run["drafted"] else 0.0
            print(
                f"round {r} ({len(prompt)}-token prompt) {name:6s}: {run['tok_s']:6.1f} decode tok/s, "
                f"{run['drafts']} drafts, {run['drafted']} drafted, {run['accepted']} accepted ({rate:.0%}), "
                f"drafting {run['propose_ms']:.1f} ms, same tokens as off: {run['tokens'] == runs['off']['tokens']}",
                flush=True,
            )
    for name, values in results.items():
        print(f"{name:6s}: median {statistics.median(values):.1f} decode tok/s over {len(values)} runs")


if __name__ == "__main__":
    main()
