"""`kvserve estimate`: KV bytes per token, KV GiB per context length and batch, and what fits in a budget.

The figures come from kvserve.capacity, the functions the engine sizes its pool with, so with the same flags
the block count printed here is the one `kvserve serve` allocates. No torch import on this path.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvserve.capacity import (
    KVShape,
    blocks_per_request,
    compare_contiguous,
    max_concurrent_requests,
    max_model_len_for_concurrency,
    plan_kv_cache,
    resolve_kv_dtype,
    tier_prefix_tokens,
)
from kvserve.capacity_catalog import CATALOG
from kvserve.kv.groups import KVCacheLayout
from kvserve.kv.offload.config import parse_offloading_size
from kvserve.kv.state import state_reservation
from kvserve.tools.model_facts import ModelFacts, resolve_model_facts
from kvserve.tools.report import add_json_arg, emit, int_list, table
from kvserve.tools.setup import Setup, add_sizing_args, resolve_setup
from kvserve.units import GiB, format_bytes, format_gib
from kvserve.vocab import KVDtype

SCHEMA = (
    "{model: {name, kind (catalog|hf-config|gguf), source, attention (MHA|GQA|MQA|MLA), num_layers, "
    "num_attention_heads, num_kv_heads, head_dim, head_dim_note, kv_factor (2 = K and V, 1 = MLA latent), "
    "sliding_windows (per layer, null = global), context_len, checkpoint_dtype, num_parameters, "
    "num_parameters_note, file_bytes}, device, dtype, quantization (none|q8_0|gguf, as serve resolves it), "
    "block_size, hybrid_kv_cache_manager (false: --disable-hybrid-kv-cache-manager), max_num_batched_tokens, "
    "weights: {bytes, formula}, "
    "budget: {kv_bytes, source (kv-cache-memory-bytes|memory|cpu-default), formula} | null, "
    "layout: {tensors_per_block (layers one block id spans), groups: [{group_id, kind (full_attention|"
    "sliding_window), sliding_window, layers}]}, "
    "kv: [{kv_cache_dtype, bytes_per_token (every layer), formula, terms: {kv_factor, num_layers, num_kv_heads, "
    "head_dim, element_bytes, scale_bytes}, layer_bytes_per_token, bytes_per_block (tensors_per_block layers x "
    "block_size tokens), plan: {num_blocks (the null block included), num_usable_blocks (num_blocks - 1), "
    "num_tokens (usable blocks x block_size), bytes, max_model_len, blocks_per_request (at max_model_len), "
    "prefill_reserve_blocks, max_concurrency} | null, "
    "seq_lens: [{seq_len, within_context, blocks_per_request (all groups, as the engine allocates), "
    "blocks_by_group (per group), bytes_per_request, uniform_bytes_per_request (if every layer kept every token), "
    "batches: [{batch, bytes, uniform_bytes}], max_concurrent_requests, max_concurrent_requests_uniform}], "
    "max_model_len_at_concurrency: [{concurrency, max_model_len}], "
    "offload: {bytes, num_blocks, num_tokens (of long prefixes: the full-attention groups' blocks)} | null (with "
    "--kv-offloading-size)}], "
    "compare_contiguous: {kv_cache_dtype, requests, avg_len, max_len, budget_bytes, contiguous: {allocated_bytes, "
    "used_bytes, waste_perc, requests_that_fit}, paged: {same keys}} | null}"
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "estimate",
        help="KV cache memory for a model: per token, per context, what fits",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_sizing_args(p)
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="one or more (comma-separated) of auto (= --dtype), float32, bfloat16, float16, fp8, "
        "fp8_e4m3, fp8_e5m2, int8; 8-bit types add a float32 scale per token per KV head per layer",
    )
    p.add_argument(
        "--seq-len",
        type=int_list,
        default="1024,4096,8192,32768",
        help="context lengths for the table (comma-separated; 4k = 4096)",
    )
    p.add_argument(
        "--batch",
        type=int_list,
        default="1,8,32",
        help="batch sizes (concurrent requests) for the table and for the largest max-model-len",
    )
    p.add_argument("--max-model-len", type=int, default=None, help="as for kvserve serve: checked against the pool")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None, help="as for kvserve serve")
    p.add_argument(
        "--kv-offloading-size",
        type=parse_offloading_size,
        default=None,
        help="as for kvserve serve (GiB, or with a unit): how many blocks and tokens an offload tier of this size "
        "holds, in each KV dtype (docs/KV_OFFLOAD.md)",
    )
    c = p.add_argument_group("contiguous vs paged")
    c.add_argument(
        "--compare-contiguous",
        action="store_true",
        help="compare a cache reserving --max-len per request with the paged cache",
    )
    c.add_argument("--requests", type=int, default=64)
    c.add_argument("--avg-len", type=int, default=1024)
    c.add_argument("--max-len", type=int, default=None, help="default: the model's context length")
    p.add_argument("--plot", metavar="FILE.png", default=None, help="plot KV GiB vs context length (matplotlib)")
    add_json_arg(p, SCHEMA)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.list_models:
        print(catalog_text())
        return 0
    facts = resolve_model_facts(args.model)
    setup = resolve_setup(args, facts)
    kv_dtypes = [resolve_kv_dtype(name.strip(), setup.dtype) for name in args.kv_cache_dtype.split(",")]
    doc = build_estimate(
        facts,
        setup,
        kv_dtypes,
        args.seq_len,
        args.batch,
        args.max_model_len,
        args.num_gpu_blocks_override,
        args.kv_offloading_size,
    )
    if args.compare_contiguous:
        doc["compare_contiguous"] = contiguous_section(doc, args.requests, args.avg_len, args.max_len)
    if args.plot:
        plot_estimate(facts, setup, kv_dtypes, args.plot)
    emit(doc, render_estimate(doc), args.json)
    return 0


def catalog_text() -> str:
    rows = [(e.name, e.config["model_type"], f"{e.num_parameters / 1e9:.2f}B", e.source) for e in CATALOG]
    return table(["name", "model_type", "params", "source"], rows)


def build_estimate(
    facts: ModelFacts,
    setup: Setup,
    kv_dtypes: list[KVDtype],
    seq_lens: list[int],
    batches: list[int],
    max_model_len: int | None = None,
    num_blocks_override: int | None = None,
    offload_bytes: int | None = None,
) -> dict[str, Any]:
    """Everything estimate reports, as the JSON document; the table is rendered from it."""
    layout = facts.shape.layout(setup.hybrid)
    doc: dict[str, Any] = {
        "model": facts.to_json(),
        **setup.to_json(),
        "layout": {
            "tensors_per_block": layout.tensors_per_block,
            "groups": [
                {"group_id": g.group_id, "kind": g.spec.kind, "sliding_window": g.spec.window, "layers": list(g.layers)}
                for g in layout.groups
            ],
        },
        "kv": [],
        "compare_contiguous": None,
    }
    for kv_dtype in kv_dtypes:
        section = _dtype_section(facts, setup, kv_dtype, seq_lens, batches, max_model_len, num_blocks_override)
        section["offload"] = None if offload_bytes is None else _offload_section(section, setup, offload_bytes, layout)
        doc["kv"].append(section)
    return doc


def _offload_section(kv: dict[str, Any], setup: Setup, offload_bytes: int, layout: KVCacheLayout) -> dict[str, Any]:
    """What an offload tier of `offload_bytes` holds: whole blocks in the cache's own dtype (as the tier stores them:
    kvserve/kv/offload/tier.py's BlockLayout is exactly one pool block's bytes), and the tokens of long prefixes that
    makes (capacity.tier_prefix_tokens: the full-attention groups' blocks)."""
    num_blocks = offload_bytes // kv["bytes_per_block"]
    num_tokens = tier_prefix_tokens(num_blocks, setup.block_size, layout)
    return {"bytes": offload_bytes, "num_blocks": num_blocks, "num_tokens": num_tokens}


def _dtype_section(
    facts: ModelFacts,
    setup: Setup,
    kv_dtype: KVDtype,
    seq_lens: list[int],
    batches: list[int],
    max_model_len: int | None,
    num_blocks_override: int | None,
) -> dict[str, Any]:
    shape, bs = facts.shape, setup.block_size
    layout = shape.layout(setup.hybrid)
    bytes_per_block = shape.bytes_per_block(layout, kv_dtype, bs)
    uniform_block = shape.bytes_per_token(kv_dtype) * bs  # a block of every layer (the uniform layout's)
    plan = None
    budget = None if setup.budget is None else setup.budget.kv_bytes
    state = None
    if facts.state is not None:  # the state layers' slots come out of the budget first, as in the engine
        state = state_reservation(facts.state, setup.max_num_seqs, budget, bytes_per_block=bytes_per_block)
        budget = None if budget is None else max(budget - state.bytes, 0)
    if setup.budget is not None or num_blocks_override is not None:
        plan = plan_kv_cache(
            bytes_per_block,
            bs,
            facts.context_len,
            budget_bytes=budget,
            num_blocks_override=num_blocks_override,
            max_model_len=max_model_len,
            layout=layout,
            max_num_batched_tokens=setup.max_num_batched_tokens,
        )
    rows = []
    for seq_len in seq_lens:
        blocks = layout.blocks_per_request(seq_len, bs)
        allocated = blocks * bytes_per_block
        uniform = blocks_per_request(seq_len, bs) * uniform_block
        rows.append(
            {
                "seq_len": seq_len,
                "within_context": seq_len <= facts.context_len,
                "blocks_per_request": blocks,
                "blocks_by_group": [g.spec.blocks_held(seq_len, bs) for g in layout.groups],
                "bytes_per_request": allocated,
                "uniform_bytes_per_request": uniform,
                "batches": [{"batch": b, "bytes": b * allocated, "uniform_bytes": b * uniform} for b in batches],
                "max_concurrent_requests": None
                if plan is None
                else max_concurrent_requests(plan.num_blocks, seq_len, bs, layout, setup.max_num_batched_tokens),
                "max_concurrent_requests_uniform": None
                if plan is None
                else plan.num_usable_blocks * bytes_per_block // uniform,
            }
        )
    return {
        "kv_cache_dtype": kv_dtype.name,
        "state_slots": None if state is None else state.to_json(),
        "bytes_per_token": shape.bytes_per_token(kv_dtype),
        "formula": shape.formula(kv_dtype),
        "terms": {
            "kv_factor": shape.kv_factor,
            "num_layers": shape.num_layers,
            "num_kv_heads": shape.num_kv_heads,
            "head_dim": shape.head_dim,
            "element_bytes": kv_dtype.element_bytes,
            "scale_bytes": kv_dtype.scale_bytes,
        },
        "layer_bytes_per_token": shape.layer_bytes_per_token(kv_dtype),
        "bytes_per_block": bytes_per_block,
        "plan": None
        if plan is None
        else {
            "num_blocks": plan.num_blocks,
            "num_usable_blocks": plan.num_usable_blocks,
            "num_tokens": plan.num_tokens,
            "bytes": plan.num_blocks * bytes_per_block,
            "max_model_len": plan.max_model_len,
            "blocks_per_request": plan.blocks_per_request(plan.max_model_len),
            "prefill_reserve_blocks": plan.prefill_reserve,
            "max_concurrency": round(plan.max_concurrency, 3),
        },
        "seq_lens": rows,
        "max_model_len_at_concurrency": None
        if plan is None
        else [
            {
                "concurrency": b,
                "max_model_len": max_model_len_for_concurrency(
                    plan.num_blocks, bs, b, facts.context_len, layout, setup.max_num_batched_tokens
                ),
            }
            for b in batches
        ],
    }


def group_arithmetic(layout: KVCacheLayout, seq_len: int, block_size: int) -> str:
    """The blocks one request of seq_len holds, group by group, e.g. "1 full-attention group x 2048 blocks + 5 sliding
    window 512 groups x 32 blocks = 2208 blocks" (the per-group arithmetic behind bytes per request)."""
    terms: dict[tuple[str, int], int] = {}
    for g in layout.groups:
        key = (g.spec.describe(), g.spec.blocks_held(seq_len, block_size))
        terms[key] = terms.get(key, 0) + 1
    parts = [f"{n} {what} group{'s' if n > 1 else ''} x {held} blocks" for (what, held), n in terms.items()]
    return f"{' + '.join(parts)} = {layout.blocks_per_request(seq_len, block_size)} blocks"


def contiguous_section(doc: dict[str, Any], requests: int, avg_len: int, max_len: int | None) -> dict[str, Any]:
    """Contiguous vs paged for the first KV dtype, within the KV budget."""
    kv = doc["kv"][0]
    if doc["budget"] is None:
        raise ValueError("--compare-contiguous needs a budget: --kv-cache-memory-bytes or --memory")
    max_len = max_len or doc["model"]["context_len"]
    budget = doc["budget"]["kv_bytes"]
    cmp = compare_contiguous(kv["bytes_per_token"], doc["block_size"], requests, avg_len, max_len, budget)
    layouts = {
        name: {
            "allocated_bytes": u.allocated_bytes,
            "used_bytes": u.used_bytes,
            "waste_perc": round(u.waste_perc, 2),
            "requests_that_fit": u.requests_that_fit,
        }
        for name, u in (("contiguous", cmp.contiguous), ("paged", cmp.paged))
    }
    return {
        "kv_cache_dtype": kv["kv_cache_dtype"],
        "requests": requests,
        "avg_len": avg_len,
        "max_len": max_len,
        "budget_bytes": budget,
        **layouts,
    }


def render_estimate(doc: dict[str, Any]) -> str:
    m = doc["model"]
    windows = sorted({w for w in m["sliding_windows"] if w is not None})
    lines = [
        f"Model: {m['name']} ({m['kind']}: {m['source']})",
        (
            f"  {m['attention']}: {m['num_layers']} layers, {m['num_attention_heads']} query heads, "
            f"{m['num_kv_heads']} KV heads, head_dim {m['head_dim']} ({m['head_dim_note']}), "
            f"context {m['context_len']}"
        ),
    ]
    if windows:
        n_local = sum(w is not None for w in m["sliding_windows"])
        lines.append(f"  sliding window {', '.join(map(str, windows))} on {n_local} of {m['num_layers']} layers")
    if m.get("state"):
        lines.append(f"  state layers (no KV; the layers above are the attention layers): {m['state']['formula']}")
    layout = _layout_of(doc)
    if layout.is_hybrid:
        lines.append(f"KV cache groups: {layout.describe()}; one block id spans {layout.tensors_per_block} layers")
    else:
        why = " (--disable-hybrid-kv-cache-manager)" if windows else ""
        lines.append(f"KV cache: one group, every layer keeps every token{why}")
    weights = doc["weights"]
    lines.append(
        f"Weights ({doc['dtype'] if doc['quantization'] == 'none' else doc['quantization']} on {doc['device']}): "
        + (f"{format_gib(weights['bytes'])} = {weights['formula']}" if weights["bytes"] else weights["formula"])
    )
    if doc["budget"]:
        lines.append(f"KV budget: {format_gib(doc['budget']['kv_bytes'])} = {doc['budget']['formula']}")
    for kv in doc["kv"]:
        lines += [
            "",
            f"KV per token ({kv['kv_cache_dtype']}): {kv['formula']} ({format_bytes(kv['bytes_per_token'])})",
            f"  one block of {doc['block_size']} tokens x {layout.tensors_per_block} layers = "
            f"{kv['bytes_per_block']} bytes",
        ]
        if kv.get("state_slots"):
            lines.append(f"  state slots, out of the budget first: {kv['state_slots']['formula']}")
        if kv["plan"]:
            p = kv["plan"]
            reserve = p["prefill_reserve_blocks"]
            concurrency = (p["num_usable_blocks"] - reserve) / p["blocks_per_request"]  # as the start-up line
            lines.append(
                f"  budget holds {p['num_blocks']} blocks ({p['num_usable_blocks']} usable + 1 null) "
                f"({format_gib(p['bytes'])}); max-model-len {p['max_model_len']}: a request holds "
                f"{group_arithmetic(layout, p['max_model_len'], doc['block_size'])}"
                + (f", plus {reserve} kept for a prefill chunk" if reserve else "")
                + f"; max concurrency {concurrency:.2f}x"
            )
        if kv.get("offload"):
            o = kv["offload"]
            lines.append(
                f"  an offload tier of {format_gib(o['bytes'])} holds {o['num_blocks']} blocks = {o['num_tokens']} "
                "tokens of long prefixes (--kv-offloading-size)"
            )
        lines += ["", _seq_len_table(kv, hybrid=layout.is_hybrid)]
        if kv["max_model_len_at_concurrency"]:
            at = ", ".join(f"{c['concurrency']} -> {c['max_model_len']}" for c in kv["max_model_len_at_concurrency"])
            lines.append(f"Largest max-model-len for N concurrent full-length requests: {at}")
    if layout.is_hybrid:
        lines += [
            "",
            (
                "Sliding-window groups give their blocks back once no query can see them (docs/KV_CACHE.md); the "
                "uniform columns are what --disable-hybrid-kv-cache-manager (every layer keeps every token) needs."
            ),
        ]
    if doc["compare_contiguous"]:
        lines += ["", _contiguous_text(doc["compare_contiguous"])]
    return "\n".join(lines)


def _layout_of(doc: dict[str, Any]) -> KVCacheLayout:
    return KVShape(doc["model"]["num_layers"], 1, 1, 1, tuple(doc["model"]["sliding_windows"])).layout(
        doc["hybrid_kv_cache_manager"]
    )


def _seq_len_table(kv: dict[str, Any], hybrid: bool) -> str:
    rows = kv["seq_lens"]
    batches = [b["batch"] for b in rows[0]["batches"]] if rows else []
    headers = ["seq_len", "blocks"] + [f"KV GiB batch {b}" for b in batches]
    if rows and rows[0]["max_concurrent_requests"] is not None:
        headers.append("max concurrent")
    if hybrid:
        headers += [f"uniform batch {b}" for b in batches] + (
            ["uniform concurrent"] if "max concurrent" in headers else []
        )
    out = []
    for r in rows:
        row = [f"{r['seq_len']}{'' if r['within_context'] else ' (> context)'}", r["blocks_per_request"]]
        row += [f"{b['bytes'] / GiB:.3f}" for b in r["batches"]]
        if r["max_concurrent_requests"] is not None:
            row.append(r["max_concurrent_requests"])
        if hybrid:
            row += [f"{b['uniform_bytes'] / GiB:.3f}" for b in r["batches"]]
            if r["max_concurrent_requests_uniform"] is not None:
                row.append(r["max_concurrent_requests_uniform"])
        out.append(row)
    return table(headers, out)


def _contiguous_text(c: dict[str, Any]) -> str:
    rows = [
        (
            name,
            format_gib(c[name]["allocated_bytes"]),
            format_gib(c[name]["used_bytes"]),
            f"{c[name]['waste_perc']:.1f}%",
            c[name]["requests_that_fit"],
        )
        for name in ("contiguous", "paged")
    ]
    head = (
        f"{c['requests']} requests of {c['avg_len']} tokens on average, max-len {c['max_len']}, "
        f"{c['kv_cache_dtype']} KV, budget {format_gib(c['budget_bytes'])}:"
    )
    return head + "\n" + table(["layout", "allocated", "used", "waste", "requests that fit"], rows)


def plot_estimate(facts: ModelFacts, setup: Setup, kv_dtypes: list[KVDtype], path: str) -> None:
    """KV GiB of one request against context length, per KV dtype (dashed: the uniform layout, where the model has
    sliding windows)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from e
    shape, bs = facts.shape, setup.block_size
    layout = shape.layout(setup.hybrid)
    lengths = sorted({min(2**k, facts.context_len) for k in range(7, 25)})
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for kv_dtype in kv_dtypes:
        per_block = shape.bytes_per_block(layout, kv_dtype, bs)
        ax.plot(
            lengths,
            [layout.blocks_per_request(n, bs) * per_block / GiB for n in lengths],
            marker="o",
            label=f"{kv_dtype.name}",
        )
        if layout.is_hybrid:
            uniform = shape.bytes_per_token(kv_dtype) * bs
            ax.plot(
                lengths,
                [blocks_per_request(n, bs) * uniform / GiB for n in lengths],
                linestyle="--",
                label=f"{kv_dtype.name}, uniform layout",
            )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("KV cache per request (GiB)")
    ax.set_title(f"{facts.name}: KV cache vs context")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
