"""KV cache specs and groups: which layers keep which tokens, and how one block pool serves them all.

Why: a model's layers need not all attend to every token. Gemma 3 has 15 of its 18 layers looking at the last 512
tokens only; keeping every token of those layers (a uniform layout) costs ~5x the KV memory of a layout that gives
out-of-window blocks back. So each layer has a KV cache spec (full attention, or a sliding window of W tokens; the
state layers of hybrid models come next), and layers of one spec form KV cache groups, as vLLM's hybrid KV cache
manager does (its docs/design/hybrid_kv_cache_manager.md is the reference):

- Every group holds the same number of layers, `tensors_per_block` (the last group of a spec may hold fewer). The
  cache is that many per-layer tensors of [num_blocks, block_size, kv_heads, head_dim]; layer j of every group lives
  in tensor j. So a block id means the same bytes in every group, one pool of block ids serves all groups, and a
  block belongs to whichever group allocated it until it is freed.
- A request holds one block table per group. A full-attention group's table covers every token; a sliding group's
  entries before the window are the null block once the request has moved past them (their blocks went back to the
  pool, hashed, so a later prefix hit can still revive them).
- A prefix hit is the longest prefix every group can serve: a full-attention group needs all of its blocks, a sliding
  group only the blocks that cover the last W - 1 tokens before the hit point (vLLM's rule).

One spec in the whole model (every layer global, or every layer windowed) is one group of all layers: the layout
kvserve always had. `hybrid=False` (--disable-hybrid-kv-cache-manager) turns every spec into full attention, so
sliding layers keep every token (their kernels still apply the window): today's layout, for A/B runs.

Pure Python (no torch): `kvserve estimate` predicts the engine's pool from these functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.units import cdiv

FULL_ATTENTION = "full_attention"
SLIDING_WINDOW = "sliding_window"


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """What a layer keeps of a sequence's tokens: all of them (window None: full attention), or those a query can
    still see in a sliding window of `window` tokens (a query at position p sees keys p - window + 1 .. p)."""

    window: int | None = None

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise ValueError(f"a sliding window must be >= 1 token, got {self.window}")

    @property
    def kind(self) -> str:
        """vLLM's name for the spec's kind (KV events carry it)."""
        return FULL_ATTENTION if self.window is None else SLIDING_WINDOW

    @property
    def is_sliding(self) -> bool:
        return self.window is not None

    def describe(self) -> str:
        return "full attention" if self.window is None else f"sliding window {self.window}"

    def first_needed_block(self, num_computed_tokens: int, block_size: int) -> int:
        """The first block a step starting at position `num_computed_tokens` (its first query) may read: blocks
        before it hold only tokens outside every later query's window, and go back to the pool."""
        if self.window is None:
            return 0
        return max(0, num_computed_tokens - self.window + 1) // block_size

    def window_blocks(self, block_size: int) -> int | None:
        """Blocks covering the W - 1 tokens before a position that a query there still sees: what a prefix hit of
        this spec needs before its end (vLLM's sliding_window_contiguous_blocks). None: every block (full attention)."""
        return None if self.window is None else cdiv(self.window - 1, block_size)

    def blocks_held(self, num_tokens: int, block_size: int) -> int:
        """Blocks a sequence of `num_tokens` holds in this spec's group in the step that computes its last token:
        all of them, or only those overlapping that token's window."""
        if num_tokens <= 0:
            return 0
        last = (num_tokens - 1) // block_size
        return last - self.first_needed_block(num_tokens - 1, block_size) + 1

    def prefill_blocks(self, chunk_tokens: int, num_tokens: int, block_size: int) -> int:
        """The most blocks a prefill chunk of `chunk_tokens` tokens of a sequence of at most `num_tokens` holds in
        this spec's group, wherever the chunk starts (the window before its first query, the chunk, and a block
        boundary on either side; never more than the sequence's blocks). Full attention: see blocks_held."""
        if self.window is None:
            raise ValueError("a full-attention group holds every block: use blocks_held")
        return min(cdiv(self.window - 1 + chunk_tokens, block_size) + 1, cdiv(num_tokens, block_size))


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """Layers of one spec whose caches share block tables: a request holds one table per group."""

    group_id: int
    spec: KVCacheSpec
    layers: tuple[int, ...]

    def describe(self) -> str:
        return f"{self.spec.describe()}: layers {', '.join(map(str, self.layers))}"


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    """The groups of a model's layers, and where each layer's cache lives (see the module docstring)."""

    groups: tuple[KVCacheGroup, ...]
    tensors_per_block: int  # per-layer cache tensors, each [num_blocks, ...]: one block id spans this many layers
    layer_group: tuple[int, ...]  # per layer: its group
    layer_tensor: tuple[int, ...]  # per layer: which cache tensor (its index within its group)

    @property
    def num_layers(self) -> int:
        return len(self.layer_group)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def is_hybrid(self) -> bool:
        """Whether any group gives blocks back before its request ends (sliding windows)."""
        return any(g.spec.is_sliding for g in self.groups)

    @property
    def sliding_groups(self) -> tuple[KVCacheGroup, ...]:
        return tuple(g for g in self.groups if g.spec.is_sliding)

    @property
    def full_groups(self) -> tuple[KVCacheGroup, ...]:
        return tuple(g for g in self.groups if not g.spec.is_sliding)

    def blocks_per_request(self, num_tokens: int, block_size: int) -> int:
        """Blocks of all groups a request of `num_tokens` tokens holds in the step that computes its last token."""
        return sum(g.spec.blocks_held(num_tokens, block_size) for g in self.groups)

    def prefill_extra_blocks(self, num_tokens: int, chunk_tokens: int, block_size: int) -> int:
        """How many more blocks than blocks_per_request(num_tokens) a request up to `num_tokens` long may hold while
        one of its prefill chunks (at most `chunk_tokens`) runs: the sliding groups' window plus chunk. Zero
        without sliding groups."""
        chunk = min(chunk_tokens, num_tokens)
        return sum(
            max(0, g.spec.prefill_blocks(chunk, num_tokens, block_size) - g.spec.blocks_held(num_tokens, block_size))
            for g in self.sliding_groups
        )

    def signature(self) -> str:
        """The layout as text that differs whenever a block's bytes mean something else (the offload tier's
        fingerprint carries it): tensors a block spans, and each group's spec and layers."""
        groups = ";".join(f"{g.spec.kind}:{g.spec.window or 0}:{','.join(map(str, g.layers))}" for g in self.groups)
        return f"{self.tensors_per_block}|{groups}"

    def describe(self) -> str:
        """One line: the groups by spec, e.g. "full attention 1 x 3 layers, sliding window 512 5 x 3 layers"."""
        parts: list[str] = []
        for spec in dict.fromkeys(g.spec for g in self.groups):
            sizes = [len(g.layers) for g in self.groups if g.spec == spec]
            counts = ", ".join(f"{sizes.count(n)} x {n} layers" for n in sorted(set(sizes), reverse=True))
            parts.append(f"{spec.describe()} {counts}")
        return f"{self.num_groups} KV cache groups ({'; '.join(parts)})" if self.num_groups > 1 else parts[0]


