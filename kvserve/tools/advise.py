"""`kvserve advise`: recommend max-model-len, max-num-seqs and a KV dtype for a scenario and a memory size.

The recommendation comes with the trade-off it was chosen from (concurrent requests at each candidate
max-model-len and KV dtype), computed with the engine's own sizing rule. Scenarios are data, not code paths.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from kvserve.capacity import max_concurrent_requests, num_blocks_for_budget, resolve_kv_dtype, tier_prefix_tokens
from kvserve.capacity_catalog import find_entry
from kvserve.kv.offload.config import parse_offloading_size
from kvserve.kv.state import state_reservation
from kvserve.tools.estimate import catalog_text
from kvserve.tools.model_facts import ModelFacts, resolve_model_facts
from kvserve.tools.report import add_json_arg, emit, table
from kvserve.tools.setup import Setup, add_sizing_args, resolve_setup
from kvserve.units import GiB, format_gib
from kvserve.vocab import KVDtype

MAX_NUM_SEQS_CAP = 256  # kvserve serve's (and vLLM's) default --max-num-seqs
EIGHT_BIT_KV = "fp8"


@dataclass(frozen=True, slots=True)
class Scenario:
    """A workload: a typical request's length (prompt + output), the longest one it must accept, and how many
    requests run at once."""

    name: str
    description: str
    typical_len: int
    needed_len: int
    expected_concurrency: int


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("real_time_chat", "many users, short multi-turn chats; latency matters", 2048, 8192, 32),
        Scenario("document_qa", "questions over a few pages of retrieved text", 8192, 32768, 8),
        Scenario("long_document_analysis", "whole reports or books in one prompt, few at a time", 32768, 131072, 2),
        Scenario("custom", "your numbers: --typical-len, --needed-len, --expected-concurrency", 4096, 16384, 8),
    )
}

SCHEMA = (
    "{model: {as in estimate}, device, dtype, block_size, weights: {bytes, formula}, budget: {kv_bytes, source, "
    "formula}, scenario: {name, description, typical_len, needed_len, expected_concurrency}, "
    "candidates: [{max_model_len, kv_cache_dtype, num_blocks, max_concurrent_requests (all at max_model_len), "
    "concurrent_requests_at_typical_len}], recommendation: {max_model_len, max_num_seqs, kv_cache_dtype, "
    "command, weights: how to get them | null}, offload: {bytes, kv_cache_dtype, num_blocks, num_tokens, "
    "typical_requests} | null "
    "(with --kv-offloading-size), warnings: [str], explanation: str}"
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "advise",
        help="recommend max-model-len, max-num-seqs and KV dtype for a workload",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_sizing_args(p)
    p.add_argument(
        "--scenario",
        choices=list(SCENARIOS),
        default="real_time_chat",
        help="; ".join(
            f"{s.name}: {s.description} (typical {s.typical_len}, needs {s.needed_len}, "
            f"{s.expected_concurrency} at once)"
            for s in SCENARIOS.values()
        ),
    )
    p.add_argument("--expected-concurrency", type=int, default=None, help="override the scenario's")
    p.add_argument("--typical-len", type=int, default=None, help="override: typical prompt + output tokens")
    p.add_argument("--needed-len", type=int, default=None, help="override: the longest request to accept")
    p.add_argument(
        "--kv-offloading-size",
        type=parse_offloading_size,
        default=None,
        help="as for kvserve serve (GiB, or with a unit): also say how many tokens, and typical requests' "
        "prefixes, an offload tier of this size keeps in the recommended KV dtype (docs/KV_OFFLOAD.md)",
    )
    add_json_arg(p, SCHEMA)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.list_models:
        print(catalog_text())
        return 0
    facts = resolve_model_facts(args.model)
    setup = resolve_setup(args, facts)
    overrides = {
        k: v
        for k, v in (
            ("expected_concurrency", args.expected_concurrency),
            ("typical_len", args.typical_len),
            ("needed_len", args.needed_len),
        )
        if v is not None
    }
    scenario = replace(SCENARIOS[args.scenario], **overrides)
    if min(scenario.typical_len, scenario.needed_len, scenario.expected_concurrency) < 1:
        raise ValueError("--typical-len, --needed-len and --expected-concurrency must be >= 1")
    doc = advise(facts, setup, scenario, args.model, args.kv_offloading_size)
    emit(doc, render_advice(doc), args.json)
    return 0


def _serve_model(facts: ModelFacts, model_arg: str | None) -> tuple[str | None, str | None]:
    """What `kvserve serve --model` takes for the model advised on, and how to get its weights when they are not on
    this machine (None: they are): a catalog name is facts without weights, so the command names a placeholder
    directory to download them into; a config.json's directory is the checkpoint serve loads."""
    if model_arg is None:
        return None, None
    if facts.kind == "catalog":
        entry = find_entry(model_arg)
        assert entry is not None
        directory = f"/path/to/{entry.repo_id.rsplit('/', 1)[-1]}"
        return (
            directory,
            f"not on this machine: {entry.download_hint(directory)} (docs/MODELS.md), then run the command",
        )
    path = Path(model_arg).expanduser()
    if path.suffix == ".json" and path.is_file():
        return str(path.parent), None
    return model_arg, None


