"""The kernel figures of docs/PERFORMANCE_NOTES.md attempts 46-52, on Gemma 3 270M's shapes: prefill attention of a
chat turn after a prefix hit, decode attention, greedy sampling's row max against torch's, the offload tier's block
copy against torch's index copies, the int8 LM head with its panels packed once against packed at every call, and
the decoder layers' int8 matmuls at one row on the default model's own weights. The attention kernels are also
timed on the AVX2 build (the prefill kernel's AVX-512 path, attempt 46, against the AVX2 one; outputs compared bit
for bit) and, with OLD.so, on an older build: a library built from an earlier commit (check it out, run `pytest
tests/unit/test_kernels.py -k prefill` once, and take the newest ~/.cache/kvserve/kernels/kvserve_kernels_*.so;
e.g. the commit before 18107ee for attempts 46 and 48). Only its attention entry points and the int8 matmul are
bound, so a build that lacks later kernels loads. Minimum of alternated repeats. Not run by CI.

Usage: python scripts/ab_kernel_shapes.py [--old OLD.so] [--repeats 20]
"""

from __future__ import annotations

import argparse
import ctypes
import time
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path

import gguf
import torch

from kvserve.kernels.native import SIGNATURES
from kvserve.kernels.ops import NativeKernels, load_kernels
from kvserve.kv.cache import LayerKVCache
from kvserve.kv.offload.layout import BlockLayout
from kvserve.model.source import default_model_path
from kvserve.model.tokenizer import default_cache_dir

HEADS, KV_HEADS, DIM, BLOCK = 4, 1, 256, 16  # Gemma 3 270M's attention
VOCAB, HIDDEN, LAYERS = 262_144, 640, 18
Q8_0 = 8  # ggml's type id


def older_build(path: Path, activation_quantization: str = "none") -> NativeKernels:
    """An older build with only its attention entry points and the int8 matmul bound (their signatures are
    today's)."""
    library = ctypes.CDLL(str(path))
    for name in ("kvserve_paged_prefill_attention", "kvserve_paged_decode_attention", "kvserve_gguf_matmul_int8"):
        function = getattr(library, name)
        function.argtypes, function.restype = SIGNATURES[name], None
    return NativeKernels(library, activation_quantization=activation_quantization)


