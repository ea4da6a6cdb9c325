"""xgrammar against llguidance on the default model's 262,144-token vocabulary: the figures behind the backend choice
in docs/STRUCTURED_OUTPUT.md ("Backend choice"). Not run by CI.

Each backend is measured in its own subprocess (so that memory figures do not mix), single-threaded: import, tokenizer
info build (time and resident memory added), compile of a typical JSON schema (cold; cached, i.e. our LRU; and a
new per-request matcher), then a random-logits walk constrained by the schema, greedy over the masked logits as a
model would be, timing each mask fill (mean, p50, p90, p99, max, the share over 1 ms, and the first one apart:
llguidance builds its lexer lazily, so its first mask carries part of the compile), the mask application (ours, for
both; xgrammar's C++ kernel beside it on the xgrammar side, for the record) and the token acceptance.

Usage: OMP_NUM_THREADS=1 python scripts/measure_grammar_backends.py [--walks 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "status": {"enum": ["active", "inactive", "pending"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 40},
                "city": {"type": "string", "maxLength": 30},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "verified": {"type": "boolean"},
    },
    "required": ["name", "age", "status", "tags", "address", "score", "verified"],
    "additionalProperties": False,
}
MAX_WALK_TOKENS = 400


def rss_mib() -> float:
    """Resident memory now (not the peak), from /proc."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def ms(seconds: float) -> float:
    return round(seconds * 1e3, 4)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def measure(backend_name: str, walks: int) -> dict:
    """All figures for one backend, in this process."""
    import torch

    from kvserve.model.source import resolve_model
    from kvserve.model.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model(None))
    t0 = time.perf_counter()
    if backend_name == "xgrammar":
        import xgrammar  # noqa: F401
    else:
        import llguidance  # noqa: F401
    import_s = time.perf_counter() - t0
    from kvserve.structured.backend import GrammarVocab, make_backend
    from kvserve.structured.matcher import allocate_token_bitmask, apply_token_bitmask_
    from kvserve.structured.params import StructuredOutputsParams

    gc.collect()
    rss0 = rss_mib()
    t0 = time.perf_counter()
    backend = make_backend(backend_name, GrammarVocab.from_tokenizer(tok))
    build_s = time.perf_counter() - t0
    gc.collect()
    rss_build = rss_mib() - rss0

    params = [StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=compact) for compact in (True, False)]
    t0 = time.perf_counter()
    grammar = backend.compile(params[0])
    compile_cold_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    backend.compile(StructuredOutputsParams(json=json.dumps(SCHEMA), disable_any_whitespace=True))
    compile_cached_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    backend.matcher(grammar)
    matcher_s = time.perf_counter() - t0

    vocab = backend.vocab.vocab_size
    fills: list[float] = []
    firsts: list[float] = []
    applies: list[float] = []
    accepts: list[float] = []
    lengths: list[int] = []
    xgr_applies: list[float] = []
    xgr_kernel = None
    if backend_name == "xgrammar":
        from xgrammar.kernels.apply_token_bitmask_inplace_cpu import apply_token_bitmask_inplace_cpu as xgr_kernel
    finished = 0
    for walk in range(walks):
        p = params[walk % 2]  # compact and any-whitespace JSON in turn
        matcher = backend.matcher(backend.compile(p))
        gen = torch.Generator().manual_seed(walk)
        bitmask = allocate_token_bitmask(1, vocab)
        for step in range(MAX_WALK_TOKENS):
            logits = torch.randn(1, vocab, generator=gen)
            t0 = time.perf_counter()
            matcher.fill_bitmask(bitmask, 0)
            t1 = time.perf_counter()
            if xgr_kernel is not None:  # the kernel we did not pick, on a copy of the same row, for the record
                copy = logits.clone()
                k0 = time.perf_counter()
                xgr_kernel(copy, bitmask, vocab, [0])
                xgr_applies.append(time.perf_counter() - k0)
            a0 = time.perf_counter()
            apply_token_bitmask_(logits, bitmask, [0])
            applies.append(time.perf_counter() - a0)
            token = int(logits.argmax())
            a0 = time.perf_counter()
            ok = matcher.accept_token(token)
            accepts.append(time.perf_counter() - a0)
            (firsts if step == 0 else fills).append(t1 - t0)
            if not ok:
                raise RuntimeError(f"{backend_name}: the matcher refused token {token} its own mask allowed")
            if matcher.is_terminated():
                finished += 1
                break
        lengths.append(step + 1)
    gc.collect()
    return {
        "backend": backend_name,
        "import_s": round(import_s, 3),
        "tokenizer_info_build_s": round(build_s, 3),
        "tokenizer_info_rss_mib": round(rss_build, 1),
        "compile_cold_ms": ms(compile_cold_s),
        "compile_cached_ms": ms(compile_cached_s),
        "new_matcher_ms": ms(matcher_s),
        "compiled_grammar_kib": round(grammar.handle.memory_size_bytes / 1024, 1)
        if backend_name == "xgrammar"
        else "n/a",
        "walks": walks,
        "walks_terminated": finished,
        "tokens_per_walk_mean": round(statistics.mean(lengths), 1),
        "mask_first_ms": ms(statistics.mean(firsts)),
        "mask_mean_ms": ms(statistics.mean(fills)),
        "mask_p50_ms": ms(percentile(fills, 0.5)),
        "mask_p90_ms": ms(percentile(fills, 0.9)),
        "mask_p99_ms": ms(percentile(fills, 0.99)),
        "masks_over_1ms_pct": round(100 * sum(f > 1e-3 for f in fills) / len(fills), 1),
        "mask_max_ms": ms(max(fills)),
        "apply_row_mean_ms": ms(statistics.mean(applies)),
        "xgr_kernel_apply_row_ms": ms(statistics.mean(xgr_applies)) if xgr_applies else "n/a",
        "accept_mean_ms": ms(statistics.mean(accepts)),
        "rss_after_mib": round(rss_mib(), 1),
    }


def run_child(backend_name: str, walks: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "RAYON_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, __file__, "--child", backend_name, "--walks", str(walks)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"{backend_name} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def print_table(results: list[dict]) -> None:
    keys = [k for k in results[0] if k != "backend"]
    print(f"{'':28}" + "".join(f"{r['backend']:>14}" for r in results))
    for key in keys:
        print(f"{key:28}" + "".join(f"{r[key]!s:>14}" for r in results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--walks", type=int, default=6, help="constrained random walks per backend")
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="PATH",
        help="JSON (a list, one object per backend) on stdout ('-') or into PATH",
    )
    parser.add_argument("--child", choices=("xgrammar", "guidance"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.walks)))
        return
    results = [run_child(name, args.walks) for name in ("xgrammar", "guidance")]
    if args.json == "-":
        print(json.dumps(results, indent=1))
        return
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
