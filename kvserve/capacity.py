"""KV-cache memory math, pure Python (no torch): bytes per token, blocks per budget, what fits.

The engine sizes its block pool with `plan_kv_cache`, and `kvserve estimate` / `advise` report from the
same functions, so an estimate agrees with what `kvserve serve` allocates, to the block.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvserve.kv.groups import KVCacheLayout, make_kv_cache_layout
from kvserve.units import GiB, cdiv
from kvserve.vocab import COMPUTE_DTYPES, KV_DTYPES, QUANTIZATION_METHODS, KVDtype, check_choice

if TYPE_CHECKING:
    from kvserve.model.config import ModelConfig


def resolve_quantization(quantization: str, device_type: str, checkpoint_format: str) -> str:
    """`--quantization auto`: a GGUF checkpoint (its weights already 4-8 bit) runs as its own blocks (gguf) on CPU,
    as llama.cpp runs it: exact to the file (HF transformers computes on the same dequantized weights), the file's
    bytes per step, and since attempt 32 in docs/PERFORMANCE_NOTES.md faster at decode than re-quantizing it to
    q8_0; everything else keeps its weights."""
    if check_choice("--quantization", quantization, ("auto", *QUANTIZATION_METHODS)) != "auto":
        return quantization
    return "gguf" if checkpoint_format == "gguf" and device_type == "cpu" else "none"


def resolve_compute_dtype(dtype: str, device_type: str, checkpoint_dtype: str | None) -> str:
    """`--dtype auto`: float32 on CPU, else the checkpoint's dtype (bfloat16 when unknown), as the loader does."""
    if check_choice("--dtype", dtype, ("auto", *COMPUTE_DTYPES)) != "auto":
        return dtype
    if device_type == "cpu":
        return "float32"
    ckpt = str(checkpoint_dtype).removeprefix("torch.")
    return ckpt if ckpt in COMPUTE_DTYPES else "bfloat16"


def resolve_kv_dtype(kv_cache_dtype: str, compute_dtype: str) -> KVDtype:
    """`--kv-cache-dtype auto` follows the compute dtype."""
    check_choice("--kv-cache-dtype", kv_cache_dtype, ("auto", *KV_DTYPES))
    return KV_DTYPES[compute_dtype if kv_cache_dtype == "auto" else kv_cache_dtype]


