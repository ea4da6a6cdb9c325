"""What a forward pass must cost on this model, whatever the implementation: the bytes it must read and
the FLOPs it must do. Divided by the machine's measured ceilings, they give the floor of each figure."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from kvserve.bench.machine import Ceilings

if TYPE_CHECKING:
    import torch

    from kvserve.model.config import ModelConfig


@dataclass(frozen=True, slots=True)
class ModelCost:
    """Per-token costs of one model at one weight dtype."""

    weight_bytes_per_step: int  # every weight a step must read (the tied embedding is the LM head: all of it)
    matmul_params: int  # parameters in matrix products, per token (LM head included, embedding lookup not)
    lm_head_params: int  # of which the LM head: prefill needs it for the last prompt position only
    kv_bytes_per_token: int  # K and V of one token, all layers, in the cache's dtype
    num_layers: int
    num_heads: int
    head_dim: int
    sliding_windows: tuple[int | None, ...]

    def to_json(self) -> dict:
        return asdict(self)

    def attended(self, context: int) -> int:
        """Keys one query at position `context - 1` attends to, summed over layers (windows capped)."""
        return sum(min(context, w) if w else context for w in self.sliding_windows)

    def decode_flops(self, context: int) -> float:
        """FLOPs of one decoded token at `context`: 2 per weight, and 4 per head-dim per key (QK and PV)."""
        return 2.0 * self.matmul_params + 4.0 * self.num_heads * self.head_dim * self.attended(context)

    def decode_bytes(self, batch: int, context: int) -> float:
        """Bytes read by one decode step of `batch` sequences at `context`: weights once, each one's KV."""
        kv_tokens = sum(min(context, w) if w else context for w in self.sliding_windows) / max(self.num_layers, 1)
        return self.weight_bytes_per_step + batch * kv_tokens * self.kv_bytes_per_token

    def prefill_flops(self, prompt_len: int) -> float:
        """FLOPs of a prompt of `prompt_len` tokens: the body for every token, the LM head for the last one
        only (its logits are the only ones sampled), causal attention over the tokens before each."""
        attention = sum(self.attended(p + 1) for p in range(prompt_len))
        body = self.matmul_params - self.lm_head_params
        return 2.0 * (body * prompt_len + self.lm_head_params) + 4.0 * self.num_heads * self.head_dim * attention

    def _compute_s(self, ceilings: Ceilings, flops: float, matmul_flops: float, int8: bool) -> float:
        """With int8 activations the matmuls' share of the FLOPs runs at the int8 rate, the rest (attention) at
        the float32 one. The int8 rate is the better of the library's int8 matmul and its float32 one: on an AVX2
        host without VNNI torch._int_mm runs at a few GOP/s (2 on a Zen 3), far below what integer dot products
        there reach (kvserve's own run faster than its float32 ones), and a floor above the measured time says
        nothing."""
        if not int8:
            return flops / (ceilings.matmul_gflops * 1e9)
        if ceilings.int8_matmul_gops is None:
            raise ValueError("an int8 floor needs ceilings measured with int8=True")
        int8_rate = max(ceilings.int8_matmul_gops, ceilings.matmul_gflops)
        return matmul_flops / (int8_rate * 1e9) + (flops - matmul_flops) / (ceilings.matmul_gflops * 1e9)

    def decode_floor_ms(self, ceilings: Ceilings, batch: int, context: int, int8: bool = False) -> float:
        """A step can be no faster than its bytes over bandwidth, nor its FLOPs over the matmul rate (`int8`:
        the matmuls' at the int8 rate, as --activation-quantization int8 runs them)."""
        memory_s = self.decode_bytes(batch, context) / (ceilings.bandwidth_gbps * 1e9)
        compute_s = batch * self._compute_s(ceilings, self.decode_flops(context), 2.0 * self.matmul_params, int8)
        return 1e3 * max(memory_s, compute_s)

    def prefill_floor_ms(self, ceilings: Ceilings, prompt_len: int, int8: bool = False) -> float:
        body = self.matmul_params - self.lm_head_params
        matmul_flops = 2.0 * (body * prompt_len + self.lm_head_params)
        compute_s = self._compute_s(ceilings, self.prefill_flops(prompt_len), matmul_flops, int8)
        memory_s = self.weight_bytes_per_step / (ceilings.bandwidth_gbps * 1e9)
        return 1e3 * max(memory_s, compute_s)


def model_cost(model: torch.nn.Module, config: ModelConfig, kv_bytes_per_token: int) -> ModelCost:
    """Count from the loaded module itself, so the figure follows the dtype the weights are held in; quantized
    layers hold theirs as buffers (int8 qweight plus float32 scales), counted the same way."""
    seen: set[int] = set()
    total_bytes = 0
    matmul_params = 0
    tensors = [*model.named_parameters(remove_duplicate=True), *model.named_buffers(remove_duplicate=True)]
    embed_names = {"embed_tokens.weight", "embed_tokens.qweight", "embed_tokens.scales"}
    embed_bytes = embed_params = 0
    packed = {
        id(buffer): count
        for module in model.modules()
        for buffer, count in getattr(module, "packed_weight_counts", list)()
    }  # GGUF blocks: weights != numel
    for name, tensor in tensors:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        size = tensor.numel() * tensor.element_size()
        weight = tensor.dim() >= 2 and not name.endswith("scales")  # a matrix of weights, not its scales
        total_bytes += size
        weights = packed.get(id(tensor), tensor.numel() if weight else 0)
        matmul_params += weights
        if name in embed_names:
            embed_bytes += size
            embed_params += weights
    if not config.tie_word_embeddings or "embed_tokens.head_qweight" in dict(tensors):
        # An untied input embedding is only looked up (one row per token), never read whole or multiplied; so is
        # a tied one whose LM head has its own blocks (--lm-head-quantization), counted as the other weights.
        total_bytes -= embed_bytes
        matmul_params -= embed_params
    return ModelCost(
        weight_bytes_per_step=total_bytes,
        matmul_params=matmul_params,
        lm_head_params=config.vocab_size * config.hidden_size,
        kv_bytes_per_token=kv_bytes_per_token,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        head_dim=config.head_dim,
        sliding_windows=tuple(config.sliding_windows),
    )
