"""Triton kernels for paged attention on the KV cache, and their launchers (the backend is attention/triton.py).

This is the only module of kvserve that imports triton; attention/triton.py imports it lazily, at the first
call, so that `import kvserve` and CPU installs never pay for it.

Both kernels read K and V in place through the block tables: a key position `p` of sequence `i` lives in
cache block `block_tables[i, p // block_size]` at offset `p % block_size`. A tile of BLOCK_N key positions
looks its blocks up token by token, so tiles need not line up with cache blocks and any block size works.
8-bit caches (fp8 e4m3 / e5m2, int8) are dequantized in the kernel with their per-token-per-head float32
scales; every product is accumulated in float32 and the output is written in q's dtype.

- GQA sharing: one program serves all the query heads that read one KV head (MQA: all of them), so each
  K/V tile is loaded once per group, not once per query head. The group's heads are the rows of a
  [rows, head_dim] query tile, padded to at least 16 rows so that q.K^T and P.V run on tl.dot.
- Decode (`paged_decode`, every sequence has one query row) is flash-decoding: the context (only its last
  `sliding_window` positions, if the layer has a window) is cut into `num_splits` equal parts, one program
  per (sequence, KV head, part); each part keeps its running max, softmax sum and unnormalized weighted V,
  and a second small kernel merges the parts. At small batch this puts every SM to work on one long
  context; at large batch the launcher chooses a single part and the first kernel writes the output itself.
- CUDA-graph capturable decode: the launcher takes no Python value from a device tensor (no `.item()`, no
  host sync). The grid is (num_seqs, kv_heads, num_splits), and num_splits is chosen only from host shapes
  (block-table width, window, batch size); each program reads its sequence's length from the device
  tensor `seq_lens` and derives its part of the context from it. So a graph captured at one batch size and
  block-table width replays correctly for any sequence lengths that fit the table. A padding row with
  seq_len 0 attends to nothing and comes out 0 (never NaN). Triton compiles a kernel at its first launch
  for each new set of constexprs (dtype, head_dim, group, block size, splits): warm up before capturing.
- Prefill / chunked prefill / ragged batches (`paged_prefill`): flash attention (online softmax over key
  tiles). The query rows of a sequence are its last query_len positions; earlier positions are already in
  the cache. A program takes BLOCK_Q query positions of one sequence times the GROUP heads of one KV head;
  the (sequence, first query) of every program comes from a small host-built tile map, so a batch mixing
  decode rows and prefill chunks is one launch with no idle programs. Key tiles wholly hidden by the causal
  mask or the sliding window are never visited (the key loop runs over [first visible, last visible]).
- Unused cache slots may hold anything, NaN included: positions outside the context are masked at the load
  (never read) and zeroed with tl.where after it, so a NaN can never meet a zero probability.
- Triton's interpreter runs these kernels on CPU tensors, which is how tests/attention checks them
  (TRITON_INTERPRET=1 must be set before `triton` itself is first imported and stay set; the tests'
  conftest.py says why). Its tl.dot multiplies bfloat16 operands as their raw bit patterns (Triton 3.9),
  so when interpreted the launchers upcast the dot operands to float32: bf16 loads, stores and rounding of
  the output are exercised there, bf16 tensor-core dots only on a GPU.
Only language features of Triton 3.6 are used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

_LOG2E = 1.4426950408889634
# Programs a decode launch aims for before it splits contexts: about two waves on a 132-SM H100/H200.
_TARGET_PROGRAMS = 256
_MAX_SPLITS = 32
_MIN_DOT = 16  # tl.dot needs every dimension >= 16


@triton.jit
def _load_kv_tile(
    cache_ptr,
    scale_ptr,
    table_ptr,
    pos,
    valid,
    offs_d,
    d_mask,
    kv_head,
    stride_b,
    stride_s,
    stride_h,
    sc_stride_b,
    sc_stride_s,
    sc_stride_h,
    BLOCK_SIZE: tl.constexpr,
    IS_QUANT: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
):
    """K or V at key positions `pos` ([BLOCK_N]) of one sequence and KV head, as [BLOCK_N, D_PAD] in
    OUT_DTYPE; positions where `valid` is false (and padded head dims) are never read and come out 0."""
    block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=valid, other=0)
    offset = pos % BLOCK_SIZE
    rows = block * stride_b + offset * stride_s + kv_head * stride_h
    mask = valid[:, None] & d_mask[None, :]
    # No `other=`: masked lanes are undefined (and the interpreter cannot cast a fill to fp8); the tl.where
    # below zeroes them, so that a probability of 0 is never multiplied by whatever they hold.
    x = tl.load(cache_ptr + rows[:, None] + offs_d[None, :], mask=mask)
    if IS_QUANT:
        scale = tl.load(
            scale_ptr + block * sc_stride_b + offset * sc_stride_s + kv_head * sc_stride_h, mask=valid, other=0.0
        )
        x = x.to(tl.float32) * scale[:, None]
    return tl.where(mask, x, 0.0).to(OUT_DTYPE)


@triton.jit
def _online_softmax_step(s, v, m, lsum, acc, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """One key tile of the online softmax, shared by the decode and prefill kernels: scores s (log2 units, -inf
    where masked) and the tile's values v fold into the running max m, sum lsum and weighted values acc;
    returns the new (m, lsum, acc). A row that has seen no key yet (max -inf) is shifted by 0, so exp2 gives 0,
    not NaN."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    shift = tl.where(m_new > float("-inf"), m_new, 0.0)
    alpha = tl.exp2(m - shift)
    p = tl.exp2(s - shift[:, None])
    lsum = lsum * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=PRECISION)
    return m_new, lsum, acc