@dataclass(frozen=True, slots=True)
class KVShape:
    """What one token costs per layer: `kv_factor` vectors (2 = K and V; 1 = MLA's joint latent) for each of
    `num_kv_heads` heads, `head_dim` elements each. `head_dim_note` says where head_dim came from."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_attention_heads: int
    sliding_windows: tuple[int | None, ...]
    kv_factor: int = 2
    head_dim_note: str = "head_dim"

    def __post_init__(self) -> None:
        if len(self.sliding_windows) != self.num_layers:
            raise ValueError(f"{len(self.sliding_windows)} sliding windows for {self.num_layers} layers")
        if min(self.num_layers, self.num_kv_heads, self.head_dim, self.kv_factor) < 1:
            raise ValueError(f"invalid KV shape {self}")

    @classmethod
    def from_model_config(cls, cfg: ModelConfig) -> KVShape:
        derived = cfg.hidden_size // cfg.num_heads
        note = "head_dim" if cfg.head_dim != derived else f"hidden_size {cfg.hidden_size} / {cfg.num_heads} heads"
        return cls(  # a hybrid model's state layers keep no KV (kv/state.py): the attention layers only
            cfg.num_kv_layers,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.num_heads,
            tuple(cfg.kv_sliding_windows),
            head_dim_note=note,
        )

    @classmethod
    def mla(cls, num_layers: int, kv_lora_rank: int, qk_rope_head_dim: int, num_attention_heads: int) -> KVShape:
        """Multi-head latent attention caches one compressed latent plus the rope key part, shared by all heads."""
        return cls(
            num_layers,
            1,
            kv_lora_rank + qk_rope_head_dim,
            num_attention_heads,
            (None,) * num_layers,
            kv_factor=1,
            head_dim_note=f"kv_lora_rank {kv_lora_rank} + qk_rope_head_dim {qk_rope_head_dim}",
        )

    @property
    def attention(self) -> str:
        if self.kv_factor == 1:
            return "MLA"
        if self.num_kv_heads == 1:
            return "MQA"
        return "MHA" if self.num_kv_heads == self.num_attention_heads else "GQA"

    @property
    def has_sliding_window(self) -> bool:
        return any(w is not None for w in self.sliding_windows)

    def layer_bytes_per_token(self, dtype: KVDtype) -> int:
        return self.kv_factor * self.num_kv_heads * (self.head_dim * dtype.element_bytes + dtype.scale_bytes)

    def bytes_per_token(self, dtype: KVDtype) -> int:
        """What a uniform layout stores per token: every layer keeps every token."""
        return self.num_layers * self.layer_bytes_per_token(dtype)

    def layout(self, hybrid: bool = True) -> KVCacheLayout:
        """The engine's KV cache groups for these layers (kv/groups.py); hybrid=False: the uniform layout."""
        return make_kv_cache_layout(self.sliding_windows, hybrid)

    def bytes_per_block(self, layout: KVCacheLayout, dtype: KVDtype, block_size: int) -> int:
        """One block id's bytes: block_size tokens of each of the layout's per-layer cache tensors."""
        return layout.tensors_per_block * self.layer_bytes_per_token(dtype) * block_size

    def formula(self, dtype: KVDtype) -> str:
        factor = "2 (K and V)" if self.kv_factor == 2 else "1 (joint latent)"
        heads = "1 latent" if self.kv_factor == 1 else f"{self.num_kv_heads} kv_heads"
        elem = f"{self.head_dim} head_dim ({self.head_dim_note}) x {dtype.element_bytes} bytes ({dtype.name})"
        if dtype.scale_bytes:
            elem = f"({elem} + {dtype.scale_bytes}-byte scale)"
        return f"{factor} x {self.num_layers} layers x {heads} x {elem} = {self.bytes_per_token(dtype)} bytes"

    def window_capped_bytes(self, seq_len: int, dtype: KVDtype, block_size: int) -> int:
        """Bytes a request of seq_len tokens needs if each sliding layer keeps only its window's blocks."""
        per_layer = self.layer_bytes_per_token(dtype) * block_size
        return per_layer * sum(window_blocks(seq_len, w, block_size) for w in self.sliding_windows)


def window_blocks(seq_len: int, window: int | None, block_size: int) -> int:
    """Blocks one layer must hold for the next query of a seq_len-token sequence: all of them for a global
    layer, only those overlapping the last `window` tokens for a sliding one."""
    if seq_len <= 0:
        return 0
    last = (seq_len - 1) // block_size
    first = 0 if window is None else max(0, seq_len - window) // block_size
    return last - first + 1


# Block 0 of every block pool is the null block (vLLM's name): never allocated, it pads block tables so that a
# padded entry can never point at a request's KV. A pool of N blocks therefore holds tokens in N - 1 of them.
NULL_BLOCK_ID = 0


def usable_blocks(num_blocks: int) -> int:
    """Blocks of a pool of `num_blocks` (the cache tensors' first dimension) that can hold tokens: all but the
    null block."""
    return max(num_blocks - 1, 0)


def blocks_per_request(seq_len: int, block_size: int) -> int:
    return cdiv(seq_len, block_size)


def _uniform(num_tokens: int, block_size: int) -> int:
    return blocks_per_request(num_tokens, block_size)


