"""`kvserve bench kv-dtype`: what each --kv-cache-dtype costs in accuracy and buys in capacity, on one model
loaded once. Per dtype: KV bytes per token, blocks at a fixed budget, perplexity on the first N tokens of
the GPL-3 text (BOS prepended, one window), greedy agreement with float32 KV, decode throughput at a batch.
A second table measures scale granularity (per token-head, per block, per tensor) on the model's real K/V:
the evidence for kvserve's per-token-head scales (kvserve/kv/quant.py)."""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from kvserve.bench.options import add_engine_args, add_output_args, int_list, new_command
from kvserve.units import GiB, cdiv, parse_size

if TYPE_CHECKING:
    import torch

    from kvserve.engine.engine import LLMEngine

GPL3 = Path(__file__).resolve().parent / "data" / "GPL-3"
BASELINE = "float32"
TOP = 5
# Eight short prompts of different kinds (prose, facts, code, lists, dialogue), written for this benchmark.
PROMPTS = (
    "The history of the printing press begins",
    "Photosynthesis is the process by which",
    'def merge_sorted(a, b):\n    """Merge two sorted lists."""\n',
    "Ingredients for a simple bread:\n1.",
    "Q: Why is the sky blue?\nA:",
    "The three largest planets in the solar system are",
    "Dear hiring manager,\n\nI am writing to apply for",
    "In 1969, the first humans to walk on the Moon",
)

