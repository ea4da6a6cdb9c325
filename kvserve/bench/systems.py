"""What every system under test offers the benchmarks (kvserve here, peers in kvserve/bench/peers/):
generate fixed-length outputs for token prompts, timing each forward pass, and run a whole workload."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kvserve.bench.workload import TokenRequest

if TYPE_CHECKING:
    import argparse

    from kvserve.engine.engine import LLMEngine


@dataclass(slots=True)
class Timeline:
    """When a generation started and when each forward pass that produced tokens ended; the split
    between prefill (up to `first_all`) and decode steps is what latency figures are made of."""

    start: float
    stamps: list[float] = field(default_factory=list)
    first_all: int = 0  # index of the stamp at which every sequence had its first token

    @property
    def ttft_s(self) -> float:
        return self.stamps[self.first_all] - self.start

    @property
    def num_decode_steps(self) -> int:
        return len(self.stamps) - 1 - self.first_all

    @property
    def decode_steps_s(self) -> list[float]:
        """Each decode step's seconds, once every sequence is decoding."""
        stamps = self.stamps[self.first_all :]
        return [b - a for a, b in zip(stamps, stamps[1:])]

    @property
    def decode_step_s(self) -> float | None:
        """Seconds per decode step once every sequence is decoding: the median step, None with no decode step.

        Why the median, not the mean: one stall of the host (page faults on a long prompt's fresh KV blocks under
        memory pressure, another process's burst) lasting seconds moves the mean over a run's steps by orders of
        magnitude (bench latency once reported 1,698 ms a token on the instruct model after a 1,024-token prompt,
        whose steps take 23 ms). Steps of one run do the same work give or take a block's allocation, so their
        median is the step time, whatever one of them met."""
        from kvserve.bench.stats import median

        steps = self.decode_steps_s
        return median(steps) if steps else None

    @property
    def decode_step_mean_s(self) -> float | None:
        """Mean seconds per decode step (every stall included); None with no decode step."""
        if self.num_decode_steps < 1:
            return None
        return (self.stamps[-1] - self.stamps[self.first_all]) / self.num_decode_steps


@dataclass(frozen=True, slots=True)
class ThroughputRun:
    elapsed_s: float
    prompt_tokens: int
    output_tokens: int  # tokens the requests asked for
    generated_tokens: int  # tokens computed, padding waste included (more than output_tokens for static batches)

    def to_json(self) -> dict:
        return {
            "elapsed_s": self.elapsed_s,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "generated_tokens": self.generated_tokens,
        }


class System(Protocol):
    name: str

    def timed_generate(self, prompts: list[list[int]], output_len: int) -> Timeline:
        """Generate exactly `output_len` tokens (greedy, EOS ignored) for each prompt, all at once."""
        ...

    def run_requests(self, requests: list[TokenRequest]) -> ThroughputRun:
        """Run the whole workload and return when the last request is done."""
        ...


class KVServeSystem:
    """kvserve's engine driven step by step, so each step's end is visible to the benchmark."""

    name = "kvserve"

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._ids = itertools.count()

    def timed_generate(self, prompts: list[list[int]], output_len: int) -> Timeline:
        from kvserve.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
        ids = [f"bench-{next(self._ids)}" for _ in prompts]
        timeline = Timeline(start=time.perf_counter())
        for rid, prompt in zip(ids, prompts):
            self.engine.add_request(rid, list(prompt), params)
        started: set[str] = set()
        pending = set(ids)
        all_started = False
        while pending:
            outputs = self.engine.step()
            if not outputs:
                continue  # a prefill chunk that sampled nothing
            timeline.stamps.append(time.perf_counter())
            for out in outputs:
                started.add(out.request_id)
                if out.finished:
                    pending.discard(out.request_id)
            if not all_started and len(started) == len(ids):
                timeline.first_all, all_started = len(timeline.stamps) - 1, True
        return timeline

    def run_requests(self, requests: list[TokenRequest]) -> ThroughputRun:
        from kvserve.engine.llm import LLM
        from kvserve.sampling_params import SamplingParams

        params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0) for r in requests]
        llm = LLM(engine=self.engine)
        start = time.perf_counter()
        outputs = llm.generate([list(r.prompt_token_ids) for r in requests], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        produced = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        return ThroughputRun(elapsed, sum(len(r.prompt_token_ids) for r in requests), produced, produced)


def build_engine(args: argparse.Namespace) -> LLMEngine:
    """The engine named by the command's engine flags (the same flags as `kvserve generate`)."""
    from kvserve.engine.engine import LLMEngine
    from kvserve.engine_args import engine_config_from_args

    return LLMEngine.from_config(engine_config_from_args(args))


def special_token_ids(engine: LLMEngine) -> list[int]:
    """Ids a random prompt must not contain (BOS/EOS/pad...), so that random prompts stay ordinary text."""
    hf = getattr(engine.tokenizer, "hf", None)
    ids = set(getattr(hf, "all_special_ids", []) or [])
    ids.update(engine.core.eos_token_ids)
    if engine.core.model_config.bos_token_id is not None:
        ids.add(engine.core.model_config.bos_token_id)
    return sorted(ids)