@dataclass(frozen=True, slots=True)
class CachePlan:
    """How many blocks the KV budget buys, and the context length that follows. `num_blocks` is what the cache
    tensors hold (and what the budget pays for); one of them is the null block, so requests share
    `num_usable_blocks` = num_blocks - 1. With a hybrid layout (kv/groups.py) a request's blocks depend on its length
    in no simple proportion: a sliding group holds its window's blocks whatever the length, so capacity is counted
    in requests of max-model-len, never in tokens."""

    num_blocks: int
    block_size: int
    bytes_per_block: int
    max_model_len: int
    layout: KVCacheLayout | None = None  # None: one group of every layer, each keeping every token
    # The step's token budget: a sliding group holds its window plus the chunk while a prefill chunk runs.
    max_num_batched_tokens: int = 2048
    # A hybrid model's state slots (kv/state.py): one a running sequence, and snapshots for prefix hits, paid for
    # beside the blocks; 0 for a model of attention only.
    num_state_sequences: int = 0
    num_state_snapshots: int = 0

    @property
    def num_usable_blocks(self) -> int:
        return usable_blocks(self.num_blocks)

    @property
    def num_tokens(self) -> int:
        """Token slots of the usable blocks (with a hybrid layout, a token takes a slot in every group)."""
        return self.num_usable_blocks * self.block_size

    def blocks_per_request(self, num_tokens: int) -> int:
        """Blocks of all groups a request of num_tokens holds once computed (kv/groups.py)."""
        if self.layout is None:
            return _uniform(num_tokens, self.block_size)
        return self.layout.blocks_per_request(num_tokens, self.block_size)

    @property
    def prefill_reserve(self) -> int:
        """Blocks kept for one request's prefill chunk beyond what it holds once done (sliding groups only)."""
        return (
            0
            if self.layout is None
            else prefill_reserve(self.layout, self.max_model_len, self.max_num_batched_tokens, self.block_size)
        )

    @property
    def max_concurrency(self) -> float:
        """Requests of max-model-len that fit at once, with room for one prefill chunk beside them."""
        return (self.num_usable_blocks - self.prefill_reserve) / self.blocks_per_request(self.max_model_len)

    def describe(self) -> str:
        gib = self.num_blocks * self.bytes_per_block / GiB
        head = f"KV cache: {self.num_blocks} blocks ({self.num_usable_blocks} usable + 1 null) x {self.block_size}"
        tail = f"max concurrency at max-model-len {self.max_model_len}: {self.max_concurrency:.2f}x"
        if self.layout is None or self.layout.num_groups == 1 and not self.layout.is_hybrid:
            return f"{head} = {self.num_tokens} tokens ({gib:.2f} GiB); {tail}"
        layout = self.layout
        terms = " + ".join(
            f"{n} x {held}" if n > 1 else str(held)
            for held, n in _group_terms(layout, self.max_model_len, self.block_size)
        )
        return (
            f"{head} tokens x {layout.tensors_per_block} layers ({gib:.2f} GiB) in {layout.describe()}; "
            f"a {self.max_model_len}-token request holds {terms} = {self.blocks_per_request(self.max_model_len)} "
            f"blocks; {tail}"
        )


def _group_terms(layout: KVCacheLayout, num_tokens: int, block_size: int) -> list[tuple[int, int]]:
    """(blocks one group holds, how many groups hold that many) for a request of num_tokens, full groups first."""
    terms: dict[tuple[bool, int], int] = {}
    for g in layout.groups:
        key = (g.spec.is_sliding, g.spec.blocks_held(num_tokens, block_size))
        terms[key] = terms.get(key, 0) + 1
    return [(held, n) for (_, held), n in terms.items()]


def prefill_reserve(layout: KVCacheLayout, max_model_len: int, max_num_batched_tokens: int, block_size: int) -> int:
    """Blocks a request up to max_model_len may hold beyond its final count while a prefill chunk of up to
    max_num_batched_tokens runs: the sliding groups' window before the chunk plus the chunk."""
    return layout.prefill_extra_blocks(max_model_len, max_num_batched_tokens, block_size)


def num_blocks_for_budget(budget_bytes: int, bytes_per_block: int) -> int:
    """Whole blocks that fit in the budget, the null block included; a budget without room for one usable block
    beside the null block is an error, not an empty pool."""
    num_blocks = budget_bytes // bytes_per_block
    _check_has_usable_block(
        num_blocks, f"the KV budget ({budget_bytes} bytes) holds {num_blocks} blocks of {bytes_per_block} bytes"
    )
    return num_blocks


def _check_has_usable_block(num_blocks: int, what: str) -> None:
    if usable_blocks(num_blocks) < 1:
        raise ValueError(
            f"{what}; the KV cache needs at least 2 (block {NULL_BLOCK_ID} is the null block, which "
            f"pads block tables and never holds tokens)"
        )


