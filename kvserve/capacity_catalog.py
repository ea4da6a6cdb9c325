"""A small catalog of popular open models, so `kvserve estimate --model llama-3.1-8b` works with no files.

Each entry is an excerpt of the model's published HF config.json (for multimodal Gemma 3: its text_config),
read by the same code as a config.json on disk, plus the parameter count from the model card and the URL
of the source. Only the fields that size the KV cache and the weights are kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

HF = "https://huggingface.co"


@dataclass(frozen=True, slots=True)
class CatalogEntry:
    name: str
    config: dict[str, Any]
    num_parameters: int  # as published on the model card (MoE: total, not active)
    source: str  # the config.json the facts come from
    aliases: tuple[str, ...] = field(default_factory=tuple)

    @property
    def repo_id(self) -> str:
        """The Hugging Face repository the facts come from (its weights are there too), e.g. LiquidAI/LFM2-1.2B."""
        return self.source.removeprefix(f"{HF}/").split("/blob/", 1)[0]

    def download_hint(self, directory: str) -> str:
        """How a user gets the weights `serve` needs: kvserve itself never downloads from a hub."""
        return f"hf download {self.repo_id} --local-dir {directory}"


def _cfg(
    model_type: str,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    vocab: int,
    context: int,
    dtype: str = "bfloat16",
    **extra: Any,
) -> dict[str, Any]:
    """An HF config.json excerpt under its real key names."""
    return {
        "model_type": model_type,
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": intermediate,
        "vocab_size": vocab,
        "max_position_embeddings": context,
        "torch_dtype": dtype,
        **extra,
    }


def _entry(repo: str, config: dict[str, Any], params: float, *aliases: str) -> CatalogEntry:
    name = repo.split("/", 1)[1].lower()
    return CatalogEntry(name, config, int(params), f"{HF}/{repo}/blob/main/config.json", (repo.lower(), *aliases))


_GEMMA3_WINDOWED: dict[str, Any] = {"sliding_window_pattern": 6, "rope_theta": 1_000_000.0}


def _lfm2(hidden: int, heads: int, ff_dim: int) -> dict[str, Any]:
    """An LFM2 config: 16 layers, attention at 6 of them, 3-tap convolutions elsewhere; the MLP width is derived
    from block_ff_dim (block_auto_adjust_ff_dim)."""
    return _cfg(
        "lfm2",
        16,
        hidden,
        heads,
        8,
        ff_dim,
        65536,
        128000,
        full_attn_idxs=[2, 5, 8, 10, 12, 14],
        conv_L_cache=3,
        block_ff_dim=ff_dim,
        block_multiple_of=256,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=True,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
    )


def _qwen35(
    layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int, linear_value_heads: int, tie: bool = True
) -> dict[str, Any]:
    """A Qwen3.5 text_config: three Gated DeltaNet layers to one gated attention layer (head_dim 256), 16 key heads
    of 128 in the linear layers. The published counts include the vision tower."""
    return _cfg(
        "qwen3_5_text",
        layers,
        hidden,
        heads,
        kv_heads,
        intermediate,
        248320,
        262144,
        head_dim=256,
        full_attention_interval=4,
        linear_num_key_heads=16,
        linear_num_value_heads=linear_value_heads,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        tie_word_embeddings=tie,
    )


CATALOG: tuple[CatalogEntry, ...] = (
    _entry("meta-llama/Meta-Llama-3-8B", _cfg("llama", 32, 4096, 32, 8, 14336, 128256, 8192), 8.03e9, "llama-3-8b"),
    _entry("meta-llama/Llama-3.1-8B", _cfg("llama", 32, 4096, 32, 8, 14336, 128256, 131072), 8.03e9),
    _entry("meta-llama/Llama-3.1-70B", _cfg("llama", 80, 8192, 64, 8, 28672, 128256, 131072), 70.6e9),
    _entry(
        "meta-llama/Llama-3.2-1B",
        _cfg("llama", 16, 2048, 32, 8, 8192, 128256, 131072, head_dim=64, tie_word_embeddings=True),
        1.24e9,
    ),
    _entry(
        "meta-llama/Llama-3.2-3B",
        _cfg("llama", 28, 3072, 24, 8, 8192, 128256, 131072, head_dim=128, tie_word_embeddings=True),
        3.21e9,
    ),
    _entry("Qwen/Qwen2-7B", _cfg("qwen2", 28, 3584, 28, 4, 18944, 152064, 131072), 7.62e9),
    _entry("Qwen/Qwen2.5-7B-Instruct", _cfg("qwen2", 28, 3584, 28, 4, 18944, 152064, 32768), 7.62e9, "qwen2.5-7b"),
    _entry("Qwen/Qwen2.5-72B-Instruct", _cfg("qwen2", 80, 8192, 64, 8, 29568, 152064, 32768), 72.7e9, "qwen2.5-72b"),
    _entry(
        "Qwen/Qwen3-0.6B",
        _cfg("qwen3", 28, 1024, 16, 8, 3072, 151936, 40960, head_dim=128, tie_word_embeddings=True),
        0.6e9,
    ),
    _entry(
        "Qwen/Qwen3-1.7B",
        _cfg("qwen3", 28, 2048, 16, 8, 6144, 151936, 40960, head_dim=128, tie_word_embeddings=True),
        1.7e9,
    ),
    _entry(
        "Qwen/Qwen3-4B",
        _cfg("qwen3", 36, 2560, 32, 8, 9728, 151936, 40960, head_dim=128, tie_word_embeddings=True),
        4.0e9,
    ),
    _entry("Qwen/Qwen3-8B", _cfg("qwen3", 36, 4096, 32, 8, 12288, 151936, 40960, head_dim=128), 8.2e9),
    _entry("Qwen/Qwen3-14B", _cfg("qwen3", 40, 5120, 40, 8, 17408, 151936, 40960, head_dim=128), 14.8e9),
    _entry("Qwen/Qwen3-32B", _cfg("qwen3", 64, 5120, 64, 8, 25600, 151936, 40960, head_dim=128), 32.8e9),
    _entry("Qwen/Qwen3-30B-A3B", _cfg("qwen3_moe", 48, 2048, 32, 4, 6144, 151936, 40960, head_dim=128), 30.5e9),
    _entry("Qwen/Qwen3-235B-A22B", _cfg("qwen3_moe", 94, 4096, 64, 4, 12288, 151936, 40960, head_dim=128), 235e9),
    _entry(
        "mistralai/Mistral-7B-v0.1",
        _cfg("mistral", 32, 4096, 32, 8, 14336, 32000, 32768, sliding_window=4096),
        7.24e9,
        "mistral-7b",
    ),
    _entry(
        "mistralai/Mistral-7B-v0.3", _cfg("mistral", 32, 4096, 32, 8, 14336, 32768, 32768, sliding_window=None), 7.25e9
    ),
    _entry(
        "google/gemma-2-2b",
        _cfg("gemma2", 26, 2304, 8, 4, 9216, 256000, 8192, head_dim=256, sliding_window=4096),
        2.61e9,
    ),
    _entry(
        "google/gemma-2-9b",
        _cfg("gemma2", 42, 3584, 16, 8, 14336, 256000, 8192, head_dim=256, sliding_window=4096),
        9.24e9,
    ),
    _entry(
        "google/gemma-2-27b",
        _cfg("gemma2", 46, 4608, 32, 16, 36864, 256000, 8192, head_dim=128, sliding_window=4096),
        27.2e9,
    ),
    _entry(
        "google/gemma-3-270m",
        _cfg("gemma3_text", 18, 640, 4, 1, 2048, 262144, 32768, head_dim=256, sliding_window=512, **_GEMMA3_WINDOWED),
        268e6,
    ),
    _entry(
        "google/gemma-3-1b-pt",
        _cfg("gemma3_text", 26, 1152, 4, 1, 6912, 262144, 32768, head_dim=256, sliding_window=512, **_GEMMA3_WINDOWED),
        1.0e9,
        "gemma-3-1b",
    ),
    _entry(
        "google/gemma-3-4b-pt",
        _cfg(
            "gemma3_text", 34, 2560, 8, 4, 10240, 262208, 131072, head_dim=256, sliding_window=1024, **_GEMMA3_WINDOWED
        ),
        4.3e9,
        "gemma-3-4b",
    ),
    _entry(
        "google/gemma-3-12b-pt",
        _cfg(
            "gemma3_text", 48, 3840, 16, 8, 15360, 262208, 131072, head_dim=256, sliding_window=1024, **_GEMMA3_WINDOWED
        ),
        12.2e9,
        "gemma-3-12b",
    ),
    _entry(
        "google/gemma-3-27b-pt",
        _cfg(
            "gemma3_text",
            62,
            5376,
            32,
            16,
            21504,
            262208,
            131072,
            head_dim=128,
            sliding_window=1024,
            **_GEMMA3_WINDOWED,
        ),
        27.4e9,
        "gemma-3-27b",
    ),
    # Hybrids (docs/MODELS.md): LFM2's short convolutions and Qwen3.5's Gated DeltaNet layers keep a state per
    # sequence (estimate counts its slots) beside a few attention layers (6 of 16; 1 in 4).
    _entry("LiquidAI/LFM2-350M", _lfm2(1024, 16, 6656), 354.5e6, "lfm2-350m"),
    _entry("LiquidAI/LFM2-700M", _lfm2(1536, 24, 10240), 742.5e6, "lfm2-700m"),
    _entry("LiquidAI/LFM2-1.2B", _lfm2(2048, 32, 12288), 1170.3e6, "lfm2-1.2b"),
    _entry("Qwen/Qwen3.5-0.8B", _qwen35(24, 1024, 8, 2, 3584, 16), 0.8e9, "qwen3.5-0.8b"),
    _entry("Qwen/Qwen3.5-2B", _qwen35(24, 2048, 8, 2, 6144, 16), 2e9, "qwen3.5-2b"),
    _entry("Qwen/Qwen3.5-4B", _qwen35(32, 2560, 16, 4, 9216, 32), 4e9, "qwen3.5-4b"),
    _entry("Qwen/Qwen3.5-9B", _qwen35(32, 4096, 16, 4, 12288, 32, tie=False), 9e9, "qwen3.5-9b"),
    _entry(
        "deepseek-ai/DeepSeek-V2-Lite",
        _cfg(
            "deepseek_v2",
            27,
            2048,
            16,
            16,
            10944,
            102400,
            163840,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
        ),
        15.7e9,
    ),
    _entry(
        "deepseek-ai/DeepSeek-V2",
        _cfg(
            "deepseek_v2",
            60,
            5120,
            128,
            128,
            12288,
            102400,
            163840,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
        ),
        236e9,
    ),
    _entry(
        "deepseek-ai/DeepSeek-V3",
        _cfg(
            "deepseek_v3",
            61,
            7168,
            128,
            128,
            18432,
            129280,
            163840,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
        ),
        671e9,
    ),
)


def find_entry(name: str) -> CatalogEntry | None:
    """Case-insensitive lookup by short name (e.g. llama-3.1-8b), alias, or HF repo id."""
    key = name.strip().lower()
    for entry in CATALOG:
        if key == entry.name or key in entry.aliases:
            return entry
    return None
