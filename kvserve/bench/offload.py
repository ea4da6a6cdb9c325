"""`kvserve bench offload`: what the KV offload tier buys, measured on a small pool so that the working set outgrows it
in minutes. Three scenarios, the tier on against the tier off in the same run (engines sharing one loaded model):
(1) multi-round chat in LMCache's shape, users with a long system prompt each and a history growing every round,
sized to several times the pool: TTFT p50/p90, throughput and hit rate per tier, for no tier, a host-memory tier,
a disk tier, and a pool enlarged by the host tier's bytes (what the same memory buys without a tier); (2) a restart:
TTFT of a long prompt on a fresh engine whose disk tier an earlier engine filled, with the files in the page cache
and with them dropped from it (posix_fadvise DONTNEED, no root needed), against cold; (3) no reuse at all (random
prompts in one batch): what the tier costs when it never hits."""

from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvserve.bench.chat import one_request
from kvserve.bench.options import add_engine_args, add_output_args, add_repeats_arg, int_list, new_command
from kvserve.units import MiB, parse_size

if TYPE_CHECKING:
    from kvserve.engine.engine import LLMEngine

SCHEMA = """\
results: {"multi_round": {"users", "rounds", "system_tokens", "working_set_tokens", "pool_tokens",
            "systems": {NAME: {"ttft_ms_p50", "ttft_ms_p90", "throughput_tok_s", "pool_hit_rate", "tier_hit_rate",
                               "ttft_ms": [...]}}},
          "restart": [{"prompt_tokens", "cold_ttft_ms", "page_cache_ttft_ms", "dropped_ttft_ms", "restored_tokens"}],
          "no_reuse": {"requests", "prompt_tokens",
                       "systems": {NAME: {"throughput_tok_s", "runs": [...], "stored_blocks", "dropped_blocks"}}},
          "accuracy": {"prompts", "prompt_tokens", "output_tokens", "tiers": {"auto"|"int8": {"block_bytes",
            "identical_continuations", "mean_first_divergence", "restored_tokens"}}},
          "llama_server": null | {"kvserve_args", "llama_server_args", "systems": {"kvserve"|"llama-server":
            {"ttft_ms_p50", "ttft_ms_p90", "throughput_tok_s", "cached_tokens_reported", "ttft_ms": [...]}}}}
NAME: "no tier", "host tier", "disk tier", "pool + tier bytes".
ratios: {"multi_round_ttft_p50_host_over_off", "multi_round_ttft_p50_disk_over_off",
         "multi_round_throughput_host_over_off", "multi_round_throughput_disk_over_off",
         "multi_round_ttft_p50_host_over_big_pool", "restart_page_cache_over_cold" (first prompt length),
         "restart_dropped_over_cold", "no_reuse_throughput_host_over_off", "no_reuse_throughput_disk_over_off",
         "llama_server_ttft_p50_kvserve_over_peer", "llama_server_throughput_kvserve_over_peer" (with --llama-server),
         "int8_tier_blocks_over_exact"}
TTFT: from add_request to the step that produced the request's first token (the engine driven directly, no HTTP).
throughput: prompt + generated tokens over the scenario's wall time on that engine."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = new_command(
        sub, "offload", "the KV offload tier on against off: multi-round chat, restart, no reuse", __doc__, SCHEMA
    )
    p.add_argument("--pool-bytes", type=parse_size, default=128 * MiB, help="the KV pool of every engine but one")
    p.add_argument("--tier-bytes", type=parse_size, default=1024 * MiB, help="the offload tier's size")
    p.add_argument("--users", type=int, default=8, help="multi-round chat: users, each with a system prompt")
    p.add_argument("--rounds", type=int, default=4, help="multi-round chat: rounds (every user asks once a round)")
    p.add_argument("--system-tokens", type=int, default=1000, help="multi-round chat: tokens of each system prompt")
    p.add_argument("--question-tokens", type=int, default=50, help="multi-round chat: tokens of each question")
    p.add_argument("--output-len", type=int, default=32, help="tokens generated per request")
    p.add_argument(
        "--restart-tokens", type=int_list, default=[8192, 32768], help="restart: prompt lengths (comma-separated)"
    )
    p.add_argument("--no-reuse-requests", type=int, default=16, help="no reuse: random prompts in one batch")
    p.add_argument("--no-reuse-tokens", type=int, default=512, help="no reuse: tokens of each prompt")
    p.add_argument("--accuracy-prompts", type=int, default=8, help="restore accuracy: GPL-3 windows restored")
    p.add_argument("--accuracy-tokens", type=int, default=512, help="restore accuracy: tokens of each window")
    p.add_argument("--accuracy-output", type=int, default=32, help="restore accuracy: greedy tokens compared")
    p.add_argument(
        "--llama-server",
        default=None,
        metavar="PATH",
        help="also run the multi-round chat over HTTP against `kvserve serve` with a host tier and this llama-server "
        "with its prompt cache (--cache-ram of the tier's size, where the build has it; scripts/build_llama_cpp.sh)",
    )
    p.add_argument("--tier-dir", default=None, help="where the disk tiers go (default: a temporary directory)")
    add_repeats_arg(p, 3)
    add_output_args(p, "TTFT of every multi-round request, per system")
    add_engine_args(p)
    p.set_defaults(func=run)


def _batch(engine: LLMEngine, prompts: list[list[int]], output_len: int, tag: str) -> float:
    """Every prompt added at once, run to the end: the wall seconds."""
    from kvserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def _offload_counts(engine: LLMEngine) -> tuple[int, int]:
    """(blocks stored, blocks dropped) by the engine's offload tier so far; (0, 0) without one."""
    tier = engine.core.offload
    if tier is None:
        return 0, 0
    stats = tier.stats()
    return stats.stored_blocks, stats.dropped_blocks


