"""Turn `--model` (config.json, checkpoint dir, .gguf, or a catalog name) into the facts capacity math needs.

Reads metadata only: config.json, safetensors headers, GGUF metadata. Never imports torch or transformers,
and never reads tensor data. Families kvserve runs are parsed by ModelConfig (one parser for the engine and
the estimate); other families (MLA, Gemma 2, MoE) only need their attention fields, read here.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.capacity import KVShape
from kvserve.capacity_catalog import CATALOG, find_entry
from kvserve.json_files import read_json_object
from kvserve.kv.state import StateSpec
from kvserve.model.config import ModelConfig, runs_hf_model_type


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What sizing needs to know about a model, wherever it was described."""

    name: str
    kind: str  # "catalog" | "hf-config" | "gguf"
    source: str  # a path or the URL a catalog entry cites
    shape: KVShape
    context_len: int
    checkpoint_dtype: str | None
    num_parameters: int | None
    num_parameters_note: str
    file_bytes: int | None = None  # weights on disk (GGUF file / safetensors), when there are any
    state: StateSpec | None = None  # a hybrid model's state layers (kv/state.py): a state a sequence, no KV

    def to_json(self) -> dict[str, Any]:
        s = self.shape
        return {
            "name": self.name,
            "kind": self.kind,
            "source": self.source,
            "attention": s.attention,
            "num_layers": s.num_layers,
            "num_attention_heads": s.num_attention_heads,
            "num_kv_heads": s.num_kv_heads,
            "head_dim": s.head_dim,
            "head_dim_note": s.head_dim_note,
            "kv_factor": s.kv_factor,
            "sliding_windows": list(s.sliding_windows),
            "context_len": self.context_len,
            "checkpoint_dtype": self.checkpoint_dtype,
            "num_parameters": self.num_parameters,
            "num_parameters_note": self.num_parameters_note,
            "file_bytes": self.file_bytes,
            "state": None
            if self.state is None
            else {
                "num_layers": self.state.num_layers,
                "conv_kernel": self.state.conv_kernel,
                "conv_channels": self.state.conv_channels,
                "bytes_per_sequence": self.state.bytes_per_slot,
                "formula": self.state.describe(),
            },
        }


def resolve_model_facts(model: str | None) -> ModelFacts:
    """The engine's model resolution first (default model, a packaged model's name, .gguf, checkpoint dir), then
    config.json files, then the catalog. A packaged name (`qwen2.5-coder-0.5b-instruct`) is the file `serve` would
    load by that name, joined and checked as serve does (kvserve/model/packaged.py: its chunk packages are never
    imported, and missing ones are an error naming the extra that installs them)."""
    from kvserve.model.packaged import PACKAGED_MODELS
    from kvserve.model.source import DEFAULT_MODEL_NAME, ModelFormat, resolve_model

    path = Path(model).expanduser() if model else None
    if path is not None and path.is_file() and path.suffix == ".json":
        return _from_hf_config(read_json_object(path), path.parent, str(path), path.parent.name or path.stem)
    named = model is None or model in (DEFAULT_MODEL_NAME, "default") or model in PACKAGED_MODELS
    is_local = named or (path is not None and path.exists())
    if model is not None and not is_local:  # is_local holds when model is None
        entry = find_entry(model)
        if entry is None:
            names = ", ".join(e.name for e in CATALOG)
            raise ValueError(
                f"model {model!r} is neither a config.json, a checkpoint directory, a .gguf file, a packaged "
                f"model's name ({', '.join(PACKAGED_MODELS)}), nor a catalog name ({names})"
            )
        facts = _from_hf_config(entry.config, None, entry.source, entry.name)
        return _with_params(facts, entry.num_parameters, "published on the model card", "catalog")
    source = resolve_model(model)
    if source.format == ModelFormat.GGUF:
        return _from_gguf(source.path, source.name)
    return _from_hf_config(read_json_object(source.path / "config.json"), source.path, str(source.path), source.name)