SCHEMA = """\
results: {"dtypes": [{"kv_cache_dtype", "bytes_per_token", "blocks_at_budget", "capacity_vs_float32",
                      "perplexity", "perplexity_delta_perc", "greedy_identical_prompts", "greedy_first_divergence",
                      [int per prompt, = tokens when identical], "greedy_match_perc", "divergences_near_tie",
                      "decode_tokens_per_s", "decode_vs_float32"}],
          "granularity": [{"format", "granularity", "k_rel_err", "v_rel_err"}],
          "budget_bytes", "ppl_tokens", "greedy_prompts", "greedy_tokens", "decode_batch", "decode_context"}
ratios: {"capacity@<dtype>": blocks / float32 blocks, "ppl_delta_perc@<dtype>", "decode@<dtype>": tok/s vs float32}
greedy_match_perc: positions (of prompts x tokens) where the dtype's greedy token equals float32 KV's;
divergences_near_tie: first divergences that pass vLLM's check_logprobs_close rule (each side's token in the
other's top-5). rel_err: ||dequant(quant(x)) - x|| / ||x|| over all layers of the perplexity text's K or V."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = new_command(
        sub, "kv-dtype", "accuracy, capacity and speed of each KV cache dtype", __doc__.splitlines()[0], SCHEMA
    )
    p.add_argument(
        "--kv-dtypes",
        default="float32,bfloat16,fp8_e4m3,fp8_e5m2,int8",
        help="comma-separated --kv-cache-dtype values (float32, the baseline, always runs first)",
    )
    p.add_argument("--budget", type=parse_size, default=4 * GiB, help="budget for the blocks column (no allocation)")
    add_accuracy_args(p, greedy_tokens=64)
    p.add_argument("--decode-batch", type=int, default=32)
    p.add_argument("--decode-context", type=int, default=128, help="prompt tokens of each decoding request")
    p.add_argument("--decode-tokens", type=int, default=16, help="tokens generated per request in the timed run")
    p.add_argument("--granularity-block", type=int_list, default=[16], help="block size(s) for per-block scales")
    add_output_args(p, "(no plot for this command)")
    add_engine_args(p)
    # The engines run here need a modest pool, whole chunks of prompt logits in memory, and no prefix hits.
    p.set_defaults(func=run, kv_cache_memory_bytes=GiB, max_num_batched_tokens=512, enable_prefix_caching=False)


def add_accuracy_args(p: argparse.ArgumentParser, greedy_tokens: int) -> None:
    """The accuracy flags shared with `bench quantization`: perplexity text and length, greedy prompts."""
    p.add_argument("--text", type=Path, default=GPL3, help="perplexity text (default: the GPL-3 shipped here)")
    p.add_argument("--ppl-tokens", type=int, default=2000)
    p.add_argument(
        "--greedy-prompts",
        type=int,
        default=len(PROMPTS),
        choices=range(1, len(PROMPTS) + 1),
        metavar=f"1..{len(PROMPTS)}",
    )
    p.add_argument("--greedy-tokens", type=int, default=greedy_tokens)


def run(args: argparse.Namespace) -> int:
    from kvserve.bench.machine import machine_info
    from kvserve.bench.report import Report, Table, config_of, emit
    from kvserve.bench.stats import ratio
    from kvserve.capacity import num_blocks_for_budget
    from kvserve.engine.engine import LLMEngine
    from kvserve.engine_args import engine_config_from_args

    names = [BASELINE] + [d for d in args.kv_dtypes.split(",") if d and d != BASELINE]
    base_config = engine_config_from_args(args)
    engine = LLMEngine.from_config(replace(base_config, kv_cache_dtype=BASELINE))
    ppl_ids = perplexity_ids(engine, args.text.read_text(encoding="utf-8"), args.ppl_tokens)
    granularity = granularity_errors(engine, ppl_ids, args.granularity_block)
    prompts = list(PROMPTS[: args.greedy_prompts])
    decode_prompts = random_prompts(engine, args.decode_batch, args.decode_context, args.seed)
    rows: list[dict] = []
    baseline_greedy: list | None = None
    for name in names:
        if name != BASELINE:
            engine = engine.sibling(kv_cache_dtype=name)  # the loaded model, another KV cache
        greedy = greedy_outputs(engine, prompts, args.greedy_tokens)
        baseline_greedy = baseline_greedy or greedy
        row = {
            "kv_cache_dtype": engine.core.kv_config.dtype_name,
            "bytes_per_token": engine.core.kv_config.bytes_per_token,
            "blocks_at_budget": num_blocks_for_budget(args.budget, engine.core.kv_config.bytes_per_block),
            "perplexity": perplexity(engine, ppl_ids),
            **agreement(baseline_greedy, greedy),
            "decode_tokens_per_s": decode_throughput(engine, decode_prompts, args.decode_tokens),
        }
        rows.append(row)
    base = rows[0]
    for row in rows:
        row["capacity_vs_float32"] = ratio(row["blocks_at_budget"], base["blocks_at_budget"])
        row["perplexity_delta_perc"] = 100.0 * (row["perplexity"] / base["perplexity"] - 1.0)
        row["decode_vs_float32"] = ratio(row["decode_tokens_per_s"], base["decode_tokens_per_s"])

    report = Report("kv-dtype", machine_info(), config_of(args))
    report.results = {
        "dtypes": rows,
        "granularity": granularity,
        "budget_bytes": args.budget,
        "ppl_tokens": len(ppl_ids) - 1,
        "greedy_prompts": len(prompts),
        "greedy_tokens": args.greedy_tokens,
        "decode_batch": args.decode_batch,
        "decode_context": args.decode_context,
    }
    for row in rows:
        d = row["kv_cache_dtype"]
        report.ratios.update(
            {
                f"capacity@{d}": row["capacity_vs_float32"],
                f"ppl_delta_perc@{d}": row["perplexity_delta_perc"],
                f"decode@{d}": row["decode_vs_float32"],
            }
        )
    main = Table(
        f"KV cache dtypes: blocks at {args.budget / GiB:g} GiB, perplexity on {len(ppl_ids) - 1} "
        f"tokens, greedy vs float32 KV ({len(prompts)} prompts x {args.greedy_tokens} tokens), decode at "
        f"batch {args.decode_batch}",
        [
            "kv dtype",
            "bytes/token",
            "blocks",
            "x fp32",
            "ppl",
            "ppl +%",
            "identical",
            "match %",
            "near-tie",
            "decode tok/s",
            "x fp32",
        ],
    )
    for r in rows:
        divergent = len(prompts) - r["greedy_identical_prompts"]
        main.add(
            r["kv_cache_dtype"],
            r["bytes_per_token"],
            r["blocks_at_budget"],
            r["capacity_vs_float32"],
            r["perplexity"],
            r["perplexity_delta_perc"],
            f"{r['greedy_identical_prompts']}/{len(prompts)}",
            r["greedy_match_perc"],
            f"{r['divergences_near_tie']}/{divergent}",
            r["decode_tokens_per_s"],
            r["decode_vs_float32"],
        )
    gran = Table(
        "Scale granularity: relative round-trip error of the model's real K/V (all layers)",
        ["format", "granularity", "K rel err", "V rel err"],
    )
    for g in granularity:
        gran.add(g["format"], g["granularity"], g["k_rel_err"], g["v_rel_err"])
    report.tables += [main, gran]
    report.notes.append(
        "identical: prompts whose greedy tokens equal float32 KV's throughout; near-tie: of the "
        "others, how many first diverge at a near-tie (vLLM's check_logprobs_close rule)"
    )
    emit(report, args.json)
    return 0


def random_prompts(engine: LLMEngine, n: int, length: int, seed: int) -> list[list[int]]:
    from kvserve.bench.systems import special_token_ids
    from kvserve.bench.workload import random_token_ids

    rng = random.Random(seed)
    exclude = special_token_ids(engine)
    return [random_token_ids(rng, length, engine.core.model_config.vocab_size, exclude) for _ in range(n)]


def perplexity_ids(engine: LLMEngine, text: str, num_tokens: int) -> list[int]:
    """What `perplexity` scores: the model's BOS (when it has one), then the first `num_tokens` tokens of `text`."""
    body = engine.tokenizer.encode(text, add_special_tokens=False)
    bos = engine.core.model_config.bos_token_id
    return ([] if bos is None else [bos]) + body[:num_tokens]