def best_ms(fns: Mapping[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Each function's fastest call in ms, the functions alternated."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * min(t) for name, t in times.items()}


def paged_context(seqs: int, seq_len: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K and V caches of `seqs` sequences of seq_len tokens in shuffled blocks, and their block tables."""
    per = -(-seq_len // BLOCK)
    order = torch.randperm(seqs * per, generator=g)
    k = torch.randn(seqs * per, BLOCK, KV_HEADS, DIM, generator=g)
    v = torch.randn(seqs * per, BLOCK, KV_HEADS, DIM, generator=g)
    return k, v, order.view(seqs, per)


def print_row(what: str, ms: dict[str, float], base: str, other: str, note: str = "") -> None:
    print(f"{what}: {other} {ms[other]:.3f} ms, {base} {ms[base]:.3f} ms, {ms[base] / ms[other]:.2f}x {note}".rstrip())


def report(what: str, calls: Mapping[str, Callable[[], torch.Tensor]], repeats: int) -> None:
    """The current build ("new") against each other one, with whether their outputs are bit-identical."""
    outs = {name: call() for name, call in calls.items()}
    ms = best_ms(calls, repeats)
    for other in (name for name in calls if name != "new"):
        same = torch.equal(outs[other], outs["new"])
        print_row(f"{what}, {other} build", ms, other, "new", f"(bit-identical: {same})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path, default=None, help="an older kernel library to compare the attention with")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    new = load_kernels(default_cache_dir() / "kernels")
    int8 = load_kernels(default_cache_dir() / "kernels", activation_quantization="int8")
    assert isinstance(new, NativeKernels) and isinstance(int8, NativeKernels), "needs the native kernels"
    builds = {"new": new, "avx2": load_kernels(default_cache_dir() / "kernels", isa="avx2")}
    if args.old:
        builds["old"] = older_build(args.old)
    g = torch.Generator().manual_seed(0)
    print(f"kernels built for {new.isa}; {args.repeats} alternated repeats, the fastest of each")

    for seq_len, q_len, window in ((1485, 85, None), (1485, 85, 512)):  # a chat turn after a prefix hit
        k, v, tables = paged_context(1, seq_len, g)
        q = torch.randn(q_len, HEADS, DIM, generator=g)
        calls = {
            n: partial(b.paged_prefill_attention, q, k, v, tables[0], seq_len, window, 0.0625)
            for n, b in builds.items()
        }
        report(f"prefill attention, {q_len} queries x {seq_len} keys, window {window}", calls, args.repeats)

    for batch, context in ((32, 64), (32, 512), (8, 1500)):
        k, v, tables = paged_context(batch, context, g)
        q = torch.randn(batch, HEADS, DIM, generator=g)
        lens = torch.full((batch,), context, dtype=torch.int64)
        calls = {n: partial(b.paged_decode_attention, q, k, v, tables, lens, None, 0.0625) for n, b in builds.items()}
        report(f"decode attention (a layer), batch {batch} at {context} tokens", calls, args.repeats)

    for rows in (32, 1):
        logits = torch.randn(rows, VOCAB, generator=g)
        same = torch.equal(new.row_max(logits)[1], logits.max(dim=-1)[1])
        ms = best_ms(
            {"torch": partial(torch.max, logits, dim=-1), "native": partial(new.row_max, logits)}, args.repeats
        )
        print_row(f"greedy row max, {rows} x {VOCAB}", ms, "torch", "native", f"(same ids: {same})")

    body_int8({"new": int8} | ({"old": older_build(args.old, "int8")} if args.old else {}), g, args.repeats)
    lm_head(int8, g, args.repeats)  # before the restore: on these VMs a freshly written GiB slows the next seconds
    restore(new, g, args.repeats)


def lm_head(int8: NativeKernels, g: torch.Generator, repeats: int) -> None:
    """The tied LM head of Gemma 3 270M (Q8_0) with int8 activations, its panels packed once against at every call."""
    head = torch.randint(0, 256, (VOCAB, HIDDEN // 32 * 34), dtype=torch.uint8, generator=g)
    head.view(-1, 34)[:, :2] = torch.tensor([0, 0x24], dtype=torch.uint8)  # fp16 scale 2**-6 in every block
    start = time.perf_counter()
    packed = int8.pack_int8_panels(head, Q8_0)
    if packed is None:
        print("int8 LM head: this build has no panel path (it needs AVX-512 VNNI)")
        return
    print(f"int8 LM head panels: {packed.numel() / 2**20:.0f} MiB, packed in {time.perf_counter() - start:.3f} s")
    for rows in (8, 32):
        x = torch.randn(rows, HIDDEN, generator=g)
        same = torch.equal(int8.gguf_matmul_packed(x, head, packed, Q8_0), int8.gguf_matmul(x, head, Q8_0))
        calls = {"every call": partial(int8.gguf_matmul, x, head, Q8_0)}
        calls["once"] = partial(int8.gguf_matmul_packed, x, head, packed, Q8_0)
        ms = best_ms(calls, max(3, repeats // 4))
        print_row(
            f"int8 LM head {VOCAB} x {HIDDEN}, {rows} rows, panels packed",
            ms,
            "every call",
            "once",
            f"(same bits: {same})",
        )


def body_int8(builds: Mapping[str, NativeKernels], g: torch.Generator, repeats: int) -> None:
    """Each decoder-layer matmul of the default model at one row (decode at batch 1) with int8 activations, on the
    file's own blocks: one call a layer, the 18 layers' tensors in turn (about 4 MB a layer, so the weights come
    from the shared cache, not a core's own). Outputs of two builds agree up to float32 summation order."""
    reader = gguf.GGUFReader(default_model_path())
    for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
        tensors = [t for t in reader.tensors if t.name.endswith(f".{name}.weight")]
        weights = [
            (int(t.tensor_type), torch.from_numpy(t.data.copy()).view(torch.uint8).view(int(t.shape[1]), -1))
            for t in tensors
        ]
        x = torch.randn(1, int(tensors[0].shape[0]), generator=g)
        types = "/".join(sorted({t.tensor_type.name for t in tensors}))

        outs = {n: every_layer(b, x, weights) for n, b in builds.items()}
        calls = {n: partial(every_layer, b, x, weights) for n, b in builds.items()}
        ms = {n: t / len(weights) for n, t in best_ms(calls, repeats).items()}
        kb = sum(blocks.numel() for _, blocks in weights) / len(weights) / 1024
        what = f"int8 matmul at 1 row, {name} ({types}, {kb:.0f} KiB a layer)"
        if "old" in builds:
            diff = float((outs["old"] - outs["new"]).abs().max() / outs["old"].abs().max())
            print_row(what, ms, "old", "new", f"(largest difference {diff:.1e} of the largest output)")
        else:
            print(f"{what}: {ms['new']:.3f} ms")


def every_layer(kernels: NativeKernels, x: torch.Tensor, weights: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    return torch.stack([kernels.gguf_matmul(x, blocks, qtype) for qtype, blocks in weights])


def restore(new: NativeKernels, g: torch.Generator, repeats: int) -> None:
    """A restore of 70 blocks from a host tier into scattered pool blocks, through BlockLayout (kv/offload/layout.py)
    with the native copy and with its torch path."""
    caches = [LayerKVCache(*paged_context(1, 230 * BLOCK, g)[:2]) for _ in range(LAYERS)]
    layouts = {"torch": BlockLayout(caches), "native": BlockLayout(caches, copy_rows=new.copy_rows)}
    slab = torch.randint(0, 256, (600, layouts["torch"].block_bytes), dtype=torch.uint8, generator=g)
    ids, slab_rows = torch.randperm(230, generator=g)[:70].tolist(), list(range(500, 570))
    ms = best_ms({n: partial(layout.scatter, ids, slab, slab_rows) for n, layout in layouts.items()}, repeats)
    print_row(
        f"offload tier restore of 70 blocks ({layouts['torch'].block_bytes // 1024} KiB each)", ms, "torch", "native"
    )


if __name__ == "__main__":
    main()