def candidate_lengths(context_len: int, needed_len: int) -> list[int]:
    """4k, 8k, 16k, ... up to the model's context (which is always a candidate), plus the needed length."""
    lengths = {min(4096 << k, context_len) for k in range(12) if (4096 << k) < 2 * context_len}
    lengths.add(min(needed_len, context_len))
    return sorted(lengths)


def advise(
    facts: ModelFacts, setup: Setup, scenario: Scenario, model_arg: str | None, offload_bytes: int | None = None
) -> dict[str, Any]:
    if setup.budget is None:
        raise ValueError("advise needs a budget: --memory or --kv-cache-memory-bytes")
    bs = setup.block_size
    dtypes = [resolve_kv_dtype("auto", setup.dtype)]
    if not dtypes[0].is_8bit:
        dtypes.append(resolve_kv_dtype(EIGHT_BIT_KV, setup.dtype))
    layout = facts.shape.layout(setup.hybrid)
    # A hybrid model's state layers take their slots out of the budget first, as the engine does (kv/state.py): a slot
    # for each sequence the scenario runs at once, and the snapshots for them.
    state = None
    kv_bytes = setup.budget.kv_bytes
    if facts.state is not None:
        sequences = max(1, min(MAX_NUM_SEQS_CAP, scenario.expected_concurrency))
        block = facts.shape.bytes_per_block(layout, dtypes[0], bs)  # the engine's default KV dtype sizes snapshots
        state = state_reservation(facts.state, sequences, kv_bytes, bytes_per_block=block)
        kv_bytes = max(kv_bytes - state.bytes, 0)
    blocks = {d.name: _blocks(facts, setup, d, kv_bytes) for d in dtypes}
    lengths = candidate_lengths(facts.context_len, scenario.needed_len)

    def fit(num_blocks: int, seq_len: int) -> int:
        """Requests of seq_len that num_blocks hold at once (with the KV cache groups the engine would use)."""
        if not num_blocks:
            return 0
        return max_concurrent_requests(num_blocks, seq_len, bs, layout, setup.max_num_batched_tokens)

    candidates = [
        {
            "max_model_len": n,
            "kv_cache_dtype": d.name,
            "num_blocks": blocks[d.name],
            "max_concurrent_requests": fit(blocks[d.name], n),
            "concurrent_requests_at_typical_len": fit(blocks[d.name], min(scenario.typical_len, n)),
        }
        for n in lengths
        for d in dtypes
    ]
    warnings: list[str] = []
    target_len = min(scenario.needed_len, facts.context_len)
    if scenario.needed_len > facts.context_len:
        warnings.append(
            f"the scenario needs {scenario.needed_len} tokens but the model's context is "
            f"{facts.context_len}; requests are capped there."
        )
    chosen = _choose(candidates, target_len, scenario, dtypes)
    if chosen["max_model_len"] < target_len:
        warnings.append(
            f"even with {chosen['kv_cache_dtype']} KV one request of {target_len} tokens does not fit "
            f"in the KV budget; max-model-len is cut to {chosen['max_model_len']}."
        )
    typical = chosen["concurrent_requests_at_typical_len"]
    max_num_seqs = max(1, min(MAX_NUM_SEQS_CAP, typical))
    if state is not None:  # no more sequences than the state slots reserved above (fewer reserve less)
        max_num_seqs = min(max_num_seqs, state.num_sequences)
    if typical < scenario.expected_concurrency:
        warnings.append(
            f"only {typical} requests of the typical {scenario.typical_len} tokens fit at once, "
            f"fewer than the expected {scenario.expected_concurrency}: the rest wait in the queue; "
            f"add memory, or use a smaller model."
        )
    elif chosen["max_concurrent_requests"] < scenario.expected_concurrency:
        warnings.append(
            f"if {scenario.expected_concurrency} requests all reach max-model-len "
            f"{chosen['max_model_len']} together, only {chosen['max_concurrent_requests']} fit; the "
            f"others are preempted and recomputed later (slower, nothing lost)."
        )
    serve_model, weights = _serve_model(facts, model_arg)
    command = (
        f"kvserve serve{'' if serve_model is None else ' --model ' + serve_model} "
        f"--max-model-len {chosen['max_model_len']} --max-num-seqs {max_num_seqs} "
        f"--kv-cache-dtype {chosen['kv_cache_dtype']} --kv-cache-memory-bytes {setup.budget.kv_bytes}"
    )
    offload = None
    if offload_bytes is not None:
        kv_dtype = next(d for d in dtypes if d.name == chosen["kv_cache_dtype"])
        tier_blocks = offload_bytes // facts.shape.bytes_per_block(layout, kv_dtype, bs)
        tier_tokens = tier_prefix_tokens(tier_blocks, bs, layout)  # the full-attention groups' blocks
        offload = {
            "bytes": offload_bytes,
            "kv_cache_dtype": kv_dtype.name,
            "num_blocks": tier_blocks,
            "num_tokens": tier_tokens,
            "typical_requests": tier_tokens // scenario.typical_len,
        }
        size = f"{offload_bytes // GiB}" if offload_bytes % GiB == 0 else f"{offload_bytes}B"  # a bare number: GiB
        command += f" --kv-offloading-size {size}"
    return {
        "model": facts.to_json(),
        **setup.to_json(),
        "scenario": asdict(scenario),
        "candidates": candidates,
        "recommendation": {
            "max_model_len": chosen["max_model_len"],
            "max_num_seqs": max_num_seqs,
            "kv_cache_dtype": chosen["kv_cache_dtype"],
            "command": command,
            "weights": weights,
        },
        "offload": offload,
        "state_slots": None if state is None else state.to_json(),
        "warnings": warnings,
        "explanation": _explain(chosen, dtypes, candidates, scenario),
    }


