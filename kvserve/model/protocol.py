"""What the engine uses of a loaded model, as one typed contract (DecoderModel is the implementation).

Why a Protocol: the engine's build, runner, CUDA graphs and memory profile each read a few members of the model; with
them named here (instead of `getattr(model, "static_kv_scales", None)`), mypy checks every use and a new model
class knows what it must offer."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from kvserve.attention.metadata import StepMetadata
    from kvserve.kernels.ops import NativeKernels
    from kvserve.kv.cache import LayerKVCache
    from kvserve.kv.state_cache import StepState


class Model(Protocol):
    # A checkpoint's calibrated per-tensor (key, value) scales per layer for an fp8 KV cache; None when it has none.
    static_kv_scales: list[tuple[float, float]] | None

    @property
    def kernel_isa(self) -> str:
        """The kernels computing this model: "torch", or the native kernels' instruction set (avx2, avx512, ...). Part
        of the KV offload tier's fingerprint: K/V computed by other kernels differs in its last bits."""
        ...

    @property
    def native_kernels(self) -> NativeKernels | None:
        """The compiled kernels this model runs on (None on the torch kernels): the engine borrows their row copy
        for the KV offload tier's copies and their row max for greedy sampling."""
        ...

    @property
    def num_logits(self) -> int:
        """Columns of compute_logits (the LM head's rows; may exceed the tokenizer's vocabulary)."""
        ...

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[LayerKVCache],
        meta: StepMetadata,
        state: StepState | None = None,
    ) -> torch.Tensor:
        """The hidden states of a flat batch, writing its K/V into `kv_caches` (one per attention layer) at each
        layer's meta.slot_mapping, and, with state layers, carrying each sequence's state in `state`."""
        ...

    @property
    def has_state(self) -> bool:
        """Whether some layers carry a per-sequence state instead of KV (kv/state.py)."""
        ...

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, hidden] -> [N, num_logits] float32 (into `out` when it fits)."""
        ...

    def parameters(self) -> Iterator[torch.nn.Parameter]: ...

    def buffers(self) -> Iterator[torch.Tensor]: ...
