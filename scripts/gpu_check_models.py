"""The architectures scripts/gpu_check.py checks, and random-weight HF checkpoints of them built on the spot.

The GPU machine has no internet and at most 64 MiB can be carried there, so no real checkpoint can be used: the
configs of Gemma 3 270M, Qwen2-0.5B and Llama-3.1-8B are written here (the values of their config.json files) and
transformers builds random-weight models from them on the device. Shapes, not trained weights, decide speed; and
correctness is kvserve against transformers' own modeling code on the very same weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# What --tiny keeps of every architecture: its structure (GQA/MQA, biases, tied head, sliding windows, rope
# scaling), at sizes a CPU runs in milliseconds.
_TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


@dataclass(frozen=True, slots=True)
class Arch:
    """One architecture: transformers' config and model classes, the real model's config values, and what
    --tiny overrides. `gpu_phase_s` caps the seconds its checks may take on the GPU (None: what is left), so
    that a slow small model cannot starve the 8B model whose figures are the targets."""

    name: str
    config_class: str
    model_class: str
    config: dict[str, Any]
    tiny: dict[str, Any]
    gpu_phase_s: float | None = None
    # The order in which it runs its dtypes: the 8B model measures bfloat16 (its speed, the targets) first.
    dtype_order: tuple[str, ...] = ("float32", "bfloat16")

    def hf_config(self, tiny: bool) -> Any:
        import transformers

        values = {**self.config, **(_TINY | self.tiny if tiny else {})}
        return getattr(transformers, self.config_class)(**values)

    def sliding_window(self, tiny: bool) -> int | None:
        """The window of its sliding-window layers (None: it has none): a correctness prompt must outgrow it."""
        values = {**self.config, **(self.tiny if tiny else {})}
        return values.get("sliding_window") if "sliding_attention" in values.get("layer_types", ()) else None


def _gemma3_layer_types(num_layers: int) -> list[str]:
    """Five sliding-window layers, then a global one, repeated (Gemma 3's pattern)."""
    return ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(num_layers)]


ARCHS: dict[str, Arch] = {
    a.name: a
    for a in (
        Arch(
            "qwen2_0_5b",
            "Qwen2Config",
            "Qwen2ForCausalLM",
            dict(
                vocab_size=151936,
                hidden_size=896,
                intermediate_size=4864,
                num_hidden_layers=24,
                num_attention_heads=14,
                num_key_value_heads=2,
                hidden_act="silu",
                max_position_embeddings=32768,
                rms_norm_eps=1e-6,
                rope_theta=1000000.0,
                tie_word_embeddings=True,
                use_sliding_window=False,
                bos_token_id=151643,
                eos_token_id=151643,
                pad_token_id=151643,
            ),
            tiny=dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
            gpu_phase_s=55,
        ),
        Arch(
            "gemma3_270m",
            "Gemma3TextConfig",
            "Gemma3ForCausalLM",
            dict(
                vocab_size=262144,
                hidden_size=640,
                intermediate_size=2048,
                num_hidden_layers=18,
                num_attention_heads=4,
                num_key_value_heads=1,
                head_dim=256,
                hidden_activation="gelu_pytorch_tanh",
                max_position_embeddings=32768,
                rms_norm_eps=1e-6,
                query_pre_attn_scalar=256,
                sliding_window=512,
                layer_types=_gemma3_layer_types(18),
                rope_parameters={
                    "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                },
                tie_word_embeddings=True,
                bos_token_id=2,
                eos_token_id=1,
                pad_token_id=0,
            ),
            tiny=dict(
                num_hidden_layers=3,
                num_attention_heads=4,
                num_key_value_heads=1,
                head_dim=32,
                sliding_window=8,
                query_pre_attn_scalar=32,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            ),
            gpu_phase_s=55,
        ),
        Arch(
            "llama31_8b",
            "LlamaConfig",
            "LlamaForCausalLM",
            dict(
                vocab_size=128256,
                hidden_size=4096,
                intermediate_size=14336,
                num_hidden_layers=32,
                num_attention_heads=32,
                num_key_value_heads=8,
                hidden_act="silu",
                max_position_embeddings=131072,
                rms_norm_eps=1e-5,
                rope_theta=500000.0,
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192,
                },
                tie_word_embeddings=False,
                bos_token_id=128000,
                eos_token_id=128001,
                pad_token_id=128001,
            ),
            tiny=dict(
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            ),
            dtype_order=("bfloat16", "float32"),
        ),
    )
}


@dataclass(slots=True)
class Checkpoint:
    """A saved random-weight checkpoint and the two references built from its weights: `reference` in float32
    (the truth every comparison is against) and `hf_bf16` (HF at the checkpoint's dtype: its own rounding
    error is the yardstick for kvserve's bfloat16 one, and it is HF's side of the speed comparison)."""

    path: Path
    reference: torch.nn.Module
    hf_bf16: torch.nn.Module
    vocab_size: int
    pad_token_id: int
    num_params: int
    checkpoint_bytes: int


def build_checkpoint(arch: Arch, tiny: bool, device: torch.device, directory: Path, seed: int = 0) -> Checkpoint:
    """Build the model on `device` with transformers' own initialisation, perturb its norms and biases (so that
    a wrong (1 + w) or a dropped bias shows), round its weights to bfloat16 (the checkpoint's dtype, so the
    float32 reference holds exactly the weights kvserve loads) and save it with a tokenizer kvserve can load."""
    import transformers

    config = arch.hf_config(tiny)
    torch.manual_seed(seed)
    with torch.device(device):
        reference: Any = getattr(transformers, arch.model_class)(config).float().eval()
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
            p.copy_(p.to(torch.bfloat16))  # in place: the 8B model's float32 copy (32 GB) is never doubled
    hf_bf16 = _bf16_copy(reference)
    hf_bf16.save_pretrained(directory)
    _write_tokenizer(directory, config.vocab_size, config.bos_token_id, config.eos_token_id, config.pad_token_id)
    _pin_generation(reference, config.pad_token_id, config.eos_token_id)
    _pin_generation(hf_bf16, config.pad_token_id, config.eos_token_id)
    size = sum(f.stat().st_size for f in directory.iterdir() if f.is_file())
    return Checkpoint(
        directory,
        reference,
        hf_bf16,
        config.vocab_size,
        config.pad_token_id,
        sum(p.numel() for p in reference.parameters()),
        size,
    )


def _bf16_copy(model: torch.nn.Module) -> Any:
    import copy

    return copy.deepcopy(model).to(torch.bfloat16).eval()


def _pin_generation(model: Any, pad: int, eos: int) -> None:
    """Plain greedy decoding for HF's generate (a random model's config would otherwise bring sampling defaults
    and warnings)."""
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(do_sample=False, pad_token_id=pad, eos_token_id=eos, bos_token_id=None)


def _write_tokenizer(directory: Path, vocab_size: int, bos: int, eos: int, pad: int) -> None:
    """A word-level tokenizer with one token per id ("t17" is id 17), so that every id the random model emits
    detokenizes; prompts are token ids, so its words never matter, only that kvserve's tokenizer path runs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    names = {i: f"t{i}" for i in range(vocab_size)}
    raw = Tokenizer(models.WordLevel({name: i for i, name in names.items()}, unk_token=names[pad]))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    raw.add_special_tokens(sorted({names[bos], names[eos], names[pad]}))
    raw.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": names[bos],
        "eos_token": names[eos],
        "pad_token": names[pad],
        "unk_token": names[pad],
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