def request_fits(
    num_usable: int, num_tokens: int, block_size: int, layout: KVCacheLayout | None, max_num_batched_tokens: int
) -> bool:
    """Whether one request of num_tokens (its prefill chunks included) fits in num_usable blocks."""
    if layout is None:
        return _uniform(num_tokens, block_size) <= num_usable
    held = layout.blocks_per_request(num_tokens, block_size)
    return held + prefill_reserve(layout, num_tokens, max_num_batched_tokens, block_size) <= num_usable


def longest_fitting(fits: Callable[[int], bool], upper: int) -> int:
    """The largest n in [0, upper] with fits(n), for a monotone `fits` (true up to some n, false after)."""
    lo, hi = 0, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def plan_kv_cache(
    bytes_per_block: int,
    block_size: int,
    model_context_len: int,
    budget_bytes: int | None = None,
    num_blocks_override: int | None = None,
    max_model_len: int | None = None,
    layout: KVCacheLayout | None = None,
    max_num_batched_tokens: int = 2048,
    enable_chunked_prefill: bool = True,
) -> CachePlan:
    """The engine's sizing rule: blocks from the override or the budget; max-model-len defaults to the model's
    context capped by what one request (with its prefill chunks) can hold in the pool, and an explicit one must fit
    both. Without chunked prefill a prompt runs in one step, so the step's budget (max_num_batched_tokens) caps the
    default too and bounds an explicit one: a longer prompt could never be scheduled (#43 item 13)."""
    if num_blocks_override is not None:
        num_blocks = num_blocks_override
        _check_has_usable_block(num_blocks, f"--num-gpu-blocks-override is {num_blocks}")
    elif budget_bytes is not None:
        num_blocks = num_blocks_for_budget(budget_bytes, bytes_per_block)
    else:
        raise ValueError("plan_kv_cache needs a KV budget or a block count")
    usable = usable_blocks(num_blocks)

    def fits(n: int) -> bool:
        return request_fits(usable, n, block_size, layout, max_num_batched_tokens)

    def plan(length: int) -> CachePlan:
        return CachePlan(num_blocks, block_size, bytes_per_block, length, layout, max_num_batched_tokens)

    if max_model_len is None:
        upper = model_context_len if enable_chunked_prefill else min(model_context_len, max_num_batched_tokens)
        longest = longest_fitting(fits, upper)
        if longest < 1:
            raise ValueError(f"the KV cache's {usable} usable blocks do not hold one token's blocks in every group")
        return plan(longest)
    if max_model_len > model_context_len:
        raise ValueError(
            f"--max-model-len {max_model_len} is larger than the model's context length ({model_context_len})"
        )
    if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
        raise ValueError(
            f"--max-num-batched-tokens ({max_num_batched_tokens}) is smaller than --max-model-len ({max_model_len}) "
            "with chunked prefill off: long prompts could never be scheduled"
        )
    if not fits(max_model_len):
        longest = longest_fitting(fits, model_context_len)
        what = (
            f"{usable} usable blocks x {block_size} = {usable * block_size} tokens"
            if layout is None or not layout.is_hybrid
            else f"{usable} usable blocks, and a {max_model_len}-token request needs "
            f"{layout.blocks_per_request(max_model_len, block_size)} blocks of its groups plus "
            f"{prefill_reserve(layout, max_model_len, max_num_batched_tokens, block_size)} for a prefill chunk"
        )
        raise ValueError(
            f"--max-model-len {max_model_len} does not fit in the KV cache: {what}; the largest max-model-len that "
            f"fits is {longest} (or raise --kv-cache-memory-bytes)"
        )
    return plan(max_model_len)


def tier_prefix_tokens(num_blocks: int, block_size: int, layout: KVCacheLayout | None) -> int:
    """Tokens of long prefixes an offload tier of num_blocks holds: each full-attention group stores a block per
    block_size tokens; a sliding group only its window at the points a later request hits (kv/manager.py), a few
    blocks a request, left out here. Without a full-attention group (every layer windowed), a block per group."""
    groups = 1 if layout is None else len(layout.full_groups) or layout.num_groups
    return num_blocks // groups * block_size


