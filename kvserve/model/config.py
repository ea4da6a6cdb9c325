"""ModelConfig: the architecture facts the engine needs, read from HF config.json or GGUF metadata.

Pure Python (no torch import) so that capacity tools can use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvserve.json_files import read_json_object
from kvserve.kv.state import StateSpec

if TYPE_CHECKING:
    from kvserve.model.gguf_reader import GGUFFile

# HF model_type -> our family name.
_HF_FAMILIES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "lfm2": "lfm2",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5": "qwen3_5",
}


def runs_hf_model_type(model_type: object) -> bool:
    """Whether kvserve runs checkpoints of this HF model_type (a config it refuses is then an error, not a family to
    size from its attention fields alone)."""
    return isinstance(model_type, str) and model_type in _HF_FAMILIES


# GGUF general.architecture -> our family name.
_GGUF_FAMILIES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3": "gemma3",
    "lfm2": "lfm2",
    "qwen35": "qwen3_5",
}
# What a layer mixes tokens with: attention over the paged KV cache, or a state carried from token to token (LFM2's
# short convolution). A state layer keeps no KV: the KV cache groups are built over the attention layers only.
ATTENTION = "attention"
SHORT_CONV = "short_conv"
LINEAR_ATTENTION = "linear_attention"  # Qwen3.5's Gated DeltaNet: a convolution and a matrix-valued recurrent state
LAYER_KINDS = (ATTENTION, SHORT_CONV, LINEAR_ATTENTION)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
GEMMA3_SLIDING_PATTERN = 6  # HF Gemma3TextConfig default: every 6th layer is global
GEMMA3_LOCAL_ROPE_THETA = 10_000.0
GEMMA3_END_OF_TURN = 106


@dataclass(slots=True)
class ModelConfig:
    family: str  # "llama" | "qwen2" | "qwen3" | "gemma3"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: list[int]
    hidden_act: str = "silu"
    # Per layer: None for full attention, else the window (a query at p sees keys at p - window + 1 .. p).
    sliding_windows: list[int | None] = field(default_factory=list)
    # Per layer rope base (gemma3 uses a different base for local layers).
    rope_thetas: list[float] = field(default_factory=list)
    rope_scaling: dict | None = None
    attention_bias: bool = False
    qk_norm: bool = False
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (gemma); else head_dim
    torch_dtype: str | None = None  # the checkpoint's dtype, e.g. "bfloat16"
    generation_defaults: dict = field(default_factory=dict)  # from generation_config.json
    # Per layer rope scaling (gemma3 scales only its global layers); None entries = plain rope.
    rope_scalings: list[dict | None] = field(default_factory=list)
    attention_out_bias: bool = False  # o_proj bias (llama/qwen3 attention_bias); qwen2 has q/k/v bias only
    final_logit_softcapping: float | None = None
    # Per layer: ATTENTION or a state layer's kind (SHORT_CONV); empty means every layer attends.
    layer_kinds: list[str] = field(default_factory=list)
    conv_kernel: int = 0  # a short convolution's taps (LFM2's conv_L_cache): its state keeps conv_kernel - 1 tokens
    conv_bias: bool = False
    # Qwen3.5's Gated DeltaNet layers: key heads (q, k) and value heads, their sizes; the conv covers q, k and v.
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    attention_output_gate: bool = False  # Qwen3.5: attention's output times sigmoid of a second half of q_proj
    partial_rotary_factor: float = 1.0  # rope turns the first head_dim x this dims of q and k (Qwen3.5: 0.25)

    def __post_init__(self) -> None:
        n = self.num_layers
        if not self.layer_kinds:
            self.layer_kinds = [ATTENTION] * n
        unknown = sorted(set(self.layer_kinds) - set(LAYER_KINDS))
        if unknown:
            raise NotImplementedError(f"layer kind(s) {', '.join(unknown)} not supported ({', '.join(LAYER_KINDS)})")
        if self.state_layers and self.conv_kernel < 2:
            raise ValueError(f"a state layer's convolution needs at least 2 taps, got {self.conv_kernel}")
        if len(set(self.layer_kinds) - {ATTENTION}) > 1:
            raise NotImplementedError("a model mixing short convolutions and linear attention is not supported")
        if n and ATTENTION not in self.layer_kinds:
            raise NotImplementedError(
                f"this {self.family} model has no attention layer (all {n} are {self.layer_kinds[0]} layers), which "
                "kvserve does not support: its prefix cache keeps the attention layers' KV in blocks and a state "
                "layer's snapshots at those blocks' boundaries (docs/MODELS.md); a model of state layers only has "
                "neither"
            )
        if LINEAR_ATTENTION in self.layer_kinds and (
            min(self.linear_key_heads, self.linear_value_heads, self.linear_key_dim, self.linear_value_dim) < 1
            or self.linear_value_heads % self.linear_key_heads
        ):
            raise ValueError("linear attention needs key and value heads (value heads a multiple of key heads)")
        if not self.sliding_windows:
            self.sliding_windows = [None] * n
        if not self.rope_thetas:
            self.rope_thetas = [self.rope_theta] * n
        if not self.rope_scalings:
            self.rope_scalings = [self.rope_scaling] * n
        for name in ("sliding_windows", "rope_thetas", "rope_scalings", "layer_kinds"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"ModelConfig.{name} has {len(getattr(self, name))} entries for {n} layers")
        for scaling in self.rope_scalings:
            if scaling is not None and scaling.get("rope_type", "default") not in SUPPORTED_ROPE_TYPES:
                raise NotImplementedError(
                    f"rope scaling type {scaling.get('rope_type')!r} is not supported (supported: "
                    f"{', '.join(SUPPORTED_ROPE_TYPES)})"
                )

    # -- which layers keep KV ----------------------------------------------------------------------
    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers that attend over the paged KV cache (every layer but a hybrid model's state layers)."""
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind == ATTENTION)

    @property
    def state_layers(self) -> tuple[int, ...]:
        """The layers that carry a per-sequence state instead of KV (LFM2's short convolutions)."""
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind != ATTENTION)

    @property
    def num_kv_layers(self) -> int:
        return len(self.attention_layers)

    @property
    def kv_sliding_windows(self) -> list[int | None]:
        """The sliding windows of the attention layers, in order: what the KV cache groups are built from."""
        return [self.sliding_windows[i] for i in self.attention_layers]

    @property
    def attention_break_even_tokens(self) -> int:
        """The context length at which a prompt token's attention (4 FLOPs a head dim a key, in the layers that attend
        to the whole context) costs as many FLOPs as its matrix products (2 a weight of the layers; every layer counted
        as attention + gated MLP): a prefill chunk's time grows as (this + context). Qwen2.5-Coder-0.5B: 8,320 tokens,
        Gemma 3 270M: 16,320 (3 of its 18 layers). 0 when no layer attends to the whole context (sliding windows and
        state layers only)."""
        full = sum(self.sliding_windows[i] is None for i in self.attention_layers)
        if not full:
            return 0
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = 2 * self.hidden_size * (q + kv) + 3 * self.hidden_size * self.intermediate_size
        return 2 * per_layer * self.num_layers // (4 * full * q)

    @property
    def rotary_dim(self) -> int:
        """The dims of each q and k head that rope turns (the first ones; the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def state_spec(self) -> StateSpec | None:
        """The state one sequence keeps in the state layers (kv/state.py); None when every layer attends. States are
        float32 whatever the KV cache's dtype: a state is carried through every token, so its rounding would add up.
        LFM2-350M: 10 conv layers x 2 tokens x 1024 channels x 4 bytes = 80 KiB a sequence; Qwen3.5-0.8B: 18 Gated
        DeltaNet layers x (3 tokens x 6144 channels + 16 heads x 128 x 128) x 4 bytes = 19.3 MiB."""
        if not self.state_layers:
            return None
        if LINEAR_ATTENTION in self.layer_kinds:
            channels = 2 * self.linear_key_heads * self.linear_key_dim + self.linear_value_heads * self.linear_value_dim
            recurrent = (self.linear_value_heads, self.linear_key_dim, self.linear_value_dim)
            return StateSpec(len(self.state_layers), self.conv_kernel, channels, recurrent)
        return StateSpec(len(self.state_layers), self.conv_kernel, self.hidden_size)

    # -- per-family switches (one decoder, no per-family copies) ---------------------------------
    @property
    def sandwich_norms(self) -> bool:
        """Gemma3 normalizes attention/MLP outputs too (four norms per layer)."""
        return self.family == "gemma3"

    @property
    def embedding_multiplier(self) -> float | None:
        """Gemma scales the embedding by sqrt(hidden) (in the compute dtype)."""
        return math.sqrt(self.hidden_size) if self.family == "gemma3" else None

    @property
    def norm_adds_one(self) -> bool:
        """HF Gemma (and Qwen3.5) RMSNorm multiplies by (1 + weight); the loader folds the 1 into the stored weight
        (not into Qwen3.5's gated norm inside linear attention, which multiplies by its weight)."""
        return self.family in ("gemma3", "qwen3_5")

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    # -- constructors ----------------------------------------------------------------------------
    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelConfig:
        """Read config.json (+ generation_config.json when present) of an HF checkpoint directory."""
        path = Path(path)
        cfg = read_json_object(path / "config.json")
        gen_path = path / "generation_config.json"
        gen = read_json_object(gen_path) if gen_path.is_file() else {}
        try:
            return cls.from_hf_dict(cfg, gen)
        except (KeyError, TypeError) as e:
            raise ValueError(f"{path / 'config.json'}: missing or malformed field {e}") from e

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelConfig:
        """Map an HF config dict (transformers 4.x or 5.x layout) onto ModelConfig."""
        if "text_config" in cfg and cfg.get("model_type") == "gemma3":
            raise ValueError(
                "multimodal Gemma3ForConditionalGeneration checkpoints are not supported; "
                "use a text-only (gemma3_text) checkpoint"
            )
        model_type = cfg.get("model_type")
        family = _HF_FAMILIES.get(model_type) if isinstance(model_type, str) else None
        if family is None:
            raise ValueError(f"unsupported model_type {model_type!r} (supported: {', '.join(_HF_FAMILIES)})")
        if family == "lfm2":
            return cls._from_hf_lfm2(cfg, generation_config or {})
        if family == "qwen3_5":
            return cls._from_hf_qwen3_5(cfg, generation_config or {})
        if cfg.get("mlp_bias"):
            raise NotImplementedError("mlp_bias=True is not supported")
        if cfg.get("attn_logit_softcapping") is not None:
            raise NotImplementedError("attention logit softcapping is not supported")
        if cfg.get("use_bidirectional_attention"):
            raise NotImplementedError("bidirectional attention is not supported")
        n_layers = _positive(cfg, "num_hidden_layers")
        hidden = _positive(cfg, "hidden_size")
        n_heads = _positive(cfg, "num_attention_heads")
        head_dim = int(cfg.get("head_dim") or hidden // n_heads)
        layer_types = _hf_layer_types(cfg, family, n_layers)
        if model_type == "mistral" and cfg.get("sliding_window") and "layer_types" not in cfg:
            layer_types = ["sliding_attention"] * n_layers  # Mistral's window applies to every layer
        window = cfg.get("sliding_window")
        windows = [int(window) if t == "sliding_attention" and window else None for t in layer_types]
        thetas, scalings = _hf_rope(cfg, family, layer_types)
        gen = dict(generation_config or {})
        bos, eos_ids = _hf_special_ids(cfg, gen)
        attention_bias = bool(cfg.get("attention_bias", False))
        global_scaling = next((s for s, w in zip(scalings, windows) if w is None), scalings[0])
        return cls(
            family=family,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            num_layers=n_layers,
            num_heads=n_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=head_dim,
            intermediate_size=int(cfg["intermediate_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=max(thetas),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", family == "gemma3")),
            bos_token_id=bos,
            eos_token_ids=eos_ids,
            hidden_act=str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"),
            sliding_windows=windows,
            rope_thetas=thetas,
            rope_scaling=global_scaling,
            rope_scalings=scalings,
            attention_bias=True if family == "qwen2" else attention_bias,
            attention_out_bias=attention_bias and family in ("llama", "qwen3", "gemma3"),
            qk_norm=family in ("qwen3", "gemma3"),
            query_pre_attn_scalar=(float(cfg.get("query_pre_attn_scalar", 256)) if family == "gemma3" else None),
            torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            generation_defaults=gen,
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
        )

    @classmethod
    def _from_hf_lfm2(cls, cfg: dict[str, Any], gen: dict[str, Any]) -> ModelConfig:
        """LFM2 / LFM2.5 (HF `lfm2`): short-convolution layers ("conv") beside GQA attention layers with q/k norms;
        a SwiGLU MLP whose width HF derives from intermediate_size (block_auto_adjust_ff_dim); one final norm
        (HF's embedding_norm)."""
        n_layers = _positive(cfg, "num_hidden_layers")
        hidden = _positive(cfg, "hidden_size")
        n_heads = _positive(cfg, "num_attention_heads")
        types = cfg.get("layer_types")
        if types is None:
            full = set(cfg.get("full_attn_idxs") or range(n_layers))
            types = ["full_attention" if i in full else "conv" for i in range(n_layers)]
        if len(types) != n_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {n_layers} layers")
        lfm2_kinds = {"full_attention": ATTENTION, "conv": SHORT_CONV}
        unknown = sorted(set(types) - set(lfm2_kinds))
        if unknown:
            names = ", ".join(map(repr, unknown))
            raise NotImplementedError(f"LFM2 layer type(s) {names} are not supported (conv, full_attention)")
        ff = int(cfg.get("block_ff_dim") or cfg["intermediate_size"])
        if cfg.get("block_auto_adjust_ff_dim", True):
            ff = int(2 * ff / 3)
            multiplier = cfg.get("block_ffn_dim_multiplier", 1.0)
            if multiplier is not None:
                step = int(cfg.get("block_multiple_of", 256))
                ff = step * -(-int(multiplier * ff) // step)
        params = cfg.get("rope_parameters") or {}
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 1_000_000.0)))
        scaling = _normalize_scaling(params or cfg.get("rope_scaling"))
        bos, eos_ids = _hf_special_ids(cfg, gen)
        tied = cfg.get("tie_word_embeddings", cfg.get("tie_embedding", True))
        return cls(
            family="lfm2",
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            num_layers=n_layers,
            num_heads=n_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=int(cfg.get("head_dim") or hidden // n_heads),
            intermediate_size=ff,
            rms_norm_eps=float(cfg.get("norm_eps", 1e-5)),
            rope_theta=theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 128_000)),
            tie_word_embeddings=bool(tied),
            bos_token_id=bos,
            eos_token_ids=eos_ids,
            rope_scaling=scaling,
            qk_norm=True,
            torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            generation_defaults=dict(gen),
            layer_kinds=[lfm2_kinds[t] for t in types],
            conv_kernel=int(cfg.get("conv_L_cache", 3)),
            conv_bias=bool(cfg.get("conv_bias", False)),
        )

    @classmethod
    def _from_hf_qwen3_5(cls, cfg: dict[str, Any], gen: dict[str, Any]) -> ModelConfig:
        """Qwen3.5 dense text models (HF `qwen3_5_text`, or the text part of a `qwen3_5` checkpoint, whose vision tower
        is not run): Gated DeltaNet layers ("linear_attention") beside gated GQA attention with partial rope (the
        first quarter of each head) and zero-centred norms ((1 + w), as Gemma's)."""
        if cfg.get("model_type") == "qwen3_5":
            if not isinstance(cfg.get("text_config"), dict):
                raise ValueError("a qwen3_5 config without a text_config is not understood")
            cfg = {**cfg["text_config"], "tie_word_embeddings": cfg.get("tie_word_embeddings", False)}
        if cfg.get("num_experts") or cfg.get("num_local_experts"):
            raise NotImplementedError("Qwen3.5 mixture-of-experts models are not supported (the dense ones are)")
        n_layers = _positive(cfg, "num_hidden_layers")
        types = cfg.get("layer_types") or [
            "linear_attention" if (i + 1) % int(cfg.get("full_attention_interval", 4)) else "full_attention"
            for i in range(n_layers)
        ]
        if len(types) != n_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {n_layers} layers")
        kinds_by_type = {"full_attention": ATTENTION, "linear_attention": LINEAR_ATTENTION}
        unknown = sorted(set(types) - set(kinds_by_type))
        if unknown:
            names = ", ".join(map(repr, unknown))
            raise NotImplementedError(
                f"Qwen3.5 layer type(s) {names} are not supported (linear_attention, full_attention)"
            )
        params = cfg.get("rope_parameters") or {}
        hidden, n_heads = _positive(cfg, "hidden_size"), _positive(cfg, "num_attention_heads")
        bos, eos_ids = _hf_special_ids(cfg, gen)
        return cls(
            family="qwen3_5",
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            num_layers=n_layers,
            num_heads=n_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=int(cfg.get("head_dim") or hidden // n_heads),
            intermediate_size=int(cfg["intermediate_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(params.get("rope_theta", cfg.get("rope_theta", 10_000.0))),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=bos,
            eos_token_ids=eos_ids,
            hidden_act=str(cfg.get("hidden_act") or "silu"),
            attention_bias=bool(cfg.get("attention_bias", False)),
            attention_out_bias=bool(cfg.get("attention_bias", False)),
            qk_norm=True,
            torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            generation_defaults=dict(gen),
            layer_kinds=[kinds_by_type[t] for t in types],
            conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
            linear_key_heads=int(cfg.get("linear_num_key_heads", 16)),
            linear_value_heads=int(cfg.get("linear_num_value_heads", 32)),
            linear_key_dim=int(cfg.get("linear_key_head_dim", 128)),
            linear_value_dim=int(cfg.get("linear_value_head_dim", 128)),
            attention_output_gate=True,
            partial_rotary_factor=float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))),
        )

    @classmethod
    def from_gguf(cls, gguf: str | Path | GGUFFile) -> ModelConfig:
        """Read a GGUF file's metadata (llama, qwen2, qwen3, gemma3, lfm2 architectures); no tensor data."""
        from kvserve.model.gguf_reader import GGUFFile

        f = gguf if isinstance(gguf, GGUFFile) else GGUFFile(gguf)
        arch = f.architecture
        family = _GGUF_FAMILIES.get(arch)
        if family is None:
            raise ValueError(
                f"{f.path}: unsupported GGUF architecture {arch!r} (supported: {', '.join(_GGUF_FAMILIES)})"
            )

        def need(key: str) -> Any:
            value = f.arch_value(key)
            if value is None:
                raise ValueError(f"{f.path}: GGUF metadata key {arch}.{key} is missing")
            return value

        n_layers, hidden, n_heads = (
            _positive({key: need(key)}, key) for key in ("block_count", "embedding_length", "attention.head_count")
        )
        n_kv = f.arch_value("attention.head_count_kv", n_heads)
        kinds: list[str] = []
        linear: dict[str, Any] = {}
        if family == "lfm2":  # llama.cpp's converter marks LFM2's conv layers by 0 KV heads
            counts = list(n_kv) if isinstance(n_kv, list) else [int(n_kv)] * n_layers
            kinds = [ATTENTION if n else SHORT_CONV for n in counts]
            n_kv = max(counts)
        if family == "qwen3_5":
            # The converter counts a multi-token-prediction layer (nextn) into block_count; it is not run.
            n_layers -= int(f.arch_value("nextn_predict_layers", 0) or 0)
            kinds, linear = _gguf_qwen35(f, n_layers)
            if isinstance(n_kv, list):
                n_kv = max(n_kv)
        if isinstance(n_kv, list):
            raise NotImplementedError(f"{f.path}: per-layer KV head counts are not supported")
        head_dim = int(
            f.arch_value("attention.key_length") or f.arch_value("rope.dimension_count") or hidden // n_heads
        )
        theta = float(f.arch_value("rope.freq_base", 10_000.0))
        embd = f.tensors.get("token_embd.weight")
        if embd is None:
            raise ValueError(f"{f.path}: tensor token_embd.weight is missing")
        vocab = int(f.arch_value("vocab_size") or embd.shape[0])
        scaling = _gguf_rope_scaling(f)
        windows: list[int | None] = [None] * n_layers
        thetas = [theta] * n_layers
        scalings = [scaling] * n_layers
        if family == "gemma3":
            window = f.arch_value("attention.sliding_window")
            for i in range(n_layers):
                if window and (i + 1) % GEMMA3_SLIDING_PATTERN != 0:
                    windows[i], thetas[i], scalings[i] = int(window), GEMMA3_LOCAL_ROPE_THETA, None
        first = kinds.index(ATTENTION) if ATTENTION in kinds else 0  # the first attention layer says what they have
        md = f.metadata
        bos = md.get("tokenizer.ggml.bos_token_id")
        eos = md.get("tokenizer.ggml.eos_token_id")
        eos_ids = [] if eos is None else [int(eos)]
        if family == "gemma3" and GEMMA3_END_OF_TURN < vocab and GEMMA3_END_OF_TURN not in eos_ids:
            eos_ids.append(GEMMA3_END_OF_TURN)
        return cls(
            family=family,
            vocab_size=vocab,
            hidden_size=hidden,
            num_layers=n_layers,
            num_heads=n_heads,
            num_kv_heads=int(n_kv),
            head_dim=head_dim,
            intermediate_size=int(need("feed_forward_length")),
            rms_norm_eps=float(f.arch_value("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=int(f.arch_value("context_length", 2048)),
            tie_word_embeddings="output.weight" not in f.tensors,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
            hidden_act="gelu_pytorch_tanh" if family == "gemma3" else "silu",
            sliding_windows=windows,
            rope_thetas=thetas,
            rope_scaling=scaling,
            rope_scalings=scalings,
            attention_bias=f"blk.{first}.attn_q.bias" in f.tensors,
            attention_out_bias=f"blk.{first}.attn_output.bias" in f.tensors,
            qk_norm=f"blk.{first}.attn_q_norm.weight" in f.tensors,
            # HF's GGUF config mapping leaves Gemma3TextConfig's default (256) in place.
            query_pre_attn_scalar=256.0 if family == "gemma3" else None,
            torch_dtype=None,
            layer_kinds=kinds,
            conv_bias=any(name.endswith("shortconv.in_proj.bias") for name in f.tensors),
            **({"conv_kernel": int(f.arch_value("shortconv.l_cache", 3))} if family == "lfm2" else linear),
        )


def _positive(cfg: dict[str, Any], key: str) -> int:
    """A config.json size that divides others (heads into the hidden size): a positive integer, or a ValueError
    naming it (zero heads was a ZeroDivisionError traceback)."""
    value = int(cfg[key])
    if value < 1:
        raise ValueError(f"{key} must be a positive integer, got {value}")
    return value


def _hf_special_ids(cfg: dict[str, Any], gen: dict[str, Any]) -> tuple[int | None, list[int]]:
    """(BOS id, EOS ids) of an HF config, generation_config.json's first: EOS may be one id or a list."""
    bos, eos = gen.get("bos_token_id", cfg.get("bos_token_id")), gen.get("eos_token_id", cfg.get("eos_token_id"))
    eos_ids = [] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    return None if bos is None else int(bos), eos_ids


def _gguf_qwen35(f: GGUFFile, n_layers: int) -> tuple[list[str], dict[str, Any]]:
    """Qwen3.5's layer kinds and Gated DeltaNet shapes from a GGUF file as llama.cpp's converter writes them
    (recurrent_layers, else full_attention_interval; ssm.* for the linear layers; rope.dimension_count is the partial
    rope's dims)."""
    recurrent = f.arch_value("attention.recurrent_layers")
    if recurrent is None:
        interval = int(f.arch_value("full_attention_interval", 4))
        recurrent = [bool((i + 1) % interval) for i in range(n_layers)]
    kinds = [LINEAR_ATTENTION if r else ATTENTION for r in list(recurrent)[:n_layers]]
    need = {key: f.arch_value(f"ssm.{key}") for key in ("conv_kernel", "state_size", "group_count", "time_step_rank")}
    missing = [key for key, value in need.items() if value is None]
    if missing:
        raise ValueError(f"{f.path}: GGUF metadata key(s) {', '.join(f'qwen35.ssm.{k}' for k in missing)} missing")
    value_heads = int(need["time_step_rank"])
    inner = int(f.arch_value("ssm.inner_size", 0))
    head_dim = int(f.arch_value("attention.key_length") or 0)
    rotary = f.arch_value("rope.dimension_count")
    return kinds, {
        "conv_kernel": int(need["conv_kernel"]),
        "linear_key_heads": int(need["group_count"]),
        "linear_value_heads": value_heads,
        "linear_key_dim": int(need["state_size"]),
        "linear_value_dim": inner // value_heads if inner else int(need["state_size"]),
        "attention_output_gate": True,
        "partial_rotary_factor": float(rotary) / head_dim if rotary and head_dim else 0.25,
    }


def _hf_layer_types(cfg: dict[str, Any], family: str, n_layers: int) -> list[str]:
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != n_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {n_layers} layers")
        return list(types)
    if family == "gemma3":  # transformers 4.x configs: sliding_window_pattern
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or GEMMA3_SLIDING_PATTERN)
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
    if family == "qwen2" and cfg.get("use_sliding_window"):
        first = int(cfg.get("max_window_layers", n_layers))
        return ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
    return ["full_attention"] * n_layers


def _normalize_scaling(params: dict[str, Any] | None) -> dict | None:
    """Rope parameters without rope_theta; None for plain rope."""
    if not params:
        return None
    out = {k: v for k, v in params.items() if k != "rope_theta"}
    rope_type = out.pop("type", None) or out.get("rope_type") or "default"
    out["rope_type"] = rope_type
    if rope_type == "default":
        return None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(
            f"rope scaling type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    return out


def _hf_rope(cfg: dict[str, Any], family: str, layer_types: list[str]) -> tuple[list[float], list[dict | None]]:
    """Per layer (theta, scaling) from either `rope_parameters` (transformers 5) or `rope_theta`/`rope_scaling`."""
    params = cfg.get("rope_parameters")
    if family == "gemma3":
        if params and "full_attention" in params:
            per_type = {t: params.get(t) or {} for t in ("full_attention", "sliding_attention")}
        else:
            full = dict(cfg.get("rope_scaling") or {})
            full["rope_theta"] = cfg.get("rope_theta", 1_000_000.0)
            per_type = {
                "full_attention": full,
                "sliding_attention": {"rope_theta": cfg.get("rope_local_base_freq", GEMMA3_LOCAL_ROPE_THETA)},
            }
        defaults = {"full_attention": 1_000_000.0, "sliding_attention": GEMMA3_LOCAL_ROPE_THETA}
        thetas = [float(per_type[t].get("rope_theta", defaults[t])) for t in layer_types]
        scalings = [_normalize_scaling(per_type[t]) for t in layer_types]
        return thetas, scalings
    if params and "rope_theta" in params:
        theta, scaling = float(params["rope_theta"]), _normalize_scaling(params)
    else:
        theta, scaling = float(cfg.get("rope_theta", 10_000.0)), _normalize_scaling(cfg.get("rope_scaling"))
    return [theta] * len(layer_types), [scaling] * len(layer_types)


def _gguf_rope_scaling(f: GGUFFile) -> dict | None:
    kind = f.arch_value("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(f.arch_value("rope.scaling.factor", 1.0))}
    raise NotImplementedError(f"{f.path}: GGUF rope scaling type {kind!r} is not supported")
