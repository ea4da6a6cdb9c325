"""Tiny random HF checkpoints (built with transformers' own classes) and a paged-cache driver for them."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tiny_tokenizer import write_char_tokenizer

from kvserve.attention.metadata import AttentionMetadata
from kvserve.kv.cache import LayerKVCache
from kvserve.kv.state_cache import StateMetadata, StepState, allocate_state_cache
from kvserve.model.decoder import DecoderModel

if TYPE_CHECKING:
    from kvserve.engine.engine import LLMEngine

_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# name -> (transformers config class name, model class name, config kwargs)
TINY_VARIANTS: dict[str, tuple[str, str, dict]] = {
    "llama_gqa": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rope_theta=500.0),
    ),
    "llama_mqa_bias_llama3rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            attention_bias=True,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
            rope_theta=500.0,
        ),
    ),
    "qwen2_gqa": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rope_theta=1000.0),
    ),
    "qwen3_gqa_tied": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            tie_word_embeddings=True,
            rope_theta=1000.0,
        ),
    ),
    "gemma3_mqa_sliding": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=24,
            final_logit_softcapping=30.0,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
        ),
    ),
    # Qwen2's own sliding windows (use_sliding_window, max_window_layers: layers from index 2 on are windowed), as HF
    # transformers reads them: two KV cache groups of two layers (kv/groups.py).
    "qwen2_sliding": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_theta=1000.0,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=2,
        ),
    ),
    "gemma3_gqa_linear_rope": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=5,
            layer_types=["full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
        ),
    ),
    # LFM2: short-convolution layers (a per-sequence state, kv/state.py) beside GQA attention with q/k norms.
    "lfm2_hybrid": (
        "Lfm2Config",
        "Lfm2ForCausalLM",
        dict(
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            layer_types=["conv", "full_attention", "conv", "conv"],
            block_multiple_of=32,
            conv_L_cache=3,
            rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
        ),
    ),
    # Qwen3.5: Gated DeltaNet layers (a conv state and a matrix state per value head) beside gated attention with
    # partial rope; value heads twice the key heads, as in the published models.
    "qwen3_5_hybrid": (
        "Qwen3_5TextConfig",
        "Qwen3_5ForCausalLM",
        dict(
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.25},
        ),
    ),
}


# Variants with state layers (kv/state.py): tested apart (tests/models/test_state_models.py, test_native_layer.py's
# hybrid test), since the paged test driver keeps no states.
STATE_VARIANTS = frozenset({"lfm2_hybrid", "qwen3_5_hybrid"})


def build_tiny_hf_model(variant: str, **overrides: object) -> torch.nn.Module:
    """A seeded random transformers model; norms and biases perturbed so they matter."""
    import transformers

    config_cls, model_cls, kwargs = TINY_VARIANTS[variant]
    config = getattr(transformers, config_cls)(**{**_COMMON, **kwargs, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
    return model


def save_tiny_checkpoints(
    make_dir: Callable[[str], Path], variants: tuple[str, ...] = ("llama_gqa", "gemma3_mqa_sliding")
) -> dict[str, Path]:
    """Each variant saved with a character tokenizer into make_dir(variant) (a tmp_path_factory's mktemp):
    variant -> checkpoint directory."""
    out = {}
    for variant in variants:
        path = make_dir(variant)
        build_tiny_hf_model(variant).save_pretrained(path)
        write_char_tokenizer(path)
        out[variant] = path
    return out


def hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


class PagedDriver:
    """Runs a DecoderModel step by step over a shuffled paged cache, like the engine's runner would."""

    def __init__(
        self,
        model: DecoderModel,
        seqs: list[list[int]],
        block_size: int = 4,
        seed: int = 0,
        kv_dtype: torch.dtype = torch.float32,
    ) -> None:
        c = model.config
        self.model, self.seqs, self.block_size = model, seqs, block_size
        need = [-(-len(s) // block_size) for s in seqs]
        ids = list(range(1, sum(need) + 7))  # block 0 is never handed out (it is the table padding)
        random.Random(seed).shuffle(ids)
        self.tables, at = [], 0
        for n in need:
            self.tables.append(ids[at : at + n])
            at += n
        shape = (len(ids) + 1, block_size, c.num_kv_heads, c.head_dim)
        nan = float("nan")
        self.kv = [
            LayerKVCache(torch.full(shape, nan, dtype=kv_dtype), torch.full(shape, nan, dtype=kv_dtype))
            for _ in range(c.num_kv_layers)
        ]
        # A hybrid model's state layers: one slot a sequence, in reverse order (slot numbers are not sequence numbers)
        spec = c.state_spec
        self.state = (
            None if spec is None else allocate_state_cache(spec, len(seqs) + 1, torch.float32, torch.device("cpu"))
        )
        self.done = [0] * len(seqs)

    def step(self, plan: dict[int, int]) -> dict[int, torch.Tensor]:
        """plan: seq index -> number of new tokens. Returns seq -> logits [n, vocab] of those tokens."""
        order = list(plan)
        ids, pos = [], []
        for i in order:
            start, n = self.done[i], plan[i]
            ids += self.seqs[i][start : start + n]
            pos += list(range(start, start + n))
        seq_lens = [self.done[i] + plan[i] for i in order]
        meta = AttentionMetadata.build(
            [self.tables[i] for i in order], seq_lens, [plan[i] for i in order], self.block_size, torch.device("cpu")
        )
        state = None
        if self.state is not None:
            slots = [len(self.seqs) - i for i in order]
            state_meta = StateMetadata.build(
                slots, [plan[i] for i in order], [self.done[i] for i in order], meta.seq_lens.device
            )
            state = StepState(self.state, state_meta)
        with torch.no_grad():
            hidden = self.model(torch.tensor(ids), torch.tensor(pos), self.kv, meta, state)
            logits = self.model.compute_logits(hidden)
        out, row = {}, 0
        for i in order:
            out[i] = logits[row : row + plan[i]]
            row += plan[i]
            self.done[i] += plan[i]
        return out


def tiny_engine(path: Path, **overrides: Any) -> LLMEngine:
    """An engine on a tiny checkpoint with the tests' usual pool (256 blocks of 4 tokens); `overrides` go to
    EngineConfig. The one helper the engine tests share (it was copied into five files)."""
    from kvserve.config import EngineConfig
    from kvserve.engine.engine import LLMEngine

    kw: dict[str, Any] = {"num_gpu_blocks_override": 256, "block_size": 4}
    kw.update(overrides)
    return LLMEngine.from_config(EngineConfig.parse(model=str(path), **kw))
