"""The prepared proof of kvserve's CUDA path (issue #20): correctness against HF transformers and speed beside
HF `generate`, on random-weight checkpoints of real architectures, in under five minutes, written to one JSON
report section by section.

Run on a GPU machine (torch, transformers and Triton installed; kvserve from this source tree, no install):
    bash scripts/gpu_check.sh                  # what the device tool runs: $OUT/gpu_check.{json,log,out,md}
    PYTHONPATH=. python scripts/gpu_check.py --device cuda --out /tmp/gpu_check.json
Run on CPU, tiny (what tests/scripts/test_gpu_check.py does, in well under a minute):
    PYTHONPATH=. python scripts/gpu_check.py --device cpu --tiny --out /tmp/gpu_check.json

What it does, per architecture (Qwen2-0.5B, Gemma 3 270M, a Llama-3.1-8B-shaped model; configs in
scripts/gpu_check_models.py, weights random, built by transformers on the device and saved as bfloat16
safetensors with a tokenizer), for each dtype (float32 and bfloat16; --tiny: float32 only):
- `logits_<dtype>`: kvserve's logits over three prompts (prefilled in chunks over a paged prefix; Gemma's
  outgrow its sliding window) and over their greedy continuations (batched decode steps), against HF's on the
  same tokens. Tolerances: scripts/gpu_check_measure.py's docstring, repeated in the report.
- `greedy_float32`: several prompts x 64 new tokens batched in a cache too small for them (preemption forced),
  against each prompt alone and against HF float32's greedy choice at every position.
- `layouts_float32` (Gemma 3, whose layers have sliding windows): the logits prompts greedy on the hybrid KV cache
  layout (KV cache groups: per-group block tables through the attention kernels, out-of-window blocks given back)
  and on the uniform one (--disable-hybrid-kv-cache-manager): identical token for token.
- `speed_b<N>` (bfloat16 on a GPU): decode tok/s at batch 1, 32, 64, 256 and prefill tok/s, kvserve's and HF
  `generate`'s (static batch), each against the floor: bytes per step over the measured bandwidth (a large device
  copy), or FLOPs over the measured matmul rate where those bound it (kvserve/bench/floor.py).
Then `targets`: the 8B model's batch-1 decode within 1.5x of its floor, and its decode throughput at batch 64 at
least 10x HF's. Besides: `machine`, `ceilings` (bandwidth, matmul rate) and `import_audit` (the engine path imports
nothing the GPU machine lacks). scripts/gpu_check_markdown.py turns the report into docs/BENCHMARKS.md's tables.

The report: {"sections": {name: {"status": ok|failed|error|timeout|skipped, "seconds", ...figures}},
"targets", "summary", "tolerances", "engine_options", "plan"}; it is rewritten after every section, so a late
failure or a kill keeps what came before. Time: --budget-s (default 270 s on a GPU, counted after the imports) is
split into a deadline per section (an architecture's phase is capped too, so the 8B model is never starved); a
section that would start with too little time left is recorded as skipped, one that overruns as timeout, and the
run goes on.

Engine options pass through one dict, checked against EngineConfig's fields, so options that do not exist
yet (enforce_eager, cuda_graph_sizes, a "triton" attention backend) are recorded as unavailable, never fatal:
--engine-arg NAME=JSON adds or overrides one. Exit status: 0 when every check that ran passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.metadata
import json
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from gpu_check_measure import (
    TOLERANCES,
    Floors,
    LogitsCase,
    check_greedy,
    check_layouts,
    check_logits,
    hf_speed,
    kvserve_speed,
    random_prompts,
    speed_row,
)
from gpu_check_models import ARCHS, Arch, Checkpoint, build_checkpoint

from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.kv.groups import KVCacheLayout, make_kv_cache_layout
from kvserve.model.config import ModelConfig
from kvserve.vocab import ATTENTION_BACKENDS

# Packages the GPU machine does not have: kvserve's engine path must never import them.
ABSENT_ON_GPU_MACHINE = (
    "fastapi",
    "uvicorn",
    "pydantic",
    "pydantic_core",
    "gguf",
    "starlette",
    "prometheus_client",
    "xgrammar",
    "llguidance",
    "zmq",
    "msgspec",
    "xxhash",
    "ray",
    "matplotlib",
)
TARGET_DECODE_X_FLOOR = 1.5
TARGET_OVER_HF_AT_64 = 10.0


@dataclass(frozen=True, slots=True)
class Plan:
    """The sizes of one run: the GPU's, or --tiny's (CPU, seconds in all)."""

    dtypes: tuple[str, ...]
    speed_dtype: str
    logits_prompt: int  # three prompts around this length, each followed by `logits_continuation` decode steps
    logits_continuation: int
    greedy_requests: int
    greedy_tokens: int
    speed_batches: tuple[int, ...]
    speed_prompt: int
    speed_new_tokens: int
    chunk_tokens: int  # the correctness engines' token budget per step: prompts prefill in chunks
    speed_batched_tokens: int
    buffer_mib: int  # the bandwidth measurement's buffer (on a GPU; a CPU's is capped at 256 MiB)
    matmul_n: int  # the matmul rate's square size (on a GPU; a CPU's is capped at 1024)
    budget_s: float
    block_size: int = 16

    @classmethod
    def for_run(cls, tiny: bool, budget_s: float | None, dtypes: tuple[str, ...] | None) -> Plan:
        if tiny:
            return cls(
                dtypes=dtypes or ("float32",),
                speed_dtype="float32",
                logits_prompt=24,
                logits_continuation=8,
                greedy_requests=4,
                greedy_tokens=16,
                speed_batches=(1, 4, 8),
                speed_prompt=16,
                speed_new_tokens=8,
                chunk_tokens=16,
                speed_batched_tokens=256,
                buffer_mib=64,
                matmul_n=256,
                budget_s=budget_s or 120.0,
            )
        return cls(
            dtypes=dtypes or ("float32", "bfloat16"),
            speed_dtype="bfloat16",
            logits_prompt=96,
            logits_continuation=32,
            greedy_requests=6,
            greedy_tokens=64,
            speed_batches=(1, 32, 64, 256),
            speed_prompt=128,
            speed_new_tokens=64,
            chunk_tokens=64,
            speed_batched_tokens=8192,
            buffer_mib=4096,
            matmul_n=8192,
            budget_s=budget_s or 270.0,
        )


class SectionTimeout(BaseException):
    """Raised by the alarm when a section overruns its deadline. A BaseException, so that the engine's per-request
    fault handling (which catches Exception) cannot mistake it for one request's failure and swallow it."""


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Interrupt the body after `seconds` (SIGALRM: the main thread of a Unix process, which this script is)."""

    def fire(signum: int, frame: Any) -> None:
        raise SectionTimeout

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@dataclass(slots=True)
class Outcome:
    """What a section returns: the figures for the report, and an object later sections use (an engine...)."""

    figures: dict[str, Any]
    value: Any = None


class Report:
    """The JSON report, rewritten whole (to a temporary file, then renamed) after every section."""

    def __init__(self, path: Path, header: dict[str, Any], budget_s: float) -> None:
        self.path = path
        self.data: dict[str, Any] = {**header, "sections": {}, "targets": {}, "summary": {}}
        self.start = time.monotonic()
        self.end = self.start + budget_s
        self.write()

    def left(self, phase_end: float | None = None) -> float:
        return min(self.end, phase_end or self.end) - time.monotonic()

    def run(self, name: str, fn: Callable[[], Outcome], min_s: float = 1.0, phase_end: float | None = None) -> Any:
        """Run one section under its deadline; record it, whatever happens; return its object (None unless ok)."""
        left = self.left(phase_end)
        if left < min_s:
            return self.skip(name, f"{left:.0f} s left, the section needs {min_s:.0f} s")
        started = time.monotonic()
        entry: dict[str, Any]
        value = None
        try:
            with deadline(left):
                outcome = fn()
            value = outcome.value
            entry = {"status": "failed" if outcome.figures.get("passed") is False else "ok", **outcome.figures}
        except SectionTimeout:
            entry = {"status": "timeout", "reason": f"over its deadline of {left:.0f} s"}
        except Exception as e:  # noqa: BLE001 -- recorded; the next sections still run
            entry = {
                "status": "error",
                "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc(limit=-8),
            }
        entry["seconds"] = round(time.monotonic() - started, 3)
        self.record(name, entry)
        return value if entry["status"] in ("ok", "failed") else None

    def skip(self, name: str, reason: str) -> None:
        self.record(name, {"status": "skipped", "reason": reason})

    def skip_all(self, names: list[str], reason: str) -> None:
        for name in names:
            self.skip(name, reason)

    def record(self, name: str, entry: dict[str, Any]) -> None:
        self.data["sections"][name] = entry
        print(f"[{time.monotonic() - self.start:7.1f}s] {name:<34} {entry['status']:<8} {_brief(entry)}", flush=True)
        self.write()

    def write(self) -> None:
        sections = self.data["sections"]
        counts: dict[str, int] = {}
        for entry in sections.values():
            counts[entry["status"]] = counts.get(entry["status"], 0) + 1
        self.data["summary"] = {
            "elapsed_s": round(time.monotonic() - self.start, 1),
            "statuses": counts,
            "not_passed": [n for n, e in sections.items() if e["status"] in ("failed", "error", "timeout")],
            "passed": not any(e["status"] in ("failed", "error") for e in sections.values()),
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(partial, self.path)


def _brief(entry: dict[str, Any]) -> str:
    """One line per section on stdout (the device tool shows the output's tail)."""
    if "error" in entry:
        return entry["error"][:160]
    if "reason" in entry:
        return entry["reason"]
    if "kvserve_vs_hf_float32" in entry:
        figures = entry["kvserve_vs_hf_float32"]
        ratio = entry.get("error_ratio_vs_hf_bf16")
        return f"max|d| {figures['max_abs']:.2e} cos {figures['min_cosine']:.5f}" + (
            f" err/hf_bf16 {ratio:.2f}" if ratio is not None else ""
        )
    if "tokens" in entry:
        return f"tokens {entry['tokens']} preemptions {entry['preemptions']}"
    if "identical" in entry:
        return f"hybrid == uniform layout: {entry['identical']}/{entry['prompts']} prompts ({entry['groups']})"
    if "kvserve" in entry:
        kv, hf = entry.get("kvserve") or {}, entry.get("hf") or {}
        return (
            f"decode tok/s kvserve {kv.get('decode_tok_s', 0):.0f} (x{kv.get('decode_x_floor', 0):.2f} floor) "
            f"hf {hf.get('decode_tok_s', 0):.0f}; prefill kvserve {kv.get('prefill_tok_s', 0):.0f}"
        )
    return f"{entry['seconds']:.1f} s"


# -- the sections --------------------------------------------------------------------------------------------------


def machine(device: torch.device) -> Outcome:
    from kvserve.bench.machine import machine_info

    figures: dict[str, Any] = {
        **machine_info().to_json(),
        "torch_cuda": torch.version.cuda,
        "kvserve_commit": _git_commit(),
        "utc": datetime.now(timezone.utc).isoformat(),
    }
    try:  # its version, without importing it: the first import fixes whether Triton interprets (TRITON_INTERPRET)
        figures["triton"] = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        figures["triton"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        figures["gpu"] = {
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1),
            "count": torch.cuda.device_count(),
            "sm_count": props.multi_processor_count,
        }
    return Outcome(figures)


def _git_commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).parent,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def engine_options(
    device: str, attention_backend: str | None, extra: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, str]]:
    """The engine options asked for, less those this kvserve does not have (name -> why), which are reported."""
    requested: dict[str, Any] = {"device": device}
    if device.startswith("cuda"):
        requested["enforce_eager"] = False  # CUDA graphs on, where the engine has them
    if attention_backend is not None:
        requested["attention_backend"] = attention_backend
    requested.update(extra)
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    applied, unavailable = {}, {}
    for name, value in requested.items():
        if name not in fields:
            unavailable[name] = "not a field of EngineConfig"
        elif name == "attention_backend" and value not in ATTENTION_BACKENDS:
            unavailable[name] = f"{value!r} is not one of {', '.join(ATTENTION_BACKENDS)}"
        else:
            applied[name] = value
    return applied, unavailable