@triton.jit
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    scale_log2,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_tb,
    stride_b,
    stride_s,
    stride_h,
    sc_stride_b,
    sc_stride_s,
    sc_stride_h,
    num_heads,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    IS_QUANT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = seq_len * 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    # This program's part of [lo, seq_len): equal parts, each a whole number of key tiles.
    part = tl.cdiv(tl.cdiv(seq_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * part
    end = tl.minimum(start + part, seq_len)

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q = tl.load(
        q_ptr + seq * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(DOT_DTYPE)
    table_ptr = tables_ptr + seq * stride_tb

    m = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    lsum = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        valid = pos < end  # never empty: n0 < end
        k = _load_kv_tile(
            k_ptr,
            ks_ptr,
            table_ptr,
            pos,
            valid,
            offs_d,
            d_mask,
            kv_head,
            stride_b,
            stride_s,
            stride_h,
            sc_stride_b,
            sc_stride_s,
            sc_stride_h,
            BLOCK_SIZE,
            IS_QUANT,
            DOT_DTYPE,
        )
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        v = _load_kv_tile(
            v_ptr,
            vs_ptr,
            table_ptr,
            pos,
            valid,
            offs_d,
            d_mask,
            kv_head,
            stride_b,
            stride_s,
            stride_h,
            sc_stride_b,
            sc_stride_s,
            sc_stride_h,
            BLOCK_SIZE,
            IS_QUANT,
            DOT_DTYPE,
        )
        m, lsum, acc = _online_softmax_step(s, v, m, lsum, acc, DOT_DTYPE, PRECISION)

    if NUM_SPLITS == 1:
        out = acc / tl.where(lsum > 0, lsum, 1.0)[:, None]
        tl.store(
            out_ptr + seq * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None] & d_mask[None, :],
        )
    else:
        # Partial results, laid out [num_seqs, num_heads, NUM_SPLITS] (+ [D_PAD] for acc).
        row = (seq * num_heads + heads) * NUM_SPLITS + split
        tl.store(part_m_ptr + row, m, mask=g_mask)
        tl.store(part_l_ptr + row, lsum, mask=g_mask)
        tl.store(part_acc_ptr + row[:, None] * D_PAD + offs_d[None, :], acc, mask=g_mask[:, None])


@triton.jit
def _merge_kernel(
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    stride_ot,
    stride_oh,
    num_heads,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    S_PAD: tl.constexpr,
):
    """One (sequence, head): rescale every part to the common max and add them up (log-sum-exp merge)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_mask = offs_s < NUM_SPLITS
    row = (seq * num_heads + head) * NUM_SPLITS + offs_s
    m = tl.load(part_m_ptr + row, mask=s_mask, other=float("-inf"))
    lsum = tl.load(part_l_ptr + row, mask=s_mask, other=0.0)
    acc = tl.load(part_acc_ptr + row[:, None] * D_PAD + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    m_all = tl.max(m, axis=0)
    # Empty parts (m = -inf) weigh exp2(-inf) = 0; if every part is empty (a seq_len-0 padding row), shift by 0.
    w = tl.exp2(m - tl.where(m_all > float("-inf"), m_all, 0.0))
    total = tl.sum(w * lsum, axis=0)
    out = tl.sum(w[:, None] * acc, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + seq * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM
    )


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    tiles_ptr,
    out_ptr,
    scale_log2,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_tb,
    stride_b,
    stride_s,
    stride_h,
    sc_stride_b,
    sc_stride_s,
    sc_stride_h,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    IS_QUANT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tiles_ptr + 2 * tile)
    q0 = tl.load(tiles_ptr + 2 * tile + 1)  # first query (of this sequence's chunk) in the tile
    row_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - row_start
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len  # position of the chunk's first query

    # Row r of the tile is query q0 + r // G_PAD, head kv_head * GROUP + r % G_PAD.
    offs_r = tl.arange(0, BLOCK_Q * G_PAD)
    offs_d = tl.arange(0, D_PAD)
    qi = q0 + offs_r // G_PAD
    g = offs_r % G_PAD
    r_mask = (qi < q_len) & (g < GROUP)
    d_mask = offs_d < HEAD_DIM
    q_pos = first_pos + qi
    q_rows = (row_start + qi) * stride_qt + (kv_head * GROUP + g) * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=r_mask[:, None] & d_mask[None, :], other=0.0).to(
        DOT_DTYPE
    )
    table_ptr = tables_ptr + seq * stride_tb

    # Keys any row of the tile may see: causal up to its last query, windowed from its first.
    hi = first_pos + tl.minimum(q0 + BLOCK_Q, q_len)
    lo = hi * 0
    if HAS_WINDOW:
        lo = tl.maximum(first_pos + q0 - window + 1, 0)

    m = tl.full([BLOCK_Q * G_PAD], float("-inf"), dtype=tl.float32)
    lsum = tl.zeros([BLOCK_Q * G_PAD], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q * G_PAD, D_PAD], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + offs_n
        valid = pos < hi
        k = _load_kv_tile(
            k_ptr,
            ks_ptr,
            table_ptr,
            pos,
            valid,
            offs_d,
            d_mask,
            kv_head,
            stride_b,
            stride_s,
            stride_h,
            sc_stride_b,
            sc_stride_s,
            sc_stride_h,
            BLOCK_SIZE,
            IS_QUANT,
            DOT_DTYPE,
        )
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        seen = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            seen = seen & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        v = _load_kv_tile(
            v_ptr,
            vs_ptr,
            table_ptr,
            pos,
            valid,
            offs_d,
            d_mask,
            kv_head,
            stride_b,
            stride_s,
            stride_h,
            sc_stride_b,
            sc_stride_s,
            sc_stride_h,
            BLOCK_SIZE,
            IS_QUANT,
            DOT_DTYPE,
        )
        m, lsum, acc = _online_softmax_step(s, v, m, lsum, acc, DOT_DTYPE, PRECISION)

    out = acc / tl.where(lsum > 0, lsum, 1.0)[:, None]
    o_rows = (row_start + qi) * stride_ot + (kv_head * GROUP + g) * stride_oh
    tl.store(
        out_ptr + o_rows[:, None] + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=r_mask[:, None] & d_mask[None, :],
    )


# Whether the kernels above were decorated for Triton's CPU interpreter (TRITON_INTERPRET=1 at import) rather
# than compiled; read off the kernel itself, which works on every Triton version.
INTERPRETED: bool = not isinstance(_decode_kernel, JITFunction)


@dataclass(frozen=True, slots=True)
class PagedKV:
    """One layer's paged cache as the kernels take it: data, optional scales (8-bit) and the block tables."""

    key: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]
    value: torch.Tensor
    key_scale: torch.Tensor | None  # [num_blocks, block_size, kv_heads] float32, exactly when 8-bit
    value_scale: torch.Tensor | None
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64
    seq_lens: torch.Tensor  # [num_seqs] int64, on the cache's device


def _pow2(n: int) -> int:
    return triton.next_power_of_2(n)


def _dot_args(dtype: torch.dtype) -> dict[str, object]:
    """tl.dot's operand dtype and precision: q's dtype on a GPU (float32 under the interpreter, see the
    docstring); float32 operands in true float32 ("ieee"), never rounded to tf32, so fp32 runs match the
    reference to ~1e-5."""
    if INTERPRETED or dtype == torch.float32:
        return {"DOT_DTYPE": tl.float32, "PRECISION": "ieee"}
    return {"DOT_DTYPE": {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype], "PRECISION": "tf32"}


def _check(q: torch.Tensor, kv: PagedKV) -> None:
    if q.device.type != "cuda" and not INTERPRETED:
        raise RuntimeError(
            "the triton attention backend runs on CUDA tensors (or on CPU in Triton's interpreter: "
            "TRITON_INTERPRET=1 set before triton is first imported, see tests/attention/conftest.py)"
        )
    if q.stride(-1) != 1 or kv.key.stride(-1) != 1 or kv.value.stride(-1) != 1 or kv.key.stride() != kv.value.stride():
        raise ValueError("the triton attention kernels need contiguous head_dim and K/V caches of the same layout")
    if q.shape[1] % kv.key.shape[2]:
        raise ValueError(f"{q.shape[1]} query heads do not share {kv.key.shape[2]} KV heads evenly")


def _cache_args(kv: PagedKV) -> tuple:
    """The cache tensors and strides both kernels take (a scale tensor stands in for itself when unquantized)."""
    ks = kv.key_scale if kv.key_scale is not None else kv.key
    vs = kv.value_scale if kv.value_scale is not None else kv.value
    sc_strides = ks.stride()[:3] if kv.key_scale is not None else (0, 0, 0)
    if kv.key_scale is not None and (kv.value_scale is None or kv.value_scale.stride() != kv.key_scale.stride()):
        raise ValueError("an 8-bit cache needs key and value scales of the same layout")
    return (kv.key, kv.value, ks, vs), (*kv.key.stride()[:3], *sc_strides)


def decode_splits(
    num_seqs: int, kv_heads: int, max_blocks: int, block_size: int, window: int | None, block_n: int
) -> int:
    """Parts each context is cut into: enough programs to fill the GPU, never more parts than key tiles the
    widest context (block-table width, capped by the window) has. Host shapes only, so CUDA-graph safe."""
    width = max_blocks * block_size if window is None else min(max_blocks * block_size, window)
    tiles = triton.cdiv(max(width, 1), block_n)
    want = triton.cdiv(_TARGET_PROGRAMS, max(num_seqs * kv_heads, 1))
    return max(1, min(want, tiles, _MAX_SPLITS))


def _decode_block_n(head_dim: int) -> int:
    return 64 if _pow2(head_dim) <= 128 else 32


def paged_decode(
    q: torch.Tensor, kv: PagedKV, scale: float, window: int | None, num_splits: int | None = None
) -> torch.Tensor:
    """Attention of one query row per sequence (q: [num_seqs, num_heads, head_dim]) over its paged context;
    returns [num_seqs, num_heads, head_dim] in q's dtype. `num_splits` overrides decode_splits (tests)."""
    _check(q, kv)
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = kv.key.shape
    group = num_heads // kv_heads
    splits = num_splits or decode_splits(
        num_seqs, kv_heads, kv.block_tables.shape[1], block_size, window, _decode_block_n(head_dim)
    )
    d_pad = max(_pow2(head_dim), _MIN_DOT)
    out = torch.empty_like(q)
    if splits == 1:
        part_m = part_l = part_acc = out  # not written: the kernel stores the output itself
    else:
        part_m = torch.empty((num_seqs, num_heads, splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((num_seqs, num_heads, splits, d_pad), dtype=torch.float32, device=q.device)
    tensors, strides = _cache_args(kv)
    _decode_kernel[(num_seqs, kv_heads, splits)](
        q,
        *tensors,
        kv.block_tables,
        kv.seq_lens,
        out,
        part_m,
        part_l,
        part_acc,
        scale * _LOG2E,
        window or 0,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        kv.block_tables.stride(0),
        *strides,
        num_heads,
        **_decode_constants(q.dtype, group, head_dim, block_size, splits, window is not None, kv.key_scale is not None),
        num_warps=4,
    )
    if splits > 1:
        _merge_kernel[(num_seqs, num_heads)](
            out,
            part_m,
            part_l,
            part_acc,
            out.stride(0),
            out.stride(1),
            num_heads,
            **_merge_constants(head_dim, splits),
            num_warps=4,
        )
    return out


def _decode_constants(
    q_dtype: torch.dtype, group: int, head_dim: int, block_size: int, splits: int, has_window: bool, is_quant: bool
) -> dict[str, object]:
    """The decode kernel's constexprs (one compiled variant per distinct dict)."""
    return dict(
        GROUP=group,
        G_PAD=max(_pow2(group), _MIN_DOT),
        HEAD_DIM=head_dim,
        D_PAD=max(_pow2(head_dim), _MIN_DOT),
        BLOCK_SIZE=block_size,
        BLOCK_N=_decode_block_n(head_dim),
        NUM_SPLITS=splits,
        HAS_WINDOW=has_window,
        IS_QUANT=is_quant,
        **_dot_args(q_dtype),
    )


def _merge_constants(head_dim: int, splits: int) -> dict[str, object]:
    return dict(HEAD_DIM=head_dim, D_PAD=max(_pow2(head_dim), _MIN_DOT), NUM_SPLITS=splits, S_PAD=_pow2(splits))


@dataclass(frozen=True, slots=True)
class PrefillTiling:
    """How paged_prefill cuts a layer's query rows into programs: BLOCK_Q queries times the group's heads."""

    group: int
    g_pad: int
    block_q: int
    block_n: int

    @classmethod
    def for_shape(cls, num_heads: int, kv_heads: int, head_dim: int) -> "PrefillTiling":
        group = num_heads // kv_heads
        g_pad = _pow2(group)
        rows = 64 if _pow2(head_dim) <= 128 else 32  # query rows (queries x heads) per program
        block_q = max(rows // g_pad, 1, _MIN_DOT // g_pad)
        return cls(group, g_pad, block_q, 64 if _pow2(head_dim) <= 128 else 32)


def prefill_tiles(query_lens: list[int], block_q: int, device: torch.device) -> torch.Tensor:
    """[num_tiles, 2] int32 (sequence, first query) of every program of a ragged batch, from host lengths."""
    tiles = [(i, start) for i, n in enumerate(query_lens) for start in range(0, n, block_q)]
    return torch.tensor(tiles, dtype=torch.int32).reshape(-1, 2).to(device, non_blocking=True)


def paged_prefill(
    q: torch.Tensor,
    kv: PagedKV,
    query_start_loc: torch.Tensor,
    tiles: torch.Tensor,
    tiling: PrefillTiling,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """Attention of a ragged batch (q: [T, num_heads, head_dim]; sequence i's rows are
    query_start_loc[i]:query_start_loc[i+1], its last positions) over each paged context, causal and
    windowed; `tiles` comes from prefill_tiles with tiling.block_q. Returns [T, num_heads, head_dim]."""
    _check(q, kv)
    head_dim = q.shape[2]
    _, block_size, kv_heads, _ = kv.key.shape
    out = torch.empty_like(q)
    if tiles.shape[0] == 0:
        return out
    tensors, strides = _cache_args(kv)
    _prefill_kernel[(tiles.shape[0], kv_heads)](
        q,
        *tensors,
        kv.block_tables,
        kv.seq_lens,
        query_start_loc,
        tiles,
        out,
        scale * _LOG2E,
        window or 0,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        kv.block_tables.stride(0),
        *strides,
        **_prefill_constants(q.dtype, tiling, head_dim, block_size, window is not None, kv.key_scale is not None),
        num_warps=4,
    )
    return out


def _prefill_constants(
    q_dtype: torch.dtype, tiling: PrefillTiling, head_dim: int, block_size: int, has_window: bool, is_quant: bool
) -> dict[str, object]:
    return dict(
        GROUP=tiling.group,
        G_PAD=tiling.g_pad,
        BLOCK_Q=tiling.block_q,
        HEAD_DIM=head_dim,
        D_PAD=max(_pow2(head_dim), _MIN_DOT),
        BLOCK_SIZE=block_size,
        BLOCK_N=tiling.block_n,
        HAS_WINDOW=has_window,
        IS_QUANT=is_quant,
        **_dot_args(q_dtype),
    )


# Pointer arguments whose element type is not q's or the cache's, by name (for compile_for_gpu).
_FIXED_POINTERS = {
    "tables_ptr": "*i64",
    "seq_lens_ptr": "*i64",
    "query_start_ptr": "*i64",
    "tiles_ptr": "*i32",
    "part_m_ptr": "*fp32",
    "part_l_ptr": "*fp32",
    "part_acc_ptr": "*fp32",
}
_TL_NAMES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.float8_e5m2: "fp8e5",
    torch.int8: "i8",
}


def compile_for_gpu(
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    num_heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    splits: int = 4,
    window: bool = True,
    arch: int = 90,
) -> list[str]:
    """Compile the three kernels for one shape and NVIDIA compute capability `arch` without a GPU (Triton
    brings its own ptxas), so that CPU-only CI catches what only the real compiler rejects (dot shapes, types
    of loop-carried values); returns each kernel's name and shared-memory bytes. Needs the compiled (not
    interpreted) kernels."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    is_quant = kv_dtype.itemsize == 1
    q_t, kv_t = _TL_NAMES[q_dtype], _TL_NAMES[kv_dtype]
    types = {
        "q_ptr": f"*{q_t}",
        "out_ptr": f"*{q_t}",
        "k_ptr": f"*{kv_t}",
        "v_ptr": f"*{kv_t}",
        "ks_ptr": "*fp32" if is_quant else f"*{kv_t}",
        "vs_ptr": "*fp32" if is_quant else f"*{kv_t}",
        "scale_log2": "fp32",
        **_FIXED_POINTERS,
    }
    group = num_heads // kv_heads
    variants = [
        (_decode_kernel, _decode_constants(q_dtype, group, head_dim, block_size, splits, window, is_quant)),
        (_merge_kernel, _merge_constants(head_dim, splits)),
        (
            _prefill_kernel,
            _prefill_constants(
                q_dtype, PrefillTiling.for_shape(num_heads, kv_heads, head_dim), head_dim, block_size, window, is_quant
            ),
        ),
    ]
    report = []
    for kernel, constants in variants:
        names = kernel.arg_names
        signature = {n: "constexpr" if n in constants else types.get(n, "i32") for n in names}
        source = ASTSource(kernel, signature, constexprs={(names.index(n),): v for n, v in constants.items()})
        compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})
        report.append(f"{kernel.__name__}: {compiled.metadata.shared} bytes of shared memory")
    return report