def max_concurrent_requests(
    num_blocks: int,
    seq_len: int,
    block_size: int,
    layout: KVCacheLayout | None = None,
    max_num_batched_tokens: int = 2048,
) -> int:
    """Requests of seq_len tokens that a pool of num_blocks (null block included) holds at once (each rounds up to
    whole blocks; with sliding groups, room for one prefill chunk is kept beside them)."""
    plan = CachePlan(num_blocks, block_size, 1, seq_len, layout, max_num_batched_tokens)
    return max(0, int((plan.num_usable_blocks - plan.prefill_reserve) // plan.blocks_per_request(seq_len)))


def max_model_len_for_concurrency(
    num_blocks: int,
    block_size: int,
    concurrency: int,
    model_context_len: int,
    layout: KVCacheLayout | None = None,
    max_num_batched_tokens: int = 2048,
) -> int:
    """The longest max-model-len at which `concurrency` full-length requests still fit together in a pool of
    num_blocks (null block included)."""
    if layout is None:
        return min(model_context_len, usable_blocks(num_blocks) // concurrency * block_size)
    return longest_fitting(
        lambda n: max_concurrent_requests(num_blocks, n, block_size, layout, max_num_batched_tokens) >= concurrency,
        model_context_len,
    )


@dataclass(frozen=True, slots=True)
class Budget:
    """The KV budget in bytes and how it was arrived at (shown to the user as a formula)."""

    kv_bytes: int
    source: str  # "kv-cache-memory-bytes" | "memory" | "cpu-default"
    formula: str


def budget_from_memory(memory_bytes: int, utilization: float, weights_bytes: int, overhead_bytes: int = 0) -> Budget:
    """vLLM's rule for a device: memory x utilization, less the weights and the activation/runtime overhead."""
    kv = int(memory_bytes * utilization) - weights_bytes - overhead_bytes
    formula = (
        f"{memory_bytes} (memory) x {utilization} (gpu-memory-utilization) - {weights_bytes} (weights) - "
        f"{overhead_bytes} (overhead) = {kv} bytes"
    )
    if kv <= 0:
        raise ValueError(f"no memory left for the KV cache: {formula}")
    return Budget(kv, "memory", formula)


@dataclass(frozen=True, slots=True)
class CacheLayoutUse:
    """One cache layout serving the same requests: bytes reserved, bytes holding tokens, how many fit."""

    allocated_bytes: int
    used_bytes: int
    requests_that_fit: int

    @property
    def waste_perc(self) -> float:
        return 100.0 * (self.allocated_bytes - self.used_bytes) / self.allocated_bytes


@dataclass(frozen=True, slots=True)
class ContiguousComparison:
    contiguous: CacheLayoutUse
    paged: CacheLayoutUse


def compare_contiguous(
    bytes_per_token: int, block_size: int, requests: int, avg_len: int, max_len: int, budget_bytes: int
) -> ContiguousComparison:
    """A cache reserving max_len per request vs the paged cache rounding each (average-length) request up to
    whole blocks; 'fit' = how many such requests the budget holds under each layout."""
    if not 1 <= avg_len <= max_len:
        raise ValueError(f"--avg-len must be between 1 and --max-len ({max_len}), got {avg_len}")
    return compare_layouts([avg_len] * requests, bytes_per_token, block_size, max_len, budget_bytes)


def compare_layouts(
    lengths: Sequence[int], bytes_per_token: int, block_size: int, max_len: int, budget_bytes: int
) -> ContiguousComparison:
    """The same requests (their lengths in tokens, prompt + output) in a cache that reserves max_len per
    request and in the paged cache, which rounds each up to whole blocks. 'fit' = how many requests of this
    length distribution the budget holds at once: budget over the mean bytes one request takes."""
    if not lengths or not all(1 <= n <= max_len for n in lengths):
        raise ValueError(f"request lengths must be between 1 and max-len ({max_len})")
    used = sum(lengths) * bytes_per_token
    per_request_contig = max_len * bytes_per_token
    paged = sum(blocks_per_request(n, block_size) for n in lengths) * block_size * bytes_per_token
    return ContiguousComparison(
        contiguous=CacheLayoutUse(len(lengths) * per_request_contig, used, budget_bytes // per_request_contig),
        paged=CacheLayoutUse(paged, used, budget_bytes * len(lengths) // paged),
    )