def _blocks(facts: ModelFacts, setup: Setup, kv_dtype: KVDtype, kv_bytes: int) -> int:
    per_block = facts.shape.bytes_per_block(facts.shape.layout(setup.hybrid), kv_dtype, setup.block_size)
    try:
        return num_blocks_for_budget(kv_bytes, per_block)
    except ValueError:
        return 0


def _choose(
    candidates: list[dict[str, Any]], target_len: int, scenario: Scenario, dtypes: list[KVDtype]
) -> dict[str, Any]:
    """The needed length with the widest dtype that serves the expected concurrency at typical length; else the
    dtype that serves the most; if nothing holds one request of that length, the longest length that fits."""
    at_target = [c for c in candidates if c["max_model_len"] == target_len and c["max_concurrent_requests"] >= 1]
    if not at_target:
        fitting = [c for c in candidates if c["max_concurrent_requests"] >= 1]
        if not fitting:
            raise ValueError("the KV budget does not hold even one request of the shortest candidate length")
        return max(fitting, key=lambda c: (c["max_model_len"], c["concurrent_requests_at_typical_len"]))
    enough = [c for c in at_target if c["concurrent_requests_at_typical_len"] >= scenario.expected_concurrency]
    if enough:
        return enough[0]  # candidates are ordered widest dtype first
    return max(at_target, key=lambda c: c["concurrent_requests_at_typical_len"])


