"""scripts/gpu_check.py's JSON report as the Markdown tables docs/BENCHMARKS.md takes (machine, date, correctness,
speed side by side with HF and the floor, the targets), so that figures are pasted, never retyped:
    python scripts/gpu_check_markdown.py gpu_check.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _num(value: Any, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _machine(report: dict[str, Any]) -> str:
    m = report["sections"].get("machine", {})
    gpu = m.get("gpu") or {}
    device = f"{gpu['name']} ({gpu['memory_gib']} GiB)" if gpu else m.get("cpu_model", "?")
    ceilings = report["sections"].get("ceilings", {})
    return (
        f"{m.get('utc', '?')[:10]}, {device}; torch {m.get('torch')} (CUDA {m.get('torch_cuda')}), Triton "
        f"{m.get('triton')}, transformers {m.get('transformers')}, kvserve {str(m.get('kvserve_commit'))[:10]}; "
        f"measured bandwidth {_num(ceilings.get('bandwidth_gbps_used'))} GB/s, "
        f"{ceilings.get('matmul_dtype', '?')} matmul {_num(ceilings.get('matmul_gflops', 0) / 1e3, 1)} TFLOP/s"
    )


def _correctness(sections: dict[str, Any]) -> list[str]:
    lines = [
        "| model | check | status | max abs error | min cosine | error / HF bf16's | detail |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in sections.items():
        arch, _, check = name.partition(".")
        if check.startswith("logits_"):
            f = s.get("kvserve_vs_hf_float32", {})
            max_abs = "-" if f.get("max_abs") is None else f"{f['max_abs']:.2e}"
            lines.append(
                f"| {arch} | {check} | {s['status']} | {max_abs} | "
                f"{_num(f.get('min_cosine'), 5)} | {_num(s.get('error_ratio_vs_hf_bf16'), 2)} | "
                f"{s.get('positions', '-')} positions |"
            )
        elif check == "greedy_float32":
            lines.append(
                f"| {arch} | {check} | {s['status']} | - | - | - | tokens {s.get('tokens', '-')}, "
                f"{s.get('preemptions', '-')} preemptions |"
            )
    return lines


def _speed(sections: dict[str, Any]) -> list[str]:
    lines = [
        "| model | batch | kvserve decode tok/s | HF decode tok/s | floor tok/s | kvserve x floor | "
        "kvserve / HF | kvserve prefill tok/s | HF prefill tok/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in sections.items():
        arch, _, check = name.partition(".")
        if not check.startswith("speed_b"):
            continue
        if s["status"] != "ok":
            lines.append(f"| {arch} | {check.removeprefix('speed_b')} | {s['status']} | | | | | | |")
            continue
        kv, hf = s.get("kvserve") or {}, s.get("hf") or {}
        lines.append(
            f"| {arch} | {s['batch']} | {_num(kv.get('decode_tok_s'))} | {_num(hf.get('decode_tok_s'))} | "
            f"{_num(s['floor_decode_tok_s'])} | {_num(kv.get('decode_x_floor'), 2)} | "
            f"{_num(s.get('kvserve_over_hf_decode'), 2)} | {_num(kv.get('prefill_tok_s'))} | "
            f"{_num(hf.get('prefill_tok_s'))} |"
        )
    return lines


def markdown(report: dict[str, Any]) -> str:
    sections = report["sections"]
    targets = report.get("targets") or {}
    plan = report.get("plan", {})
    out = [
        f"Machine: {_machine(report)}.",
        "",
        f"Correctness (tolerances: {json.dumps(report.get('tolerances'))}):",
        "",
        *_correctness(sections),
        "",
        f"Speed ({plan.get('speed_dtype')}, prompts of {plan.get('speed_prompt')} tokens, "
        f"{plan.get('speed_new_tokens')} new tokens each):",
        "",
        *_speed(sections),
        "",
    ]
    for name in ("batch1_decode_x_floor", "batch64_decode_over_hf"):
        t = targets.get(name) or {}
        out.append(
            f"- target {name}: {_num(t.get('value'), 2)} (wanted {t.get('target')}): "
            f"{ {True: 'met', False: 'NOT met', None: 'not measured'}[t.get('met')] }"
        )
    skipped = [n for n, s in sections.items() if s["status"] in ("skipped", "timeout", "error")]
    if skipped:
        out.append(f"- not measured or failed: {', '.join(skipped)}")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown(json.loads(Path(sys.argv[1]).read_text())))
