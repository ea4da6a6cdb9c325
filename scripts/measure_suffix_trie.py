"""What the suffix drafter's tries cost in plain Python (docs/SPECULATIVE_SUFFIX.md, "Cost of the tries").

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python scripts/measure_suffix_trie.py

Indexes 1,000 tokens of code-edit text (the default model's tokenizer) and 1,000 random tokens into a depth-24 trie
(best of 7, with the nodes made and the memory they take), then times a request's first draft (which indexes its
1,000-token prompt) and 100 later steps of one new token + a draft, with 20 outputs in the global trie.
"""

from __future__ import annotations

import random
import time
import tracemalloc
from dataclasses import dataclass, field

from kvserve.bench.spec import workload_prompts
from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.spec_decode.suffix import SuffixDrafter, SuffixTrie


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)


def index_cost(tokens: list[int], label: str) -> None:
    times = []
    for _ in range(7):
        start = time.perf_counter()
        SuffixTrie(24).insert(tokens)
        times.append(time.perf_counter() - start)
    tracemalloc.start()
    trie = SuffixTrie(24)
    trie.insert(tokens)
    size, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(
        f"index {len(tokens)} {label} tokens: {min(times) * 1e3:.1f} ms, {trie.num_nodes} nodes, "
        f"{size / 1e6:.2f} MB ({size / len(tokens):.0f} B/token)"
    )


def main() -> None:
    tokenizer = LLMEngine.from_config(EngineConfig(cpu_threads=1, num_gpu_blocks_override=64)).tokenizer
    text = "\n".join(str(p[0]["content"]) for p in workload_prompts("code-edit", 8))  # type: ignore[index]
    ids = tokenizer.encode(text)[:1100]
    index_cost(ids[:1000], "code-edit")
    rng = random.Random(0)
    index_cost([rng.randrange(262144) for _ in range(1000)], "random")
    drafter = SuffixDrafter(24, 1000, 1.0, 0.1)
    for i in range(20):
        drafter.on_finished(Request(f"done{i}", [1], ids[i * 50 : i * 50 + 200]))
    request = Request("r", ids[:1000])
    start = time.perf_counter()
    drafter.propose(request, 8)
    print(f"first draft (indexes the 1000-token prompt): {(time.perf_counter() - start) * 1e3:.1f} ms")
    steps = []
    for i in range(100):
        request.output_token_ids.append(ids[1000 + i])
        start = time.perf_counter()
        drafter.propose(request, 8)
        steps.append(time.perf_counter() - start)
    steps.sort()
    print(
        f"a later step (1 new token, drafts from both tries): median {steps[50] * 1e6:.0f} us, "
        f"max {steps[-1] * 1e6:.0f} us"
    )


if __name__ == "__main__":
    main()
