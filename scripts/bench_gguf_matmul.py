"""Per-shape timings of the GGUF block matmul (`--quantization gguf`) against the q8_0 matmul on the default
model's own tensors (blk.0's projections and the tied LM head, in the file's types), at several batch sizes:
minimum of repeated calls into a reused output, the two kernels alternating call by call so that both see the
same machine. Not run by CI.

`--cold` times each call over the same projection of all 18 layers (one timing per type the file uses for it), so
that, as in a decode step, the weights come from memory rather than from a cache that the previous call warmed.

`--against int8` times the GGUF matmul with int8 activations (`--activation-quantization int8`) in q8_0's place:
the same blocks, float32 activations against 8-bit ones.

`--model` takes another packaged model's name or a GGUF path (the default model by default); each line also gives
the bytes of weights read a second (GB/s) by the faster side.

Usage: python scripts/bench_gguf_matmul.py [--rows 1,8,32,512] [--cold] [--against q8_0|int8] [--model NAME]
"""

from __future__ import annotations

import argparse
import time

import torch

from kvserve.kernels.gguf_blocks import NATIVE_GGUF_TYPES
from kvserve.kernels.ops import NativeKernels, load_kernels
from kvserve.kernels.q8 import quantize_q8
from kvserve.model.gguf_reader import GGUFFile
from kvserve.model.source import resolve_model
from kvserve.model.tokenizer import default_cache_dir

TENSORS = {
    "LM head": "token_embd.weight",
    "q": "blk.0.attn_q.weight",
    "v": "blk.0.attn_v.weight",
    "gate": "blk.0.ffn_gate.weight",
    "o_proj": "blk.0.attn_output.weight",
    "down Q6_K": "blk.0.ffn_down.weight",
    "down 2": "blk.1.ffn_down.weight",
}
# --cold: each projection over every layer, grouped by the type the file stores it in
COLD = {
    "LM head": "token_embd.weight",
    "q": "attn_q.weight",
    "k": "attn_k.weight",
    "v": "attn_v.weight",
    "gate": "ffn_gate.weight",
    "up": "ffn_up.weight",
    "o_proj": "attn_output.weight",
    "down": "ffn_down.weight",
}


def weight_sets(f: GGUFFile, cold: bool) -> list[tuple[str, int, list[str]]]:
    """(label, ggml type, tensor names) to time together, one call each per timing."""
    if not cold:
        return [(label, f.tensors[name].ggml_type, [name]) for label, name in TENSORS.items()]
    sets = []
    for label, suffix in COLD.items():
        names = [name for name in f.tensors if name == suffix or name.endswith(f".{suffix}")]
        for qtype in sorted({f.tensors[name].ggml_type for name in names}):
            chosen = [name for name in names if f.tensors[name].ggml_type == qtype]
            sets.append((f"{label} x{len(chosen)}" if len(chosen) > 1 else label, qtype, chosen))
    return sets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,32,512")
    parser.add_argument("--cold", action="store_true", help="every layer's copy of each projection per timing")
    parser.add_argument("--against", choices=["q8_0", "int8"], default="q8_0", help="the other side of each timing")
    parser.add_argument("--model", default=None, help="a packaged model's name or a GGUF path")
    args = parser.parse_args()
    kernels = load_kernels(default_cache_dir() / "kernels")
    if not isinstance(kernels, NativeKernels):
        raise SystemExit("the native kernels did not build here")
    int8 = load_kernels(default_cache_dir() / "kernels", activation_quantization="int8")
    other = args.against
    with GGUFFile(resolve_model(args.model).path) as f:
        for label, qtype, names in weight_sets(f, args.cold):
            blocks = [torch.from_numpy(f.tensor_blocks(name)) for name in names]
            q8 = [quantize_q8(torch.from_numpy(f.tensor_float32(name))) for name in names] if other == "q8_0" else []
            n, k = f.tensors[names[0]].shape
            for m in map(int, args.rows.split(",")):
                if n > 100_000 and m > 64:
                    continue  # the LM head runs on sampled rows only
                x, out = torch.randn(m, k), torch.empty(m, n)
                times = {"gguf": float("inf"), other: float("inf")}
                for _ in range(3 if n > 100_000 else 15):
                    start = time.perf_counter()
                    for b in blocks:
                        kernels.gguf_matmul(x, b, qtype, out)
                    middle = time.perf_counter()
                    for q, s in q8:
                        kernels.q8_matmul(x, q, s, out)
                    for b in blocks if other == "int8" else []:
                        int8.gguf_matmul(x, b, qtype, out)
                    end = time.perf_counter()
                    times["gguf"] = min(times["gguf"], middle - start)
                    times[other] = min(times[other], end - middle)
                name = NATIVE_GGUF_TYPES[qtype].name
                flops = 2e-9 * m * n * k * len(names)
                gbps = 1e-9 * sum(b.numel() * b.element_size() for b in blocks) / min(times.values())
                print(
                    f"{label:9} {name} {n:>6} x {k:<4} rows {m:>3}: gguf "
                    f"{1e3 * times['gguf']:7.3f} ms  {other} {1e3 * times[other]:7.3f} ms  "
                    f"ratio {times[other] / times['gguf']:.2f}  "
                    f"({flops / times['gguf']:5.1f} GFLOP/s, {gbps:5.1f} GB/s)"
                )


if __name__ == "__main__":
    main()