def kv_shape_from_hf_config(cfg: dict[str, Any]) -> tuple[KVShape, ModelConfig | None]:
    """KV shape of an HF config dict; the ModelConfig too when kvserve can run the family."""
    text = cfg.get("text_config") or cfg  # multimodal wrappers keep the decoder in text_config
    layers, heads = int(text["num_hidden_layers"]), int(text["num_attention_heads"])
    if layers < 1 or heads < 1:
        raise ValueError(f"num_hidden_layers and num_attention_heads must be positive, got {layers} and {heads}")
    if text.get("kv_lora_rank"):
        return KVShape.mla(layers, int(text["kv_lora_rank"]), int(text["qk_rope_head_dim"]), heads), None
    try:
        model_config = ModelConfig.from_hf_dict(text)
    except (ValueError, NotImplementedError):
        if runs_hf_model_type(text.get("model_type")):  # a family kvserve runs: what serve would refuse, said now
            raise
        model_config = None  # a family kvserve does not run: read attention fields only
    if model_config is not None:
        return KVShape.from_model_config(model_config), model_config
    hidden = int(text["hidden_size"])
    head_dim = text.get("head_dim")
    note = "head_dim" if head_dim else f"hidden_size {hidden} / {heads} heads"
    return KVShape(
        layers,
        int(text.get("num_key_value_heads") or heads),
        int(head_dim or hidden // heads),
        heads,
        _other_family_windows(text, layers),
        head_dim_note=note,
    ), None


def _other_family_windows(cfg: dict[str, Any], layers: int) -> tuple[int | None, ...]:
    """Per-layer windows for families ModelConfig does not parse: explicit layer_types, Gemma 2's
    alternation (even layers local), or a window on every layer (Mixtral-style)."""
    window = cfg.get("sliding_window")
    if not window or cfg.get("use_sliding_window") is False:
        return (None,) * layers
    types = cfg.get("layer_types")
    if types is None and cfg.get("model_type") == "gemma2":
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if types is None:
        return (int(window),) * layers
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


def dense_parameter_count(cfg: ModelConfig) -> int:
    """Parameters of a dense decoder from its config: embeddings, attention, gated MLP, norms, biases."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    gate = q if cfg.attention_output_gate else 0  # Qwen3.5: q_proj also makes the output gate
    attention = h * (q + gate) + 2 * h * kv + q * h + (q + 2 * kv if cfg.attention_bias else 0)
    norms = (4 if cfg.sandwich_norms else 2) * h + (2 * hd if cfg.qk_norm else 0)
    mlp = 3 * h * cfg.intermediate_size
    if cfg.linear_key_heads:
        # A Gated DeltaNet layer (Qwen3.5): q, k, v, z and b, a projections, the convolution over q, k and v, per
        # value head dt_bias and A_log, the gated norm over a value head, out_proj.
        key, value = cfg.linear_key_heads * cfg.linear_key_dim, cfg.linear_value_heads * cfg.linear_value_dim
        channels = 2 * key + value
        state = h * (channels + value + 2 * cfg.linear_value_heads) + channels * cfg.conv_kernel
        state += 2 * cfg.linear_value_heads + cfg.linear_value_dim + value * h
    else:
        # A short-conv layer (LFM2) has in_proj (3h x h), out_proj (h x h) and h x kernel taps instead of attention.
        state = 4 * h * h + h * cfg.conv_kernel + ((4 * h + h) if cfg.conv_bias else 0)
    attention_layers, state_layers = cfg.num_kv_layers, cfg.num_layers - cfg.num_kv_layers
    per_attention_layer = attention + mlp + norms
    per_state_layer = state + mlp + 2 * h
    embeddings = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    return embeddings + attention_layers * per_attention_layer + state_layers * per_state_layer + h


def _from_hf_config(cfg: dict[str, Any], directory: Path | None, source: str, name: str) -> ModelFacts:
    try:
        shape, model_config = kv_shape_from_hf_config(cfg)
    except (KeyError, TypeError) as e:
        raise ValueError(f"{source}: missing or malformed field {e}") from e
    text = cfg.get("text_config") or cfg
    context = int(text.get("max_position_embeddings", 2048))
    dtype = text.get("torch_dtype") or text.get("dtype") or cfg.get("torch_dtype")
    state = None if model_config is None else model_config.state_spec
    facts = ModelFacts(
        name, "hf-config", source, shape, context, dtype, None, "unknown (pass --weights-bytes)", state=state
    )
    counted = _safetensors_parameters(directory) if directory is not None else None
    if counted is not None:
        return _with_params(facts, counted[0], "counted from the safetensors headers", file_bytes=counted[1])
    if model_config is not None:
        return _with_params(facts, dense_parameter_count(model_config), "computed from config.json (dense decoder)")
    return facts


def _with_params(
    facts: ModelFacts, params: int, note: str, kind: str | None = None, file_bytes: int | None = None
) -> ModelFacts:
    return ModelFacts(
        facts.name,
        kind or facts.kind,
        facts.source,
        facts.shape,
        facts.context_len,
        facts.checkpoint_dtype,
        params,
        note,
        file_bytes,
        facts.state,
    )


def _from_gguf(path: Path, name: str) -> ModelFacts:
    from kvserve.model.gguf_reader import GGUFFile

    with GGUFFile(path) as f:
        model_config = ModelConfig.from_gguf(f)
        params = sum(math.prod(t.shape) for t in f.tensors.values())
    return ModelFacts(
        name,
        "gguf",
        str(path),
        KVShape.from_model_config(model_config),
        model_config.max_position_embeddings,
        None,
        params,
        "counted from the GGUF tensors",
        path.stat().st_size,
        model_config.state_spec,
    )


def _safetensors_parameters(directory: Path) -> tuple[int, int] | None:
    """(parameters, bytes) from the headers of *.safetensors (8-byte length + JSON); None without weights."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        return None
    params = nbytes = 0
    for file in files:
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for key, info in header.items():
            if key != "__metadata__":
                params += math.prod(info["shape"])
                nbytes += info["data_offsets"][1] - info["data_offsets"][0]
    return params, nbytes