def import_audit() -> Outcome:
    """Which packages this process has imported: any the GPU machine lacks means the engine path needs it."""
    loaded = sorted({m.split(".")[0] for m, mod in list(sys.modules.items()) if mod is not None})
    third_party = [m for m in loaded if m not in sys.stdlib_module_names and not m.startswith(("_", "gpu_check"))]
    bad = [m for m in ABSENT_ON_GPU_MACHINE if m in third_party]
    return Outcome(
        {
            "third_party": third_party,
            "absent_on_gpu_machine": list(ABSENT_ON_GPU_MACHINE),
            "imported_but_absent_there": bad,
            "passed": not bad,
        }
    )


@dataclass(slots=True)
class Run:
    """What every architecture's sections share."""

    args: argparse.Namespace
    plan: Plan
    device: torch.device
    options: dict[str, Any]
    report: Report
    workdir: Path
    ceilings: Any = None
    audited: bool = False


def check_arch(run: Run, arch: Arch) -> None:
    """All sections of one architecture, within its phase; frees its models and checkpoint at the end."""
    report, plan, tiny = run.report, run.plan, run.args.tiny
    capped = run.device.type == "cuda" and not tiny and arch.gpu_phase_s is not None
    phase_end = time.monotonic() + arch.gpu_phase_s if capped and arch.gpu_phase_s else None
    name = arch.name
    directory = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=run.workdir))
    try:
        ck: Checkpoint | None = report.run(
            f"{name}.checkpoint", lambda: _checkpoint(arch, tiny, run.device, directory), 5, phase_end
        )
        for dtype in [d for d in arch.dtype_order if d in plan.dtypes]:
            if ck is None:
                report.skip_all(_dtype_sections(arch.name, dtype, plan), f"needs {name}.checkpoint")
            else:
                _check_dtype(run, arch, ck, dtype, phase_end)
                _free(run.device)  # the engine is gone with _check_dtype's frame: its memory is, now
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        _free(run.device)


