"""llama.cpp as a peer through its own benchmark tool, `llama-bench`, on the same GGUF file.

llama-bench reports prompt processing (pp) and token generation (tg) rates; they map onto the latency
command's TTFT (prompt tokens / pp rate) and batch-1 decode, and with `-d N` (tg after a context of N tokens) onto
its decode at depth (kvserve/bench/depth.py). Build it with scripts/build_llama_cpp.sh.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class LlamaBenchResult:
    prompt_tokens_per_s: dict[int, float]  # prompt length -> pp tokens/s
    decode_tokens_per_s: float | None  # tg at batch 1
    decode_tokens: int
    raw: list[dict]


def run_llama_bench(
    binary: Path,
    gguf: Path,
    prompt_lens: list[int],
    decode_tokens: int,
    threads: int,
    repeats: int,
    timeout_s: float = 1800,
) -> LlamaBenchResult:
    cmd = [
        str(binary),
        "-m",
        str(gguf),
        "-p",
        ",".join(map(str, prompt_lens)),
        "-n",
        str(decode_tokens),
        "-t",
        str(threads),
        "-r",
        str(repeats),
        "-o",
        "json",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    return parse_llama_bench_json(proc.stdout, decode_tokens)


def run_llama_bench_depth(
    binary: Path,
    gguf: Path,
    depth: int,
    decode_tokens: int,
    threads: int,
    repeats: int,
    kv_type: str = "f16",
    timeout_s: float = 7200,
) -> float | None:
    """llama-bench's token generation rate (tokens/s) after a context of `depth` tokens (`-p 0 -n N -d DEPTH`): the
    depth is prefilled once, untimed, and kept across the repetitions. A cache type other than f16 (-ctk/-ctv) runs
    with flash attention on (-fa 1), which llama.cpp needs for a quantized V cache."""
    cmd = [str(binary), "-m", str(gguf), "-p", "0", "-n", str(decode_tokens), "-d", str(depth)]
    cmd += ["-t", str(threads), "-r", str(repeats), "-o", "json"]
    if kv_type != "f16":
        cmd += ["-ctk", kv_type, "-ctv", kv_type, "-fa", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    return parse_llama_bench_depth_json(proc.stdout, depth)


def parse_llama_bench_depth_json(text: str, depth: int) -> float | None:
    """The tg rate of the test at n_depth == depth in llama-bench -o json's list (None where it has none)."""
    for row in json.loads(text):
        if int(row.get("n_gen", 0)) > 0 and int(row.get("n_prompt", 0)) == 0 and int(row.get("n_depth", 0)) == depth:
            return float(row["avg_ts"])
    return None


def parse_llama_bench_json(text: str, decode_tokens: int) -> LlamaBenchResult:
    """llama-bench -o json prints a list of tests, each with n_prompt, n_gen and avg_ts (tokens/s)."""
    rows = [r for r in json.loads(text) if int(r.get("n_depth", 0)) == 0]
    prompt = {int(r["n_prompt"]): float(r["avg_ts"]) for r in rows if int(r.get("n_gen", 0)) == 0}
    decode = [float(r["avg_ts"]) for r in rows if int(r.get("n_prompt", 0)) == 0 and int(r.get("n_gen", 0)) > 0]
    return LlamaBenchResult(prompt, decode[0] if decode else None, decode_tokens, rows)