def _explain(
    chosen: dict[str, Any], dtypes: list[KVDtype], candidates: list[dict[str, Any]], scenario: Scenario
) -> str:
    covers = "covers" if chosen["max_model_len"] >= scenario.needed_len else "is as close as this model allows to"
    first = (
        f"max-model-len {chosen['max_model_len']} {covers} the scenario's longest request ({scenario.needed_len} "
        f"tokens), and {chosen['kv_cache_dtype']} KV holds {chosen['concurrent_requests_at_typical_len']} "
        f"requests of the typical {scenario.typical_len} tokens at once."
    )
    meets = chosen["concurrent_requests_at_typical_len"] >= scenario.expected_concurrency
    if chosen["kv_cache_dtype"] == dtypes[0].name:
        kept = f" That meets the expected {scenario.expected_concurrency}, so the full-precision KV dtype is kept."
        return first + (kept if meets else "")
    wide = next(
        c for c in candidates if c["max_model_len"] == chosen["max_model_len"] and c["kv_cache_dtype"] == dtypes[0].name
    )
    ratio = chosen["num_blocks"] / max(wide["num_blocks"], 1)
    return first + (
        f" {dtypes[0].name} KV would hold only {wide['concurrent_requests_at_typical_len']}; 8-bit KV "
        f"fits {ratio:.1f}x the tokens for a small accuracy cost (measure it with kvserve bench kv-dtype)."
    )


def render_advice(doc: dict[str, Any]) -> str:
    s, r = doc["scenario"], doc["recommendation"]
    dtypes = list(dict.fromkeys(c["kv_cache_dtype"] for c in doc["candidates"]))
    lengths = list(dict.fromkeys(c["max_model_len"] for c in doc["candidates"]))
    by = {(c["max_model_len"], c["kv_cache_dtype"]): c for c in doc["candidates"]}
    rows = [[n] + [by[n, d]["max_concurrent_requests"] for d in dtypes] for n in lengths]
    typical = ", ".join(f"{d}: {by[r['max_model_len'], d]['concurrent_requests_at_typical_len']}" for d in dtypes)
    lines = [
        (
            f"Model: {doc['model']['name']}; {doc['dtype'] if doc['quantization'] == 'none' else doc['quantization']} "
            f"weights ({format_gib(doc['weights']['bytes'] or 0)}) on "
            f"{doc['device']}; KV budget {format_gib(doc['budget']['kv_bytes'])} = {doc['budget']['formula']}"
        ),
        (
            f"Scenario {s['name']}: {s['description']}; typical {s['typical_len']} tokens, longest {s['needed_len']}, "
            f"{s['expected_concurrency']} at once"
        ),
        *(
            [f"State layers' slots, out of the budget first: {doc['state_slots']['formula']}"]
            if doc.get("state_slots")
            else []
        ),
        "",
        "Concurrent requests, all at max-model-len:",
        table(["max-model-len", *dtypes], rows),
        f"Requests of the typical length that fit at once: {typical}",
        "",
        (
            f"Recommended: --max-model-len {r['max_model_len']} --max-num-seqs {r['max_num_seqs']} "
            f"--kv-cache-dtype {r['kv_cache_dtype']}"
        ),
        f"  {r['command']}",
        *([f"Weights: {r['weights']}"] if r.get("weights") else []),
        f"Why: {doc['explanation']}",
    ]
    if doc.get("offload"):
        o = doc["offload"]
        lines.append(
            f"Offload tier: {format_gib(o['bytes'])} holds {o['num_tokens']} tokens of {o['kv_cache_dtype']} KV, the "
            f"prefixes of {o['typical_requests']} typical requests, kept when the pool evicts them"
        )
    lines += [f"Warning: {w}" for w in doc["warnings"]]
    return "\n".join(lines)
