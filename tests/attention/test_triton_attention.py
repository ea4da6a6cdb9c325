"""The Triton paged-attention kernels (kvserve/attention/triton_kernels.py) against the reference attention, run
in Triton's interpreter on CPU tensors, or compiled on a CUDA device where there is one (conftest.py says
how), on small shapes: the interpreter is slow.

Every cache is paged through shuffled block tables, and every slot no context covers (the tails of last blocks,
spare blocks, the padding block 0) holds NaN, data and 8-bit scales alike: a kernel that reads one past a
context fails the comparison (checked by widening the kernels' masks by one position). The interpreter
returns 0 for masked lanes, so the tl.where that zeroes them on a GPU (where they are undefined) is only
exercised there.

Tolerances: float32 q and cache, atol = rtol = 1e-5 (the same softmax in another summation order; 8-bit caches
too, since the reference dequantizes the very same bytes and scales); bfloat16 q, atol = rtol = 2e-2 (the
output is rounded to bfloat16, whose step is 2^-8 relative; on a GPU the dots also take bf16 operands).
On a GPU the float32 dots run in true float32 ("ieee"), so the float32 tolerance holds there too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zlib
from pathlib import Path
from types import ModuleType

import pytest
import torch
from paged_tables import shuffled_block_tables

from kvserve.attention.backend import AttentionLayerSpec
from kvserve.attention.metadata import AttentionMetadata
from kvserve.attention.reference import context_slots, reference_attention
from kvserve.attention.triton import triton_attention
from kvserve.kv.cache import LayerKVCache
from kvserve.kv.quant import quant_format

CPU = torch.device("cpu")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
HEADS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (4, 1)}


def make_case(
    seqs: list[tuple[int, int]],
    block_size: int,
    num_heads: int,
    kv_heads: int,
    head_dim: int = 32,
    seed: int = 0,
    kv_dtype: torch.dtype = torch.float32,
    q_dtype: torch.dtype = torch.float32,
    device: torch.device = CPU,
) -> tuple[torch.Tensor, LayerKVCache, AttentionMetadata]:
    """q for sequences given as (seq_len, query_len), and a cache holding their whole contexts (written through
    LayerKVCache.write, so 8-bit caches are quantized as the engine does) with NaN everywhere else; built on
    the CPU (same random numbers everywhere), then moved to `device`."""
    torch.manual_seed(seed)
    tables, meta, num_blocks = shuffled_block_tables(seqs, block_size, seed, spare_blocks=3)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    nan = float("nan")
    quantized = quant_format(kv_dtype) is not None
    # int8 has no NaN: its unused slots hold -128 and their NaN scales do the poisoning.
    fill = -128 if kv_dtype == torch.int8 else nan
    data = [torch.full(shape, fill, dtype=torch.float32).to(kv_dtype) for _ in range(2)]
    scales = [torch.full(shape[:3], nan) if quantized else None for _ in range(2)]
    cache = LayerKVCache(data[0], data[1], scales[0], scales[1])
    slots = torch.cat([context_slots(meta.block_tables[i], s, block_size) for i, (s, _) in enumerate(seqs)])
    cache.write(torch.randn(len(slots), kv_heads, head_dim), torch.randn(len(slots), kv_heads, head_dim), slots)
    q = torch.randn(sum(n for _, n in seqs), num_heads, head_dim).to(q_dtype)
    if device == CPU:
        return q, cache, meta
    moved = LayerKVCache(
        *(t.to(device) if t is not None else None for t in (cache.key, cache.value, cache.key_scale, cache.value_scale))
    )
    meta = AttentionMetadata.build(tables, meta.seq_lens_cpu, meta.query_lens_cpu, block_size, device)
    return q.to(device), moved, meta


def check(
    got: torch.Tensor, q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, layer: AttentionLayerSpec
) -> None:
    assert got.dtype == q.dtype and got.shape == q.shape
    assert torch.isfinite(got).all()
    tol = TOLERANCE[q.dtype]
    torch.testing.assert_close(got, reference_attention(q, cache, meta, layer), atol=tol, rtol=tol)


def seed_of(*parts: object) -> int:
    return zlib.crc32(repr(parts).encode())


DECODE = [(1, 1), (7, 1), (33, 1), (100, 1)]


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_matches_reference(
    block_size: int, heads: str, window: int | None, triton_kernels: ModuleType, triton_device: torch.device
) -> None:
    """Decode-only steps take the split-K kernel; these contexts span 1..7 blocks and 1..2 key tiles."""
    q, cache, meta = make_case(
        DECODE, block_size, *HEADS[heads], seed=seed_of(block_size, heads, window), device=triton_device
    )
    layer = AttentionLayerSpec(32**-0.5, window)
    # Two tiles of 64 keys at most: two parts without a window (the merge kernel runs), one with it.
    assert triton_kernels.decode_splits(
        len(DECODE), cache.num_kv_heads, meta.block_tables.shape[1], block_size, window, 64
    ) == (1 if window else 2)
    check(triton_attention(q, cache, meta, layer), q, cache, meta, layer)


@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("splits", [1, 3, 4])
def test_decode_split_k_over_long_contexts(
    splits: int, window: int | None, triton_kernels: ModuleType, triton_device: torch.device
) -> None:
    """Any number of parts gives the same answer: with 3 parts a 300-token context is cut 128 + 128 + 44, the
    short contexts leave parts empty, and the window moves where the parts start."""
    seqs = [(300, 1), (77, 1), (1, 1)]
    q, cache, meta = make_case(seqs, 16, 8, 2, head_dim=64, seed=seed_of(splits, window), device=triton_device)
    kv = triton_kernels.PagedKV(cache.key, cache.value, None, None, meta.block_tables, meta.seq_lens)
    got = triton_kernels.paged_decode(q, kv, 0.125, window, num_splits=splits)
    check(got, q, cache, meta, AttentionLayerSpec(0.125, window))


def test_decode_padding_rows_come_out_zero(triton_kernels: ModuleType, triton_device: torch.device) -> None:
    """A CUDA-graph batch may be padded with rows of seq_len 0: they attend to nothing and give 0, not NaN,
    with and without split-K, and the real rows are unaffected."""
    q, cache, meta = make_case([(70, 1), (5, 1)], 16, 4, 1, seed=9, device=triton_device)
    layer = AttentionLayerSpec(0.2, None)
    ref = reference_attention(q, cache, meta, layer)
    padded_lens = torch.tensor([70, 0, 5], device=triton_device)
    tables = meta.block_tables[[0, 0, 1]]
    kv = triton_kernels.PagedKV(cache.key, cache.value, None, None, tables, padded_lens)
    for splits in (1, 2):
        got = triton_kernels.paged_decode(q[[0, 0, 1]], kv, 0.2, None, num_splits=splits)
        assert torch.equal(got[1], torch.zeros_like(got[1]))
        torch.testing.assert_close(got[[0, 2]], ref, atol=1e-5, rtol=1e-5)


def test_decode_splits_come_from_shapes_only(triton_kernels: ModuleType) -> None:
    """The split count (part of the launch grid, so fixed in a captured CUDA graph) depends on the batch, the
    table width and the window, never on sequence lengths; a full GPU of programs needs no split."""
    splits = triton_kernels.decode_splits
    assert splits(1, 8, 256, 16, None, 64) == 32  # batch 1, 4096-token table: as many parts as allowed
    assert splits(1, 8, 256, 16, 512, 64) == 8  # a window of 512 has 8 tiles of 64
    assert splits(256, 8, 256, 16, None, 64) == 1  # 2048 programs already
    assert splits(4, 1, 1, 16, None, 64) == 1  # one tile: nothing to split


PREFILL = {
    "whole_prompts": [(40, 40), (17, 17)],
    "later_chunks_over_cached_prefix": [(90, 25), (50, 13)],
    "ragged_decode_and_prefill": [(45, 20), (9, 1), (70, 70), (3, 1), (100, 2), (1, 1)],
}


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("case", sorted(PREFILL))
def test_prefill_matches_reference(case: str, heads: str, window: int | None, triton_device: torch.device) -> None:
    """Prompts, later chunks whose earlier context is only in the cache, and decode rows mixed with chunks,
    all in one launch; block size 16 and 32 alternate over the cases."""
    block_size = 16 if (len(case) + len(heads)) % 2 else 32
    q, cache, meta = make_case(
        PREFILL[case], block_size, *HEADS[heads], seed=seed_of(case, heads, window), device=triton_device
    )
    layer = AttentionLayerSpec(0.2, window)
    check(triton_attention(q, cache, meta, layer), q, cache, meta, layer)


@pytest.mark.parametrize("block_q", [16, 32])
def test_prefill_tiles_cover_every_query_once(
    block_q: int, triton_kernels: ModuleType, triton_device: torch.device
) -> None:
    """One program per block_q queries of each sequence, in order; a sequence with no query gets none."""
    lens = [20, 1, 0, 70, 2]
    tiles = triton_kernels.prefill_tiles(lens, block_q, triton_device).tolist()
    assert tiles == [[seq, start] for seq, n in enumerate(lens) for start in range(0, n, block_q)]
    assert len(tiles) == sum(-(-n // block_q) for n in lens)


@pytest.mark.parametrize(
    "kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8], ids=["fp8_e4m3", "fp8_e5m2", "int8"]
)
@pytest.mark.parametrize("seqs", [DECODE, PREFILL["ragged_decode_and_prefill"]], ids=["decode", "ragged"])
def test_8bit_cache_dequantized_in_the_kernel(
    seqs: list[tuple[int, int]], kv_dtype: torch.dtype, triton_device: torch.device
) -> None:
    q, cache, meta = make_case(seqs, 16, 8, 2, seed=seed_of(seqs, kv_dtype), kv_dtype=kv_dtype, device=triton_device)
    layer = AttentionLayerSpec(32**-0.5, 20)
    check(triton_attention(q, cache, meta, layer), q, cache, meta, layer)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16_cache", "fp8_cache"])
@pytest.mark.parametrize("seqs", [DECODE, PREFILL["ragged_decode_and_prefill"]], ids=["decode", "ragged"])
def test_bfloat16_queries(seqs: list[tuple[int, int]], kv_dtype: torch.dtype, triton_device: torch.device) -> None:
    q, cache, meta = make_case(
        seqs, 32, 4, 1, seed=seed_of(seqs, kv_dtype), kv_dtype=kv_dtype, q_dtype=torch.bfloat16, device=triton_device
    )
    layer = AttentionLayerSpec(32**-0.5, None)
    check(triton_attention(q, cache, meta, layer), q, cache, meta, layer)


@pytest.mark.parametrize(
    ("num_heads", "kv_heads", "head_dim"),
    [(6, 2, 80), (14, 2, 64), (4, 1, 256)],
    ids=["group3_dim80", "qwen2_group7", "gemma3_dim256"],
)
def test_odd_groups_and_head_dims(num_heads: int, kv_heads: int, head_dim: int, triton_device: torch.device) -> None:
    """Groups and head dims that are no power of two are padded inside the kernels (Qwen2-0.5B: 7 heads per
    KV head; Gemma 3: head_dim 256)."""
    for seqs in (DECODE, [(30, 12), (5, 1)]):
        q, cache, meta = make_case(
            seqs, 16, num_heads, kv_heads, head_dim, seed=seed_of(num_heads, head_dim), device=triton_device
        )
        layer = AttentionLayerSpec(head_dim**-0.5, 24)
        check(triton_attention(q, cache, meta, layer), q, cache, meta, layer)


def test_tiny_model_generates_the_cpu_backends_tokens(
    tmp_path: Path, interpreted_kernels: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """End to end through the engine (interpreted kernels, CPU): greedy tokens equal the "cpu" backend's on a
    tiny Gemma 3 with MQA and a sliding window of 8, with prompts chunked and batched with decodes."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from tiny_models import build_tiny_hf_model
    from tiny_tokenizer import write_char_tokenizer

    from kvserve import LLM, SamplingParams
    from kvserve.attention import registry

    decode_only: list[bool] = []  # one entry per call of the triton backend: was the step decode-only?

    def counted(q, cache, meta, layer, kernels=None):  # type: ignore[no-untyped-def]
        decode_only.append(meta.is_decode_only)
        return triton_attention(q, cache, meta, layer)

    monkeypatch.setitem(registry.BACKENDS, "triton", counted)
    build_tiny_hf_model("gemma3_mqa_sliding").save_pretrained(tmp_path)
    write_char_tokenizer(tmp_path)
    prompts = [[2, *range(10, 40)], [2, *range(50, 62)], [2, 7, 9]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = {}
    for backend in ("cpu", "triton"):
        llm = LLM(
            model=str(tmp_path),
            attention_backend=backend,
            block_size=16,
            num_gpu_blocks_override=32,
            max_num_batched_tokens=16,
        )
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens["triton"] == tokens["cpu"]
    assert all(len(t) == 8 for t in tokens["cpu"])
    assert True in decode_only and False in decode_only  # both kernels ran


def test_registering_the_backend_does_not_import_triton() -> None:
    """Only a call of the backend imports triton (CPU installs never pay for it), and without triton that call
    says what to install; a fresh interpreter, because this one has imported triton for the tests above."""
    code = """if True:
        import sys
        import kvserve.attention.registry as registry
        assert "triton" in registry.BACKENDS and "triton" not in sys.modules, [m for m in sys.modules if "triton" in m]
        sys.modules["triton"] = None  # as if it were not installed
        try:
            registry.BACKENDS["triton"](None, None, None, None)
        except RuntimeError as e:
            assert "pip install -e '.[cuda]'" in str(e), e
        else:
            raise AssertionError("no error without triton")
    """
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_kernels_compile_for_hopper_without_a_gpu(tmp_path: Path, triton_device: torch.device) -> None:
    """The interpreter runs kernels the real compiler may reject (dot shapes, types of loop-carried values);
    Triton compiles for sm_90 on a CPU machine too (its ptxas is in the wheel). bf16 q over an fp8 cache with
    split-K and a window, on the Gemma 3 shape; in a fresh interpreter without TRITON_INTERPRET, with its own
    cache directory so the compiler really runs."""
    code = (
        "import torch; from kvserve.attention import triton_kernels as tk; "
        "print(tk.compile_for_gpu(torch.bfloat16, torch.float8_e4m3fn, 4, 1, 256))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "_decode_kernel" in done.stdout and "_merge_kernel" in done.stdout and "_prefill_kernel" in done.stdout