def perplexity(engine: LLMEngine, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of ids[1:], each token scored given all before it."""
    from kvserve.engine.llm import LLM
    from kvserve.sampling_params import SamplingParams

    out = LLM(engine=engine).generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    scored = [entry for entry in (out.prompt_logprobs or [])[1:] if entry is not None]  # position 0 has none
    if len(scored) != len(ids) - 1:
        raise RuntimeError(f"expected prompt logprobs at {len(ids) - 1} positions, got {len(scored)}")
    nll = [-entry[tok].logprob for tok, entry in zip(ids[1:], scored)]
    return math.exp(sum(nll) / len(nll))


def greedy_outputs(engine: LLMEngine, prompts: list[str], n: int) -> list:
    from kvserve.engine.llm import LLM
    from kvserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=TOP)
    return [o.outputs[0] for o in LLM(engine=engine).generate(prompts, params, use_tqdm=False)]


def agreement(reference: list, test: list) -> dict:
    """Greedy agreement of `test` with `reference` (completions with top-k logprobs), prompt by prompt."""
    first, matches, near_ties = [], 0, 0
    for ref, got in zip(reference, test):
        diff = next((i for i, (a, b) in enumerate(zip(ref.token_ids, got.token_ids)) if a != b), len(ref.token_ids))
        first.append(diff)
        matches += sum(a == b for a, b in zip(ref.token_ids, got.token_ids))
        if diff < len(ref.token_ids):
            near_ties += ref.token_ids[diff] in got.logprobs[diff] and got.token_ids[diff] in ref.logprobs[diff]
    total = sum(len(r.token_ids) for r in reference)
    return {
        "greedy_identical_prompts": sum(f == len(r.token_ids) for f, r in zip(first, reference)),
        "greedy_first_divergence": first,
        "greedy_match_perc": 100.0 * matches / total,
        "divergences_near_tie": near_ties,
    }


def decode_throughput(engine: LLMEngine, prompts: list[list[int]], tokens: int) -> float | None:
    """Generated tokens per second over the decode steps (all requests decoding), after one warm-up."""
    from kvserve.bench.systems import KVServeSystem

    system = KVServeSystem(engine)
    system.timed_generate([prompts[0][:8]], 2)
    step = system.timed_generate(prompts, tokens).decode_step_s
    return len(prompts) / step if step else None


def granularity_errors(engine: LLMEngine, ids: list[int], block_sizes: list[int]) -> list[dict]:
    """Prefill `ids` into a float32 engine's cache (bypassing the scheduler: one sequence in blocks 0..n-1,
    which the pool still counts as free, so later requests simply overwrite them), then measure each 8-bit
    format's round-trip error with scales per token-head, per block and per tensor (layer)."""
    import torch

    from kvserve.attention.metadata import AttentionMetadata
    from kvserve.kv.quant import KV_QUANT_FORMATS, fake_quantize

    runner, bs = engine.core.runner, engine.config.block_size
    n = len(ids)
    meta = AttentionMetadata.build([list(range(cdiv(n, bs)))], [n], [n], bs, engine.core.device)
    with torch.inference_mode():
        runner.model(
            torch.tensor(ids, device=engine.core.device),
            torch.arange(n, device=engine.core.device),
            runner.kv_caches,
            meta,
        )
        layers = [
            (
                c.key.view(-1, *c.key.shape[2:])[:n].float().clone(),
                c.value.view(-1, *c.value.shape[2:])[:n].float().clone(),
            )
            for c in runner.kv_caches
        ]

    def groups(x: torch.Tensor, how: str) -> tuple[torch.Tensor, tuple[int, ...]]:
        if how == "per-token-head":
            return x, (-1,)
        if how == "per-tensor":
            return x, (0, 1, 2)
        size = int(how.split()[-1])
        usable = x.shape[0] // size * size  # whole blocks only
        return x[:usable].reshape(-1, size, *x.shape[1:]), (1, 3)

    def rel_err(fmt, how: str, which: int) -> float:
        num = den = 0.0
        for layer in layers:
            x, dims = groups(layer[which], how)
            num += (fake_quantize(x, fmt, dims) - x).pow(2).sum().item()
            den += x.pow(2).sum().item()
        return math.sqrt(num / den)

    hows = ["per-token-head", *[f"per-block {b}" for b in block_sizes], "per-tensor"]
    return [
        {"format": name, "granularity": how, "k_rel_err": rel_err(fmt, how, 0), "v_rel_err": rel_err(fmt, how, 1)}
        for name, fmt in KV_QUANT_FORMATS.items()
        for how in hows
    ]