def _checkpoint(arch: Arch, tiny: bool, device: torch.device, directory: Path) -> Outcome:
    ck = build_checkpoint(arch, tiny, device, directory)
    return Outcome(
        {
            "params": ck.num_params,
            "checkpoint_bytes": ck.checkpoint_bytes,
            "directory": str(directory),
            "hf_attention": getattr(ck.hf_bf16.config, "_attn_implementation", None),
            "config": {
                k: v
                for k, v in arch.hf_config(tiny).to_dict().items()
                if k
                in (
                    "vocab_size",
                    "hidden_size",
                    "intermediate_size",
                    "num_hidden_layers",
                    "num_attention_heads",
                    "num_key_value_heads",
                    "head_dim",
                    "sliding_window",
                    "tie_word_embeddings",
                )
            },
        },
        ck,
    )


def _dtype_sections(arch: str, dtype: str, plan: Plan) -> list[str]:
    """The sections one engine dtype runs, in order (so that those an upstream failure prevents are recorded)."""
    names = [f"{arch}.engine_{dtype}", f"{arch}.logits_{dtype}"]
    if dtype == "float32":
        names.append(f"{arch}.greedy_float32")
        if arch in LAYOUT_ARCHS:
            names.append(f"{arch}.layouts_float32")
    if dtype == plan.speed_dtype and plan.speed_batches:
        names += [f"{arch}.speed_engine", *(f"{arch}.speed_b{b}" for b in plan.speed_batches)]
    return names