def _drop_page_cache(directory: Path) -> int:
    """Ask the kernel to drop every file under `directory` from the page cache (posix_fadvise DONTNEED: no root
    needed, unlike /proc/sys/vm/drop_caches); returns the files dropped."""
    count = 0
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                count += 1
            finally:
                os.close(fd)
    return count


def _against_llama_server(base: LLMEngine, args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    """The multi-round chat's shape over HTTP: `kvserve serve` (the pool and a host tier of this run) against
    llama-server with one slot, a context for the longest prompt, and its prompt cache in host memory."""
    from kvserve.bench.offload_peer import ChatShape, chat_turns, compare_with_llama_server, has_flag
    from kvserve.bench.report import Table
    from kvserve.bench.systems import special_token_ids
    from kvserve.model.source import resolve_model

    model = base.core.model_config
    bos = [model.bos_token_id] if model.bos_token_id is not None else []
    shape = ChatShape(args.users, args.rounds, args.system_tokens, args.question_tokens, args.output_len, args.seed)
    turns = chat_turns(shape, model.vocab_size, special_token_ids(base), bos)
    longest = max(len(p) for row in turns for p in row) + args.output_len + 64
    threads = str(args.cpu_threads or os.cpu_count() or 1)
    kvserve_args = [
        *(["--model", args.model] if args.model else []),
        "--kv-cache-memory-bytes",
        str(args.pool_bytes),
        "--kv-offloading-size",
        f"{args.tier_bytes}B",
        "--cpu-threads",
        threads,
        *_numerics_flags(args),
    ]
    llama_args = ["-t", threads, "-np", "1", "-c", str(longest)]
    if has_flag(args.llama_server, "--cache-ram"):
        llama_args += ["--cache-ram", str(args.tier_bytes // MiB)]
    log_dir = Path(tempfile.mkdtemp(prefix="kvserve-bench-offload-peer-"))
    doc = compare_with_llama_server(
        args.llama_server, resolve_model(args.model).path, kvserve_args, llama_args, turns, args.output_len, log_dir
    )
    shutil.rmtree(log_dir, ignore_errors=True)
    table = Table(
        f"Multi-round chat over HTTP against llama-server ({' '.join(llama_args)}); kvserve serve "
        f"{' '.join(kvserve_args)}",
        ["server", "TTFT p50 ms", "TTFT p90 ms", "throughput tok/s"],
    )
    for name, row in doc["systems"].items():
        table.add(name, row["ttft_ms_p50"], row["ttft_ms_p90"], row["throughput_tok_s"])
    return doc, table


# The settings that change kvserve's arithmetic, as `kvserve serve` flags with their defaults: the server the HTTP
# comparison starts computes as the in-process engines of the same run do.
_NUMERICS_FLAGS = {
    "dtype": ("--dtype", "auto"),
    "quantization": ("--quantization", "auto"),
    "lm_head_quantization": ("--lm-head-quantization", None),
    "activation_quantization": ("--activation-quantization", "none"),
    "kernel_isa": ("--kernel-isa", "auto"),
    "kv_cache_dtype": ("--kv-cache-dtype", "auto"),
    "block_size": ("--block-size", 16),
}


def _numerics_flags(args: argparse.Namespace) -> list[str]:
    flags = []
    for attr, (flag, default) in _NUMERICS_FLAGS.items():
        value = getattr(args, attr, default)
        if value is not None and value != default:
            flags += [flag, str(value)]
    return flags


def _accuracy(base: LLMEngine, args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    """Each window's greedy continuation cold (no tier), then restored from a host tier storing the cache's own dtype
    and from one storing int8: the pool's prefix cache is dropped between the store and the restore, so the whole
    prefix (but its last block) comes from the tier."""
    from kvserve.bench.kv_dtype import GPL3
    from kvserve.bench.report import Table

    body = base.tokenizer.encode(GPL3.read_text(), add_special_tokens=False)
    bos = base.core.model_config.bos_token_id
    n = args.accuracy_tokens
    windows = [([] if bos is None else [bos]) + body[i * n : (i + 1) * n] for i in range(args.accuracy_prompts)]
    windows = [w for w in windows if len(w) > n // 2]
    pool = (n + args.accuracy_output + 64) * base.core.kv_config.bytes_per_token
    cold_engine = base.sibling(kv_cache_memory_bytes=pool)
    cold = [one_request(cold_engine, w, args.accuracy_output, f"cold-{i}").output_ids for i, w in enumerate(windows)]
    tiers: dict[str, Any] = {}
    for dtype in ("auto", "int8"):
        engine = base.sibling(kv_cache_memory_bytes=pool, kv_offloading_size="1GiB", kv_offloading_dtype=dtype)
        identical, divergences, restored = 0, [], 0
        for i, window in enumerate(windows):
            one_request(engine, window, 1, f"store-{dtype}-{i}")
            engine.core.pool.reset_prefix_cache()  # the pool forgets it: the restore comes from the tier
            done = one_request(engine, window, args.accuracy_output, f"restore-{dtype}-{i}")
            restored += done.restored
            same = next((k for k, (a, b) in enumerate(zip(cold[i], done.output_ids)) if a != b), len(cold[i]))
            identical += same == len(cold[i])
            divergences.append(same)
        assert engine.core.offload is not None
        tiers[dtype] = {
            "block_bytes": engine.core.offload.layout.block_bytes,
            "identical_continuations": identical,
            "mean_first_divergence": sum(divergences) / len(divergences),
            "restored_tokens": restored,
        }
        engine.core.close()
    table = Table(
        f"Restore accuracy: {len(windows)} GPL-3 windows of {n} tokens, {args.accuracy_output} greedy tokens "
        "against cold",
        ["tier stores", "bytes a block", "identical continuations", "mean first divergence", "restored tokens"],
    )
    for dtype, row in tiers.items():
        table.add(
            "the cache's dtype" if dtype == "auto" else "int8 + scales",
            row["block_bytes"],
            f"{row['identical_continuations']}/{len(windows)}",
            row["mean_first_divergence"],
            row["restored_tokens"],
        )
    doc = {"prompts": len(windows), "prompt_tokens": n, "output_tokens": args.accuracy_output, "tiers": tiers}
    return doc, table


def run(args: argparse.Namespace) -> int:
    from kvserve.bench.chat import ChatWorkload, multi_round_chat
    from kvserve.bench.common import warm_up
    from kvserve.bench.machine import machine_info
    from kvserve.bench.report import Report, Table, config_of, emit
    from kvserve.bench.stats import median, ratio
    from kvserve.bench.systems import KVServeSystem, build_engine, special_token_ids
    from kvserve.bench.workload import random_token_ids

    args.enable_prefix_caching = True
    args.kv_offloading_size = args.kv_offloading_path = None
    args.kv_cache_memory_bytes = args.pool_bytes
    top = Path(args.tier_dir or tempfile.mkdtemp(prefix="kvserve-bench-offload-"))
    tier = f"{args.tier_bytes}B"
    base = build_engine(args)
    engines: dict[str, LLMEngine] = {
        "no tier": base,
        "host tier": base.sibling(kv_offloading_size=tier),
        "disk tier": base.sibling(kv_offloading_size=tier, kv_offloading_path=str(top / "multi-round")),
        "pool + tier bytes": base.sibling(kv_cache_memory_bytes=args.pool_bytes + args.tier_bytes),
    }
    for engine in engines.values():
        warm_up(KVServeSystem(engine))
    model = base.core.model_config
    vocab, exclude = model.vocab_size, special_token_ids(base)
    bos = [model.bos_token_id] if model.bos_token_id is not None else []
    rng = random.Random(args.seed)
    bytes_per_token = base.core.kv_config.bytes_per_token
    pool_tokens = base.core.pool.num_usable_blocks * base.core.config.block_size

    # 1. Multi-round chat: round by round, user by user, the systems alternating request by request.
    workload = ChatWorkload(args.users, args.rounds, args.system_tokens, args.question_tokens, args.output_len)
    rows, working_set = multi_round_chat(engines, workload, rng, vocab, exclude, bos)
    multi: dict[str, Any] = {
        "users": args.users,
        "rounds": args.rounds,
        "system_tokens": args.system_tokens,
        "working_set_tokens": working_set,
        "pool_tokens": pool_tokens,
        "systems": rows,
    }
    t1 = Table(
        f"Multi-round chat: {args.users} users x {args.rounds} rounds, {args.system_tokens}-token system prompts; "
        f"working set {working_set:,} tokens, pool {pool_tokens:,} tokens ({working_set / pool_tokens:.1f}x)",
        ["system", "TTFT p50 ms", "TTFT p90 ms", "throughput tok/s", "pool hit rate", "tier hit rate"],
    )
    for name, row in rows.items():
        t1.add(
            name,
            row["ttft_ms_p50"],
            row["ttft_ms_p90"],
            row["throughput_tok_s"],
            row["pool_hit_rate"],
            row["tier_hit_rate"],
        )
    for engine in engines.values():
        if engine is not base:
            engine.core.close()

    # 2. Restart: a long prompt cold on one engine that fills a disk tier, then on fresh engines reading it.
    restart = []
    t2 = Table(
        "Restart: TTFT of a long prompt on a fresh engine with a disk tier an earlier engine filled",
        ["prompt tokens", "cold ms", "page cache ms", "page cache / cold", "dropped ms", "dropped / cold", "restored"],
    )
    context = model.max_position_embeddings
    for asked in args.restart_tokens:
        length = min(asked, context - 1)  # one token is generated: 32768 becomes 32767 on a 32k-context model
        prompt = bos + random_token_ids(rng, length - len(bos), vocab, exclude)
        pool = (length + args.output_len + 64) * bytes_per_token
        tier_path = top / f"restart-{length}"
        tier_size = f"{max(args.tier_bytes, 2 * length * bytes_per_token)}B"

        settings = dict(kv_cache_memory_bytes=pool, kv_offloading_size=tier_size, kv_offloading_path=str(tier_path))
        cold_engine = base.sibling(**settings)
        warm_up(KVServeSystem(cold_engine))  # its first step's one-time costs, outside the measurement
        cold = one_request(cold_engine, prompt, 1, f"cold-{length}")
        cold_engine.core.close()  # writes what is queued
        warm_engine = base.sibling(**settings)
        warm_up(KVServeSystem(warm_engine))  # its first step's one-time costs, outside the measurement
        warm = one_request(warm_engine, prompt, 1, f"warm-{length}")
        warm_engine.core.close()
        _drop_page_cache(tier_path)
        dropped_engine = base.sibling(**settings)
        warm_up(KVServeSystem(dropped_engine))  # its first step's one-time costs, outside the measurement
        dropped = one_request(dropped_engine, prompt, 1, f"dropped-{length}")
        dropped_engine.core.close()
        row_r = {
            "prompt_tokens": len(prompt),
            "cold_ttft_ms": 1e3 * cold.ttft_s,
            "page_cache_ttft_ms": 1e3 * warm.ttft_s,
            "dropped_ttft_ms": 1e3 * dropped.ttft_s,
            "restored_tokens": warm.restored,
        }
        restart.append(row_r)
        t2.add(
            len(prompt),
            row_r["cold_ttft_ms"],
            row_r["page_cache_ttft_ms"],
            ratio(row_r["page_cache_ttft_ms"], row_r["cold_ttft_ms"]),
            row_r["dropped_ttft_ms"],
            ratio(row_r["dropped_ttft_ms"], row_r["cold_ttft_ms"]),
            warm.restored,
        )

    # 3. No reuse: random prompts in one batch, never a hit; the systems alternate run by run, in a rotating order.
    no_reuse_engines = {
        "no tier": base,
        "host tier": base.sibling(kv_offloading_size=tier),
        "disk tier": base.sibling(kv_offloading_size=tier, kv_offloading_path=str(top / "no-reuse")),
    }
    runs: dict[str, list[float]] = {name: [] for name in no_reuse_engines}
    total = args.no_reuse_requests * (args.no_reuse_tokens + args.output_len)
    offload_before = {name: _offload_counts(engine) for name, engine in no_reuse_engines.items()}
    for rep in range(args.repeats):
        prompts = [
            bos + random_token_ids(rng, args.no_reuse_tokens, vocab, exclude) for _ in range(args.no_reuse_requests)
        ]
        names = list(no_reuse_engines)
        for name in names[rep % len(names) :] + names[: rep % len(names)]:  # each system first in turn
            runs[name].append(total / _batch(no_reuse_engines[name], prompts, args.output_len, f"nr-{rep}"))
    for engine in no_reuse_engines.values():
        if engine.core.offload is not None:
            engine.core.offload.flush(120)  # what is queued counts as stored, not as dropped
    no_reuse_systems: dict[str, dict[str, Any]] = {}
    for name, r in runs.items():
        (stored_now, dropped_now), (stored_then, dropped_then) = (
            _offload_counts(no_reuse_engines[name]),
            offload_before[name],
        )
        no_reuse_systems[name] = {
            "throughput_tok_s": median(r),
            "runs": r,
            "stored_blocks": stored_now - stored_then,
            "dropped_blocks": dropped_now - dropped_then,
        }
    no_reuse = {"requests": args.no_reuse_requests, "prompt_tokens": args.no_reuse_tokens, "systems": no_reuse_systems}
    t3 = Table(
        f"No reuse: {args.no_reuse_requests} random {args.no_reuse_tokens}-token prompts in one batch, "
        f"median of {args.repeats}",
        ["system", "throughput tok/s", "/ no tier", "blocks stored", "blocks dropped"],
    )
    off_tput = no_reuse["systems"]["no tier"]["throughput_tok_s"]
    for name, row_n in no_reuse["systems"].items():
        t3.add(
            name,
            row_n["throughput_tok_s"],
            ratio(row_n["throughput_tok_s"], off_tput),
            row_n["stored_blocks"],
            row_n["dropped_blocks"],
        )
    for engine in no_reuse_engines.values():
        if engine is not base:
            engine.core.close()
    if args.tier_dir is None:
        shutil.rmtree(top, ignore_errors=True)

    # 4. Restore accuracy: GPL-3 windows restored from an exact tier and from an int8 one, against cold greedy output.
    accuracy, t4 = _accuracy(base, args)
    peer = None
    if args.llama_server:
        peer, t5 = _against_llama_server(base, args)
        report_tables_extra = [t5]
    else:
        report_tables_extra = []

    m = multi["systems"]
    report = Report("offload", machine_info(), config_of(args))
    report.results = {
        "multi_round": multi,
        "restart": restart,
        "no_reuse": no_reuse,
        "accuracy": accuracy,
        "llama_server": peer,
    }
    report.ratios = {
        "multi_round_ttft_p50_host_over_off": ratio(m["host tier"]["ttft_ms_p50"], m["no tier"]["ttft_ms_p50"]),
        "multi_round_ttft_p50_disk_over_off": ratio(m["disk tier"]["ttft_ms_p50"], m["no tier"]["ttft_ms_p50"]),
        "multi_round_throughput_host_over_off": ratio(
            m["host tier"]["throughput_tok_s"], m["no tier"]["throughput_tok_s"]
        ),
        "multi_round_throughput_disk_over_off": ratio(
            m["disk tier"]["throughput_tok_s"], m["no tier"]["throughput_tok_s"]
        ),
        "multi_round_ttft_p50_host_over_big_pool": ratio(
            m["host tier"]["ttft_ms_p50"], m["pool + tier bytes"]["ttft_ms_p50"]
        ),
        "restart_page_cache_over_cold": ratio(restart[0]["page_cache_ttft_ms"], restart[0]["cold_ttft_ms"])
        if restart
        else None,
        "restart_dropped_over_cold": ratio(restart[0]["dropped_ttft_ms"], restart[0]["cold_ttft_ms"])
        if restart
        else None,
        "no_reuse_throughput_host_over_off": ratio(no_reuse["systems"]["host tier"]["throughput_tok_s"], off_tput),
        "no_reuse_throughput_disk_over_off": ratio(no_reuse["systems"]["disk tier"]["throughput_tok_s"], off_tput),
        "llama_server_ttft_p50_kvserve_over_peer": None
        if peer is None
        else ratio(peer["systems"]["kvserve"]["ttft_ms_p50"], peer["systems"]["llama-server"]["ttft_ms_p50"]),
        "llama_server_throughput_kvserve_over_peer": None
        if peer is None
        else ratio(peer["systems"]["kvserve"]["throughput_tok_s"], peer["systems"]["llama-server"]["throughput_tok_s"]),
        "int8_tier_blocks_over_exact": ratio(
            accuracy["tiers"]["auto"]["block_bytes"], accuracy["tiers"]["int8"]["block_bytes"]
        ),
    }
    report.notes.append(
        "The restart rows run fresh engines (a new pool and tier) in this process, sharing the loaded model; "
        "'page cache' reads records the kernel still caches, 'dropped' after posix_fadvise(DONTNEED) on every file."
    )
    report.tables += [t1, t2, t3, t4, *report_tables_extra]
    if args.plot:
        from kvserve.bench.plot import Panel, Series, line_plot

        line_plot(
            args.plot,
            [
                Panel(
                    "Multi-round chat: TTFT of each request",
                    "request (round by round, user by user)",
                    "TTFT (ms)",
                    [Series(name, list(range(1, len(r["ttft_ms"]) + 1)), r["ttft_ms"]) for name, r in m.items()],
                )
            ],
        )
    emit(report, args.json)
    return 0
