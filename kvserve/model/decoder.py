"""One decoder-only transformer for the llama / qwen2 / qwen3 / gemma3 / lfm2 / qwen3_5 families (per-family switches).

Parameter names follow HF's (without the leading "model."), except the fused `qkv_proj` and `gate_up_proj`;
`load_weights` maps canonical checkpoint names onto them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from kvserve.attention.metadata import AttentionMetadata, StepMetadata, per_layer
from kvserve.attention.registry import get_attention_backend
from kvserve.kernels.ops import TORCH_KERNELS, Kernels, NativeKernels
from kvserve.kv.cache import LayerKVCache
from kvserve.kv.state_cache import LayerStateCache, StateMetadata, StepState
from kvserve.model.config import LINEAR_ATTENTION, SHORT_CONV, ModelConfig
from kvserve.model.gated_deltanet import GatedDeltaNet
from kvserve.model.gguf_layers import GGUFLinear
from kvserve.model.layers import GatedMLP, PagedAttention, RMSNorm, RotaryEmbedding
from kvserve.model.native_layer import NativeLayerStack, NativeLayerUnsupported
from kvserve.model.quantization import Q8Linear, TiedEmbedding
from kvserve.model.short_conv import ShortConv

log = logging.getLogger(__name__)


class DecoderLayer(nn.Module):
    """Pre-norm block; with `sandwich` (gemma3) the attention and MLP outputs are normalized too.

    Its token mixer is attention over the paged KV cache (`self_attn`) or, in a hybrid model's state layer, a mixer
    carrying a per-sequence state: LFM2's short convolution (`conv`) or Qwen3.5's Gated DeltaNet (`linear_attn`); one
    of them, named as HF names it.

    Norm names are HF's: for llama/qwen `post_attention_layernorm` is the norm *before* the MLP; for
    gemma3 it normalizes the attention output and `pre_feedforward_layernorm` precedes the MLP.
    """

    def __init__(
        self,
        config: ModelConfig,
        attention: PagedAttention | None,
        conv: ShortConv | None = None,
        linear_attn: GatedDeltaNet | None = None,
    ) -> None:
        super().__init__()
        if sum(m is not None for m in (attention, conv, linear_attn)) != 1:
            raise ValueError(
                "a decoder layer mixes tokens with one of attention, a short convolution, linear attention"
            )
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.sandwich = config.sandwich_norms
        if attention is not None:
            self.self_attn = attention
        if conv is not None:
            self.conv = conv
        if linear_attn is not None:
            self.linear_attn = linear_attn
        self.has_state = attention is None
        self.state_mixer = "conv" if conv is not None else "linear_attn"  # the attribute of a state layer's mixer
        self.mlp = GatedMLP(hidden, config.intermediate_size, config.hidden_act)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
            self.post_feedforward_layernorm = RMSNorm(hidden, eps)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: LayerKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        return self._residual_and_mlp(h, self.self_attn(self.input_layernorm(h), cos, sin, kv_cache, meta))

    def forward_state(self, h: torch.Tensor, cache: LayerStateCache, meta: StateMetadata) -> torch.Tensor:
        """A state layer's forward: its state mixer in place of attention, the rest the same."""
        mixer = getattr(self, self.state_mixer)
        return self._residual_and_mlp(h, mixer(self.input_layernorm(h), cache, meta))

    def _residual_and_mlp(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.sandwich:
            h = h + self.post_attention_layernorm(x)
            return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        h = h + x
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderModel(nn.Module):
    """Token ids + positions of one flat batch -> final hidden states; the KV cache is paged and external."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        attention_backend: str = "cpu",
        kernels: Kernels = TORCH_KERNELS,
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        # Per layer (k_scale, v_scale): static fp8 KV scales shipped by the checkpoint, if it has them.
        self.static_kv_scales: list[tuple[float, float]] | None = None
        self.attention_backend = attention_backend
        # How the layers run: one native call each (NativeLayerStack) or the torch modules (None). Chosen once,
        # by choose_layer_path, after the loader has swapped in the quantized layers; use_kernels resets it.
        self.native_layers: NativeLayerStack | None = None
        self.layer_path_chosen = False
        backend = get_attention_backend(attention_backend)
        c = config
        # Parameters are created on the meta device and materialized uninitialized: the loader fills them.
        with torch.device("meta"):
            self.embed_tokens = TiedEmbedding(c.vocab_size, c.hidden_size, dtype=dtype)
            self.layers = nn.ModuleList()
            for i in range(c.num_layers):
                if c.layer_kinds[i] == SHORT_CONV:
                    conv = ShortConv(c.hidden_size, c.conv_kernel, c.conv_bias)
                    self.layers.append(DecoderLayer(c, None, conv).to(dtype=dtype))
                    continue
                if c.layer_kinds[i] == LINEAR_ATTENTION:
                    linear = GatedDeltaNet(
                        c.hidden_size,
                        c.linear_key_heads,
                        c.linear_value_heads,
                        c.linear_key_dim,
                        c.linear_value_dim,
                        c.conv_kernel,
                        c.rms_norm_eps,
                    )
                    self.layers.append(DecoderLayer(c, None, linear_attn=linear).to(dtype=dtype))
                    continue
                attn = PagedAttention(
                    c.hidden_size,
                    c.num_heads,
                    c.num_kv_heads,
                    c.head_dim,
                    qkv_bias=c.attention_bias,
                    out_bias=c.attention_out_bias,
                    qk_norm_eps=c.rms_norm_eps if c.qk_norm else None,
                    scale=c.attention_scale,
                    sliding_window=c.sliding_windows[i],
                    backend=backend,
                    output_gate=c.attention_output_gate,
                    rotary_dim=c.rotary_dim,
                )
                self.layers.append(DecoderLayer(c, attn).to(dtype=dtype))
            self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.lm_head = (
                None if c.tie_word_embeddings else nn.Linear(c.hidden_size, c.vocab_size, bias=False, dtype=dtype)
            )
        self._keep_norms_float32()
        _materialize(self, torch.device(device))
        # One rope table per distinct (theta, scaling); layers point at theirs by index.
        keys: list[tuple[float, str]] = []
        self.rope_index: list[int] = []
        ropes = []
        for theta, scaling in zip(c.rope_thetas, c.rope_scalings):
            key = (theta, repr(sorted((scaling or {}).items())))
            if key not in keys:
                keys.append(key)
                ropes.append(RotaryEmbedding(c.rotary_dim, theta, scaling))
            self.rope_index.append(keys.index(key))
        self.ropes = nn.ModuleList(ropes).to(device)
        self.use_kernels(kernels)

    def use_kernels(self, kernels: Kernels) -> None:
        """Every module with its own kernels (norms, quantized layers) uses these; the layer path (native or
        torch modules) is chosen again on the next forward."""
        for module in self.modules():
            if hasattr(module, "kernels"):
                # torch types every unknown nn.Module attribute as Tensor | Module; this one holds Kernels
                module.kernels = kernels  # type: ignore[assignment]
        self.kernels = kernels
        self.native_layers, self.layer_path_chosen = None, False

    def choose_layer_path(self) -> NativeLayerStack | None:
        """The native layer path when decoder_layer.cpp covers this model's weights, dtype and backend, else
        None (the torch modules); decided on the first call (the first forward, when the loader has not asked
        earlier) and logged. The weights must be in place: the stack points into them."""
        if not self.layer_path_chosen:
            self.layer_path_chosen = True
            try:
                self.native_layers = NativeLayerStack.build(
                    self.layers, self.kernels, self.dtype, self.attention_backend
                )
                log.info("decoder layers: one native call per layer (kernels/decoder_layer.cpp)")
            except NativeLayerUnsupported as e:
                log.info("decoder layers: the torch modules (%s)", e)
        return self.native_layers

    def use_torch_layers(self) -> None:
        """Run the torch modules from now on, whatever choose_layer_path would pick: the reference, for tests
        and A/B measurements (use_kernels makes the choice again)."""
        self.native_layers, self.layer_path_chosen = None, True

    def _keep_norms_float32(self) -> None:
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.float()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[LayerKVCache],
        meta: StepMetadata,
        state: StepState | None = None,
    ) -> torch.Tensor:
        """`kv_caches` and `meta`: one per attention layer, in order (a hybrid model's state layers keep no KV);
        `state`: the state layers' caches and the step's state metadata, for a model that has state layers."""
        metas = per_layer(meta, len(kv_caches))
        h = self.embed_tokens(input_ids)
        multiplier = self.config.embedding_multiplier
        if multiplier is not None:
            h = h * torch.tensor(multiplier, dtype=h.dtype)
        # nn.ModuleList yields untyped nn.Module items (torch's stubs): these are RotaryEmbedding
        tables = [rope.cos_sin(positions, h.dtype) for rope in self.ropes]  # type: ignore[operator]
        native = self.choose_layer_path()
        if native is not None and native.takes(kv_caches, h.shape[0]):
            return self.norm(native.run(h, tables, self.rope_index, kv_caches, metas, state))
        if not self.has_state:
            for layer, rope_i, kv_cache, layer_meta in zip(self.layers, self.rope_index, kv_caches, metas, strict=True):
                cos, sin = tables[rope_i]
                h = layer(h, cos, sin, kv_cache, layer_meta)
            return self.norm(h)
        if state is None:
            raise ValueError(f"the {self.config.family} model has state layers: its forward needs their state")
        kv_layers, state_layers = iter(zip(kv_caches, metas, strict=True)), iter(state.caches)
        for layer, rope_i in zip(self.layers, self.rope_index, strict=True):
            if layer.has_state:
                # nn.ModuleList yields untyped nn.Module items (torch's stubs): these are DecoderLayer
                h = layer.forward_state(h, next(state_layers), state.meta)  # type: ignore[operator]
            else:
                kv_cache, layer_meta = next(kv_layers)
                cos, sin = tables[rope_i]
                h = layer(h, cos, sin, kv_cache, layer_meta)
        return self.norm(h)

    @property
    def has_state(self) -> bool:
        """Whether some layers carry a per-sequence state (a hybrid model: LFM2's short convolutions)."""
        return bool(self.config.state_layers)

    @property
    def kernel_isa(self) -> str:
        kernels = self.kernels
        return kernels.isa if isinstance(kernels, NativeKernels) else kernels.name

    @property
    def native_kernels(self) -> NativeKernels | None:
        kernels = self.kernels
        return kernels if isinstance(kernels, NativeKernels) else None

    @property
    def num_logits(self) -> int:
        """Columns of compute_logits: the LM head's rows (the embedding's, when tied)."""
        return self.embed_tokens.num_embeddings if self.lm_head is None else self.lm_head.out_features

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32, with final logit softcapping when the config has it.

        `out`: an [N, vocab] float32 buffer the logits are written into (and returned). At batch 32-64 the
        logits are 33-67 MB: a fresh tensor that size is a fresh mmap, page-faulted and zeroed by the kernel on
        every step (+13% on the LM head at batch 64); the runner reuses one buffer instead."""
        if out is not None and (hidden.dtype != torch.float32 or out.shape != (hidden.shape[0], self.num_logits)):
            out = None  # the buffer is float32 [N, vocab]; half-precision heads compute in their own dtype
        if self.lm_head is None:
            logits = self.embed_tokens.attend(hidden, out=out)  # tied: the embedding
        elif isinstance(self.lm_head, (Q8Linear, GGUFLinear)):
            logits = self.lm_head(hidden, out=out)
        else:
            logits = torch.matmul(hidden, self.lm_head.weight.T, out=out)
            if self.lm_head.bias is not None:
                logits.add_(self.lm_head.bias)
        logits = logits.float()
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = logits.div_(cap).tanh_().mul_(cap) if logits is out else torch.tanh(logits / cap) * cap
        return logits

    # -- weights -----------------------------------------------------------------------------------
    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy canonical tensors (HF names without "model.", norms already multiplicative) into the model.

        Raises ValueError naming unknown, misshaped or missing tensors.
        """
        params = dict(self.named_parameters())
        c = self.config
        q_rows = c.num_heads * c.head_dim * (2 if c.attention_output_gate else 1)  # Qwen3.5: each head's gate too
        kv_rows, ff = c.num_kv_heads * c.head_dim, c.intermediate_size
        fused = {  # checkpoint sub-name -> (fused param sub-name, row offset, rows)
            "self_attn.q_proj": ("self_attn.qkv_proj", 0, q_rows),
            "self_attn.k_proj": ("self_attn.qkv_proj", q_rows, kv_rows),
            "self_attn.v_proj": ("self_attn.qkv_proj", q_rows + kv_rows, kv_rows),
            "mlp.gate_proj": ("mlp.gate_up_proj", 0, ff),
            "mlp.up_proj": ("mlp.gate_up_proj", ff, ff),
        }
        linear = next((m for m in self.modules() if isinstance(m, GatedDeltaNet)), None)
        if linear is not None:
            for part, (into, first, count) in linear.fused_parts.items():
                fused[f"linear_attn.{part}"] = (f"linear_attn.{into}", first, count)
        needed = {(name, 0) for name in params}
        for name in params:
            if ".qkv_proj." in name:
                needed |= {(name, q_rows), (name, q_rows + kv_rows)}
            elif ".gate_up_proj." in name:
                needed.add((name, ff))
            elif ".linear_attn.in_proj_" in name and linear is not None:
                into = name.split(".linear_attn.")[1].split(".")[0]
                needed |= {(name, first) for fused_into, first, _ in linear.fused_parts.values() if fused_into == into}
        done: set[tuple[str, int]] = set()
        for name, tensor in tensors:
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: some checkpoints store the shared matrix twice
            if name == "rope_freqs.weight":  # llama.cpp's llama3 rope: per-frequency divisors
                for rope in self.ropes:
                    rope.inv_freq.div_(tensor.to(rope.inv_freq))  # type: ignore[operator, arg-type]  # ModuleList items
                continue
            target, offset, rows = name, 0, None
            if name.startswith("layers."):
                _, idx, rest = name.split(".", 2)
                sub, _, suffix = rest.rpartition(".")
                if sub in fused:
                    fsub, offset, rows = fused[sub]
                    target = f"layers.{idx}.{fsub}.{suffix}"
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the {c.family} model")
            dest = param.data if rows is None else param.data.narrow(0, offset, rows)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            done.add((target, offset))
        missing = sorted(f"{n}[{o}:]" if o else n for n, o in needed - done)
        if missing:
            raise ValueError(
                f"checkpoint is missing {len(missing)} tensor(s): {', '.join(missing[:8])}"
                + (" ..." if len(missing) > 8 else "")
            )


def _materialize(module: nn.Module, device: torch.device) -> None:
    """Uninitialized storage on `device` for every meta parameter and buffer (the loader fills them).

    Not `nn.Module.to_empty`: its empty_like on meta tensors runs torch's Python meta registrations, whose
    import (torch._decomp, torch.fx) costs ~0.4 s of every start."""
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None:
                sub._parameters[name] = nn.Parameter(
                    torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=False
                )
        for name, b in list(sub._buffers.items()):
            if b is not None:
                sub._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)