def _check_dtype(run: Run, arch: Arch, ck: Checkpoint, dtype: str, phase_end: float | None) -> None:
    report, plan = run.report, run.plan
    name = f"{arch.name}.{{}}_{dtype}"
    window = arch.sliding_window(run.args.tiny)
    prompt = max(plan.logits_prompt, (window or 0) + plan.logits_prompt // 2)  # past the window: it must matter
    case = LogitsCase(
        random_prompts([prompt, prompt - 7, prompt + 5], ck.vocab_size, seed=11), plan.logits_continuation
    )
    greedy_prompts = random_prompts([8 + 7 * i for i in range(plan.greedy_requests)], ck.vocab_size, seed=12)
    max_len = _round_up(prompt + 5 + plan.logits_continuation, plan.block_size)
    layout = make_kv_cache_layout(ModelConfig.from_hf_dir(ck.path).sliding_windows)  # the engine's KV cache groups
    blocks = 16 + sum(_pool_blocks(layout, len(p) + plan.logits_continuation, 1, plan) for p in case.prompts)
    engine: LLMEngine | None = report.run(
        name.format("engine"), lambda: _engine(run, ck, dtype, max_len=max_len, num_blocks=blocks), 5, phase_end
    )
    if not run.audited:  # after the first engine, loaded or not: what its path imported is the question
        run.audited = True
        report.run("import_audit", import_audit)
    if engine is None:
        report.skip_all(_dtype_sections(arch.name, dtype, plan)[1:], f"needs {name.format('engine')}")
        return
    try:
        report.run(
            name.format("logits"),
            lambda: Outcome(check_logits(engine, dtype, case, ck.reference, ck.hf_bf16, ck.vocab_size)),
            3,
            phase_end,
        )
        if dtype == "float32":
            report.run(f"{arch.name}.greedy_float32", lambda: _greedy(run, engine, ck, greedy_prompts), 3, phase_end)
            if arch.name in LAYOUT_ARCHS:
                report.run(f"{arch.name}.layouts_float32", lambda: _layouts(run, engine, case.prompts), 3, phase_end)
        if dtype == plan.speed_dtype and plan.speed_batches:
            _speed(run, arch, ck, engine, phase_end)
    finally:
        engine.close()


def _engine(run: Run, ck: Checkpoint, dtype: str, max_len: int, num_blocks: int) -> Outcome:
    plan = run.plan
    config = EngineConfig.parse(
        model=str(ck.path),
        dtype=dtype,
        block_size=plan.block_size,
        max_model_len=max_len,
        num_gpu_blocks_override=num_blocks,
        max_num_batched_tokens=plan.chunk_tokens,
        seed=0,
        max_num_seqs=max(plan.greedy_requests, 3),  # few CUDA graphs to capture
        **run.options,
    )
    started = time.perf_counter()
    engine = LLMEngine.from_config(config)
    resolved = {
        k: getattr(engine.config, k, None)
        for k in ("attention_backend", "enforce_eager", "cuda_graph_sizes", "kv_cache_dtype")
    }
    return Outcome(
        {
            "load_s": time.perf_counter() - started,
            "config": resolved,
            "compute_dtype": str(engine.compute_dtype),
            "num_blocks": engine.core.pool.num_blocks,
        },
        engine,
    )


def _greedy(run: Run, engine: LLMEngine, ck: Checkpoint, prompts: list[list[int]]) -> Outcome:
    """A sibling engine (same weights) whose cache holds two of the requests at most."""
    plan = run.plan
    longest = _round_up(max(len(p) for p in prompts) + plan.greedy_tokens, plan.block_size)
    small = engine.sibling(
        num_gpu_blocks_override=_pool_blocks(engine.core.layout, longest, 2, plan), max_model_len=longest
    )
    try:
        return Outcome(check_greedy(engine, small, prompts, plan.greedy_tokens, ck.reference))
    finally:
        small.close()


# Architectures with sliding windows: their KV cache groups (hybrid layout) are checked against the uniform layout.
LAYOUT_ARCHS = ("gemma3_270m",)


def _layouts(run: Run, engine: LLMEngine, prompts: list[list[int]]) -> Outcome:
    """The logits prompts (past the window) greedy on the engine's hybrid layout and on the uniform one."""
    uniform = engine.sibling(disable_hybrid_kv_cache_manager=True)
    try:
        return Outcome(check_layouts(engine, uniform, prompts, run.plan.greedy_tokens))
    finally:
        uniform.close()


def _speed(run: Run, arch: Arch, ck: Checkpoint, engine: LLMEngine, phase_end: float | None) -> None:
    """Each batch size is its own section: a timeout at batch 256 keeps batches 1 to 64."""
    from kvserve.bench.floor import model_cost

    report, plan = run.report, run.plan
    length = _round_up(plan.speed_prompt + plan.speed_new_tokens + 8, plan.block_size)
    biggest = max(plan.speed_batches)

    def make() -> Outcome:
        blocks = _pool_blocks(engine.core.layout, length, biggest, plan, plan.speed_batched_tokens) + 32
        fast = engine.sibling(
            num_gpu_blocks_override=blocks,
            max_num_seqs=biggest,
            max_num_batched_tokens=plan.speed_batched_tokens,
            max_model_len=length,
        )
        return Outcome({"num_blocks": fast.core.pool.num_blocks}, fast)

    rows = [f"{arch.name}.speed_b{batch}" for batch in plan.speed_batches]
    if run.ceilings is None:
        return report.skip_all([f"{arch.name}.speed_engine", *rows], "needs ceilings (the floors)")
    fast: LLMEngine | None = report.run(f"{arch.name}.speed_engine", make, 5, phase_end)
    if fast is None:
        return report.skip_all(rows, f"needs {arch.name}.speed_engine")
    floors = Floors(
        model_cost(fast.core.runner.model, fast.core.model_config, fast.core.kv_config.bytes_per_token), run.ceilings
    )
    report.data["sections"][f"{arch.name}.speed_engine"]["model_cost"] = floors.cost.to_json()
    hf_model = ck.hf_bf16 if plan.speed_dtype == "bfloat16" else ck.reference
    try:
        for row, batch in zip(rows, plan.speed_batches):
            report.run(
                row,
                lambda batch=batch: Outcome(
                    _speed_row(  # type: ignore[misc]
                        fast, hf_model, batch, plan, floors, ck.vocab_size
                    )
                ),
                3,
                phase_end,
            )
    finally:
        fast.close()
        report.data["targets"] = targets(report, run.args.tiny)  # now: a later kill keeps them
        report.write()


def _speed_row(
    engine: LLMEngine, hf_model: torch.nn.Module, batch: int, plan: Plan, floors: Floors, vocab_size: int
) -> dict[str, Any]:
    """kvserve and HF on the same batch; an HF failure (out of memory at batch 256, say) keeps kvserve's figures."""
    args = (batch, plan.speed_prompt, plan.speed_new_tokens, vocab_size)
    kv = kvserve_speed(engine, *args, seed=100 + batch)
    try:
        hf: dict[str, Any] | None = hf_speed(hf_model, *args, seed=100 + batch)
        hf_error = None
    except Exception as e:  # noqa: BLE001 -- reported beside kvserve's figures
        hf, hf_error = None, f"{type(e).__name__}: {e}"
        _free(engine.core.device)
    row = speed_row(batch, plan.speed_prompt, plan.speed_new_tokens, floors, kv, hf)
    if hf_error:
        row["hf_error"] = hf_error
    return row


def ceilings(device: torch.device, plan: Plan) -> Outcome:
    from kvserve.bench.machine import measure_ceilings

    cpu = device.type == "cpu"
    buffer_mib, matmul_n = (
        (min(plan.buffer_mib, 256), min(plan.matmul_n, 1024)) if cpu else (plan.buffer_mib, plan.matmul_n)
    )
    measured = measure_ceilings(
        buffer_mib=buffer_mib, matmul_n=matmul_n, device=str(device), matmul_dtype=plan.speed_dtype
    )
    return Outcome(
        {**measured.to_json(), "matmul_dtype": plan.speed_dtype, "buffer_mib": buffer_mib, "matmul_n": matmul_n},
        measured,
    )


def targets(report: Report, tiny: bool) -> dict[str, Any]:
    """The issue's two targets, from the 8B model's speed sections (None where a section did not run)."""
    sections = report.data["sections"]
    one, sixty_four = sections.get("llama31_8b.speed_b1", {}), sections.get("llama31_8b.speed_b64", {})
    x_floor = (one.get("kvserve") or {}).get("decode_x_floor")
    over_hf = sixty_four.get("kvserve_over_hf_decode")
    return {
        "meaningful": not tiny,  # --tiny's shapes say nothing about a GPU
        "batch1_decode_x_floor": {
            "value": x_floor,
            "target": f"<= {TARGET_DECODE_X_FLOOR}",
            "met": None if x_floor is None else x_floor <= TARGET_DECODE_X_FLOOR,
        },
        "batch64_decode_over_hf": {
            "value": over_hf,
            "target": f">= {TARGET_OVER_HF_AT_64}",
            "output_tok_s_ratio": sixty_four.get("kvserve_over_hf_output"),
            "met": None if over_hf is None else over_hf >= TARGET_OVER_HF_AT_64,
        },
    }


# -- helpers -------------------------------------------------------------------------------------------------------


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def _pool_blocks(layout: KVCacheLayout, tokens: int, requests: int, plan: Plan, chunk: int | None = None) -> int:
    """Blocks (the null block included) that hold `requests` requests of `tokens` at once and one prefill chunk: the
    engine's own capacity rule for its KV cache groups (a sliding window's group holds its window, kv/groups.py)."""
    bs, chunk = plan.block_size, chunk or plan.chunk_tokens
    return 1 + requests * layout.blocks_per_request(tokens, bs) + layout.prefill_extra_blocks(tokens, chunk, bs)


def _round_up(tokens: int, block_size: int) -> int:
    return _blocks(tokens, block_size) * block_size


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _workdir(requested: str | None, tiny: bool) -> Path:
    """Where checkpoints go: RAM (/dev/shm) when it can hold the 8B model's 16 GB with room, else the disk."""
    if requested:
        return Path(requested)
    shm = Path("/dev/shm")
    if not tiny and shm.is_dir() and shutil.disk_usage(shm).free > 20 * 2**30:
        return shm
    return Path(tempfile.gettempdir())


def _engine_arg(text: str) -> tuple[str, Any]:
    name, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--engine-arg wants NAME=JSON, got {text!r}")
    try:
        return name.strip(), json.loads(value)
    except json.JSONDecodeError:
        return name.strip(), value  # a bare string


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda[:N] (default) or cpu")
    p.add_argument("--tiny", action="store_true", help="tiny configs and few tokens (for CPU and tests)")
    p.add_argument("--out", default=None, help="the JSON report (default: $OUT/gpu_check.json, else ./gpu_check.json)")
    p.add_argument("--models", default=",".join(ARCHS), help=f"comma-separated, of: {', '.join(ARCHS)}")
    p.add_argument("--dtypes", default=None, help="comma-separated (default: float32,bfloat16; --tiny: float32)")
    p.add_argument("--budget-s", type=float, default=None, help="seconds after the imports (default 270; --tiny 120)")
    p.add_argument(
        "--speed-batches",
        default=None,
        help="comma-separated batch sizes (default: 1,32,64,256; '': no speed sections)",
    )
    p.add_argument("--attention-backend", default=None, help="default: the engine's own choice for the device")
    p.add_argument(
        "--engine-arg",
        type=_engine_arg,
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="an EngineConfig field for every engine, e.g. cuda_graph_sizes=[1,32,64,256]",
    )
    p.add_argument("--workdir", default=None, help="where checkpoints are written (default: /dev/shm if roomy)")
    args = p.parse_args(argv)
    unknown = set(args.models.split(",")) - set(ARCHS)
    if unknown:
        p.error(f"unknown --models {', '.join(sorted(unknown))}; choose from {', '.join(ARCHS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    plan = Plan.for_run(args.tiny, args.budget_s, tuple(args.dtypes.split(",")) if args.dtypes else None)
    if args.speed_batches is not None:
        plan = dataclasses.replace(plan, speed_batches=tuple(int(b) for b in args.speed_batches.split(",") if b))
    device = torch.device(args.device)
    out = Path(args.out or Path(os.environ.get("OUT", ".")) / "gpu_check.json")
    options, unavailable = engine_options(args.device, args.attention_backend, dict(args.engine_arg))
    header = {
        "schema": 1,
        "tool": "scripts/gpu_check.py",
        "argv": sys.argv[1:],
        "plan": dataclasses.asdict(plan),
        "tolerances": TOLERANCES,
        "engine_options": {"applied": options, "unavailable": unavailable},
        "host": platform.node(),
    }
    report = Report(out, header, plan.budget_s)
    run = Run(args, plan, device, options, report, _workdir(args.workdir, args.tiny))
    report.run("machine", lambda: machine(device))
    run.ceilings = report.run("ceilings", lambda: ceilings(device, plan), 5)
    for name in args.models.split(","):
        check_arch(run, ARCHS[name])
    if not run.audited:  # no engine was even tried: what the run imported is still worth knowing
        report.run("import_audit", import_audit)
    report.data["targets"] = targets(report, args.tiny)
    report.write()
    summary = report.data["summary"]
    print(json.dumps({"summary": summary, "targets": report.data["targets"], "report": str(out)}, indent=1))
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