def layer_specs(sliding_windows: Sequence[int | None], hybrid: bool = True) -> list[KVCacheSpec]:
    """Each layer's spec from its sliding window (None: global). Without `hybrid`, every layer keeps every token."""
    return [KVCacheSpec(w if hybrid else None) for w in sliding_windows]


def make_kv_cache_layout(sliding_windows: Sequence[int | None], hybrid: bool = True) -> KVCacheLayout:
    """Group the layers by spec, vLLM's way (kv_cache_utils' uniform page size): groups of `tensors_per_block`
    layers, the smallest spec's layer count, or the largest's when no spec has 1.25x the layers of another (then
    padding wastes less than splitting); within a spec, layers in order. Full-attention groups come first, so
    group 0 is a full-attention group whenever the model has one (an external router that reads one group reads
    that one)."""
    specs = layer_specs(sliding_windows, hybrid)
    if not specs:
        raise ValueError("a model needs at least one layer")
    by_spec: dict[KVCacheSpec, list[int]] = {}
    for i, spec in sorted(enumerate(specs), key=lambda item: item[1].is_sliding):
        by_spec.setdefault(spec, []).append(i)
    counts = [len(layers) for layers in by_spec.values()]
    size = max(counts) if max(counts) < min(counts) * 1.25 else min(counts)
    groups: list[KVCacheGroup] = []
    layer_group = [0] * len(specs)
    layer_tensor = [0] * len(specs)
    for spec, layers in by_spec.items():
        for start in range(0, len(layers), size):
            members = tuple(sorted(layers[start : start + size]))
            for j, layer in enumerate(members):
                layer_group[layer], layer_tensor[layer] = len(groups), j
            groups.append(KVCacheGroup(len(groups), spec, members))
    return KVCacheLayout(tuple(groups), size, tuple(layer_group), tuple(layer_tensor))
