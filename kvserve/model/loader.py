"""Weight loading: HF safetensors checkpoints and GGUF files into a DecoderModel.

Every source is turned into a stream of *canonical* tensors (HF names without the leading "model.", RMSNorm
weights as the factor actually multiplied, i.e. Gemma's 1 + w) that `DecoderModel.load_weights` consumes.
GGUF tensors are dequantized once and cached as canonical float32 safetensors under the cache directory
(~/.cache/kvserve), so a second start only memory-maps that file; with --quantization the quantized weights are
cached beside it, and a later start reads only those.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.dtypes import torch_dtype
from kvserve.kernels.gguf_blocks import NATIVE_GGUF_TYPES
from kvserve.kernels.ops import TORCH_KERNELS, Kernels, load_kernels
from kvserve.model.config import ModelConfig
from kvserve.model.decoder import DecoderModel
from kvserve.model.gguf_layers import interleave_gguf_rows, use_gguf_blocks
from kvserve.model.gguf_reader import GGUFFile
from kvserve.model.lm_head import quantize_lm_head
from kvserve.model.quantization import quantize_model
from kvserve.model.source import ModelFormat, ModelSource
from kvserve.model.tokenizer import default_cache_dir

log = logging.getLogger(__name__)

GGUF_CACHE_VERSION = 1  # bump when the canonical layout of cached tensors changes
QUANTIZED_CACHE_VERSION = 1  # bump when a quantization's stored layout changes


@dataclass
class LoadedModel:
    config: ModelConfig
    model: DecoderModel
    source: ModelSource
    load_seconds: float


def load_model_config(source: ModelSource) -> ModelConfig:
    """Architecture facts only (config.json / GGUF metadata); reads no tensor data."""
    if source.format == ModelFormat.GGUF:
        with GGUFFile(source.path) as f:
            return ModelConfig.from_gguf(f)
    return ModelConfig.from_hf_dir(source.path)


def resolve_dtype(dtype: str, device: torch.device | str, config: ModelConfig) -> torch.dtype:
    """`--dtype`, by capacity's rule (auto = float32 on CPU, else the checkpoint's dtype, bfloat16 when unknown,
    e.g. GGUF), falling back to float16 on a CUDA device without bfloat16."""
    from kvserve.capacity import resolve_compute_dtype

    device = torch.device(device)
    chosen = torch_dtype(resolve_compute_dtype(dtype, device.type, config.torch_dtype if config else None))
    if chosen == torch.bfloat16 and dtype == "auto" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return chosen


def load_model(
    source: ModelSource,
    dtype: torch.dtype,
    device: torch.device,
    attention_backend: str = "cpu",
    cache_dir: Path | None = None,
    quantization: str = "none",
    config: ModelConfig | None = None,
    lm_head_quantization: str | None = None,
    activation_quantization: str = "none",
    kernel_isa: str | None = None,
) -> LoadedModel:
    """Build the model for `source`, fill its weights, then quantize them as `quantization` says;
    `cache_dir` holds dequantized GGUF tensors and quantized weights. The compiled kernels always live in the
    kvserve cache (default_cache_dir() / "kernels"): they depend on the machine, the compiler and the sources,
    not on the model, so one build (named by a digest of all three) serves every model and every cache_dir.
    `config`, when the caller has already read it (load_model_config), saves parsing the checkpoint's metadata
    again. `lm_head_quantization` (kvserve/model/lm_head.py) needs the GGUF blocks path, and so does
    `activation_quantization` "int8" (kernels/activation_quant.py), which runs on the torch kernels too (slowly:
    the blocks are dequantized at every matmul) where the native ones cannot be built, so that the numbers are the
    same. `kernel_isa`: build the native kernels for this instruction set (kernels/native.py), not the best."""
    start = time.perf_counter()
    if quantization == "gguf" and source.format != ModelFormat.GGUF:
        raise ValueError(
            f"--quantization gguf runs a GGUF file's own quantized blocks; {source.name} is a "
            f"{source.format.value} checkpoint (use none or q8_0)"
        )
    # The compiled kernels are CPU code: on a GPU nothing would call them, so nothing is compiled there.
    if activation_quantization != "none" and (quantization != "gguf" or device.type != "cpu"):
        raise ValueError(
            f"--activation-quantization {activation_quantization} quantizes the activations of a GGUF file's block "
            f"matmuls: it needs --quantization gguf on the CPU (here: --quantization {quantization} on {device.type})"
        )
    kernels_dir = default_cache_dir().expanduser() / "kernels"
    kernels = (
        load_kernels(kernels_dir, isa=kernel_isa, activation_quantization=activation_quantization)
        if device.type == "cpu"
        else TORCH_KERNELS
    )
    config = config or load_model_config(source)
    model = DecoderModel(config, dtype, device, attention_backend, kernels)
    quantized_file: Path | None = None
    # The torch kernels keep the blocks only for int8 activations (the same numbers as the native int8 path).
    blocks_path = kernels.name == "native" or activation_quantization != "none"
    if quantization == "gguf" and blocks_path and device.type == "cpu":
        _load_gguf_blocks(model, source, config, kernels, device)
        if lm_head_quantization is not None:
            quantize_lm_head(model, lm_head_quantization, kernels)
        interleave_gguf_rows(model, kernels)
        return _loaded(config, model, source, dtype, device, quantization, start)
    if lm_head_quantization is not None:
        raise ValueError(
            f"--lm-head-quantization {lm_head_quantization} re-quantizes an LM head held as the GGUF "
            f"file's blocks: it needs --quantization gguf with kvserve's native CPU kernels (here: "
            f"--quantization {quantization}, {kernels.name} kernels on {device.type})"
        )
    if quantization == "gguf":
        # No native kernels (no compiler, no AVX2, not the CPU): the blocks would all be dequantized at every start;
        # the float32 weights of the same blocks, cached once, are the same numbers.
        log.info(
            "--quantization gguf without kvserve's native kernels: the file's weights run dequantized to "
            "float32 (cached once), the same values as its blocks"
        )
        quantization = "none"
    if source.format == ModelFormat.GGUF:
        cache_file = _gguf_cache_file(source, cache_dir)
        if quantization != "none":
            quantized_file = cache_file.with_name(
                f"model.{quantization}-v{QUANTIZED_CACHE_VERSION}.{str(dtype).removeprefix('torch.')}.safetensors"
            )
        if quantized_file is not None and quantized_file.is_file():
            try:
                _load_quantized_cache(model, quantized_file, quantization, kernels)
                return _loaded(config, model, source, dtype, device, quantization, start)
            except ValueError as e:  # damaged or stale: rebuilt from the float32 weights below
                log.warning("%s; rebuilding it", e)
                quantized_file.unlink(missing_ok=True)
                model = DecoderModel(config, dtype, device, attention_backend, kernels)
        _load_gguf_weights(model, source, config, cache_file)
    else:
        kv_scales: dict[str, float] = {}
        model.load_weights(_without_kv_scales(_hf_canonical_tensors(source.path, config), kv_scales))
        model.static_kv_scales = _static_kv_scales(kv_scales, config.num_layers, source.path)
    if quantization != "none":
        quantize_model(model, quantization, kernels)
        if quantized_file is not None:
            _save_atomically(model.state_dict(), quantized_file, {"quantization": quantization})
    return _loaded(config, model, source, dtype, device, quantization, start)


def _load_gguf_blocks(
    model: DecoderModel, source: ModelSource, config: ModelConfig, kernels: Kernels, device: torch.device
) -> None:
    """`--quantization gguf`: the file's quantized tensors as their own blocks, read straight from the file
    (the file is its own cache: a start copies its bytes, with no float32 pass); the rest (norms, biases, and
    any tensor whose type has no native kernel here) dequantized to float32, with a log line."""
    from gguf.constants import GGMLQuantizationType

    with GGUFFile(source.path) as f:
        names = {gguf_canonical_name(g, config): g for g in f.tensors if _runs(g, config)}
        blocks = {
            name: (f.tensors[g].ggml_type, _canonical_rows(name, torch.from_numpy(f.tensor_blocks(g)), config))
            for name, g in names.items()
            if f.tensors[g].ggml_type in NATIVE_GGUF_TYPES
            and len(f.tensors[g].shape) == 2
            and not _columns_reordered(name, config)
        }
        used = use_gguf_blocks(model, blocks, kernels)
        rest = [name for name in names if name not in used]
        dequantized = sorted({GGMLQuantizationType(f.tensors[names[n]].ggml_type).name for n in rest} - {"F32"})
        if dequantized:
            log.info(
                "--quantization gguf: %s tensors dequantized to float32 (no native kernel for them with the "
                "%s kernels on %s)",
                ", ".join(dequantized),
                kernels.name,
                device.type,
            )
        model.load_weights((name, _gguf_tensor(f, names[name], name, config)) for name in rest)
    log.info("--quantization gguf: %d weight tensors run as the file's blocks (%s kernels)", len(used), kernels.name)


def _load_gguf_weights(model: DecoderModel, source: ModelSource, config: ModelConfig, cache_file: Path) -> None:
    """The float weights from the dequantized cache, written first if missing and rebuilt once if damaged."""
    for attempt in range(2):
        if not cache_file.is_file():
            with GGUFFile(source.path) as f:
                _write_gguf_cache(f, config, cache_file)
        try:
            model.load_weights(_safetensors_tensors([cache_file], lambda name: name))
            return
        except ValueError as e:  # a damaged cache is rebuilt once, never trusted
            if attempt:
                raise
            log.warning("dequantized cache %s is unusable (%s); rebuilding it", cache_file, e)
            cache_file.unlink(missing_ok=True)


def _loaded(
    config: ModelConfig,
    model: DecoderModel,
    source: ModelSource,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str,
    start: float,
) -> LoadedModel:
    model.eval()
    model.choose_layer_path()  # the weights are in place: native decoder layers or the torch modules, logged now
    seconds = time.perf_counter() - start
    log.info(
        "loaded %s (%s, %s, quantization %s, %s) in %.2f s",
        source.name,
        config.family,
        dtype,
        quantization,
        device,
        seconds,
    )
    return LoadedModel(config=config, model=model, source=source, load_seconds=seconds)


# -- HF checkpoints ---------------------------------------------------------------------------------
def hf_safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's shard files, from model.safetensors.index.json when present; clear errors if not."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index}: malformed index (need a JSON object with a 'weight_map'): {e}") from e
        files = [path / n for n in names]
        for f in files:
            if not f.is_file():
                raise ValueError(f"{f}: file is missing (listed in {index.name})")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors weight files found (only safetensors checkpoints are supported)")
    return files


def _hf_canonical_tensors(path: Path, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    skipped: set[str] = set()

    def rename(name: str) -> str | None:
        if name.endswith("rotary_emb.inv_freq"):
            return None
        if config.family == "qwen3_5":  # a Qwen3_5ForConditionalGeneration checkpoint: its language model only
            if name.startswith(("model.visual.", "visual.", "mtp.")):
                skipped.add(name.split(".", 2)[0 if name.startswith("mtp.") else 1])
                return None
            name = name.replace("model.language_model.", "model.", 1)
        return name.removeprefix("model.")

    for name, tensor in _safetensors_tensors(hf_safetensors_files(path), rename):
        # Gemma's and Qwen3.5's RMSNorm multiply by (1 + w); Qwen3.5's gated norm in linear attention by w
        if config.norm_adds_one and name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            tensor = tensor.float() + 1.0
        if config.family == "lfm2":
            name, tensor = _lfm2_canonical(name, tensor)
        if config.family == "qwen3_5" and name.endswith("linear_attn.conv1d.weight"):
            name, tensor = name.replace("conv1d.weight", "conv_weight"), tensor.reshape(tensor.shape[0], -1)
        yield name, tensor
    if skipped:
        log.info("%s: not run: %s (the text model only)", path, ", ".join(sorted(skipped)))


# LFM2's HF names -> the decoder's (layers.N.<sub>): its MLP, norms and attention output under llama's names.
_LFM2_NAMES = {
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "operator_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "self_attn.out_proj": "self_attn.o_proj",
    "self_attn.q_layernorm": "self_attn.q_norm",
    "self_attn.k_layernorm": "self_attn.k_norm",
    "conv.conv": "conv.conv",  # the depthwise conv's weight [channels, 1, kernel] is stored as [channels, kernel]
}


def _lfm2_canonical(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    if name == "embedding_norm.weight":
        return "norm.weight", tensor
    if not name.startswith("layers."):
        return name, tensor
    _, idx, rest = name.split(".", 2)
    sub, _, suffix = rest.rpartition(".")
    if sub == "conv.conv":
        return f"layers.{idx}.conv.conv_{suffix}", tensor.reshape(tensor.shape[0], -1) if suffix == "weight" else tensor
    return f"layers.{idx}.{_LFM2_NAMES.get(sub, sub)}.{suffix}", tensor


_KV_SCALE_NAME = re.compile(r"layers\.(\d+)\.self_attn\.([kv])_scale$")


def _without_kv_scales(
    tensors: Iterator[tuple[str, torch.Tensor]], found: dict[str, float]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass weights through; keep fp8 checkpoints' per-tensor KV scales (`layers.N.self_attn.k_scale` /
    `v_scale`, as vLLM and llm-compressor write them) aside in `found`."""
    for name, tensor in tensors:
        if _KV_SCALE_NAME.search(name):
            if tensor.numel() != 1:
                raise ValueError(f"{name}: a KV scale must hold one value (per-tensor), got shape {list(tensor.shape)}")
            found[name] = float(tensor.reshape(()).float())
        else:
            yield name, tensor


def _static_kv_scales(found: dict[str, float], num_layers: int, path: Path) -> list[tuple[float, float]] | None:
    """Per layer (k_scale, v_scale), or None without any; a checkpoint with only some of them is malformed."""
    if not found:
        return None
    by_layer: dict[tuple[int, str], float] = {}
    for name, value in found.items():
        match = _KV_SCALE_NAME.search(name)
        assert match is not None
        if not value > 0:
            raise ValueError(f"{path}: KV scale {name} must be positive, got {value}")
        by_layer[int(match.group(1)), match.group(2)] = value
    missing = [f"layers.{i}.self_attn.{kv}_scale" for i in range(num_layers) for kv in "kv" if (i, kv) not in by_layer]
    if missing:
        raise ValueError(f"{path}: the checkpoint has KV scales for some layers but not {', '.join(missing[:4])}")
    return [(by_layer[i, "k"], by_layer[i, "v"]) for i in range(num_layers)]


def _safetensors_tensors(files: list[Path], rename: Callable[[str], str | None]) -> Iterator[tuple[str, torch.Tensor]]:
    """(canonical name, tensor) from each file, one tensor in memory at a time."""
    from safetensors import SafetensorError, safe_open

    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    name = rename(key)
                    if name is not None:
                        yield name, f.get_tensor(key)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{file}: cannot read safetensors file: {e}") from e


# -- GGUF -------------------------------------------------------------------------------------------
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs.weight",
}


# Qwen3.5's Gated DeltaNet tensors as llama.cpp names them -> the decoder's (under layers.N.).
_GGUF_QWEN35_NAMES = {
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_out": "linear_attn.out_proj",
    "ssm_norm": "linear_attn.norm",
    "ssm_conv1d.weight": "linear_attn.conv_weight",
    "ssm_a": "linear_attn.A_log",  # stored as -exp(A_log)
    "ssm_dt.bias": "linear_attn.dt_bias",
}


def gguf_canonical_name(name: str, config: ModelConfig) -> str:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    if config.family == "qwen3_5" and name.startswith("blk."):
        _, idx, rest = name.split(".", 2)
        kind, _, suffix = rest.partition(".")
        if rest in _GGUF_QWEN35_NAMES:  # whole names: ssm_a (no suffix), ssm_dt.bias, ssm_conv1d.weight
            return f"layers.{idx}.{_GGUF_QWEN35_NAMES[rest]}"
        if kind in _GGUF_QWEN35_NAMES:
            return f"layers.{idx}.{_GGUF_QWEN35_NAMES[kind]}.{suffix}"
    if config.family == "lfm2" and name == "token_embd_norm.weight":  # LFM2's final norm (HF's embedding_norm)
        return "norm.weight"
    parts = name.split(".")
    if config.family == "lfm2" and len(parts) == 5 and parts[0] == "blk" and parts[2] == "shortconv":
        _, idx, _, sub, suffix = parts  # the conv's taps: [channels, kernel] as the converter squeezed them
        return f"layers.{idx}.conv.conv_{suffix}" if sub == "conv" else f"layers.{idx}.conv.{sub}.{suffix}"
    if len(parts) == 4 and parts[0] == "blk":
        _, idx, kind, suffix = parts
        hf: str | None
        if kind == "ffn_norm":  # the pre-MLP norm: HF calls it differently in the two layouts
            hf = "pre_feedforward_layernorm" if config.sandwich_norms else "post_attention_layernorm"
        else:
            hf = _GGUF_LAYER_NAMES.get(kind)
        if hf is not None:
            return f"layers.{idx}.{hf}.{suffix}"
    raise ValueError(f"GGUF tensor {name!r} is not understood for the {config.family} family")


def _runs(gguf_name: str, config: ModelConfig) -> bool:
    """Whether a GGUF tensor belongs to the layers kvserve runs: not a Qwen3.5 file's multi-token-prediction (nextn)
    layer, which the converter stores as blocks past the model's own."""
    if not gguf_name.startswith("blk."):
        return True
    return int(gguf_name.split(".", 2)[1]) < config.num_layers or config.family != "qwen3_5"


def _unpermute_llama_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved rope pairs) back to HF's rotate-half layout."""
    rows = w.shape[0]
    # GGUF rows of a head are ordered (pair index, 0/1); HF's are (0/1, pair index).
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_canonical_tensors(f: GGUFFile, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantized float32 tensors under canonical names; llama-arch Q/K rows un-permuted."""
    for gguf_name in f.tensors:
        if not _runs(gguf_name, config):
            continue
        name = gguf_canonical_name(gguf_name, config)
        yield name, _gguf_tensor(f, gguf_name, name, config)


def _gguf_tensor(f: GGUFFile, gguf_name: str, name: str, config: ModelConfig) -> torch.Tensor:
    """One tensor dequantized to float32 under its canonical name's row order (and, for Qwen3.5, column order and
    values as HF has them)."""
    tensor = _canonical_rows(name, torch.from_numpy(f.tensor_float32(gguf_name)), config)
    if config.family == "qwen3_5":
        if name.endswith("linear_attn.A_log"):
            return torch.log(-tensor)  # llama.cpp stores A = -exp(A_log)
        if name.endswith("linear_attn.out_proj.weight"):
            return _untile_value_heads(tensor.T, config, config.linear_value_dim).T.contiguous()
    return tensor


def _canonical_rows(name: str, tensor: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """llama-arch Q/K rows un-permuted, Qwen3.5's value heads back in HF's order (whole rows move, so this also holds
    for a quantized tensor's blocks)."""
    if config.family == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
        return _unpermute_llama_rows(tensor, config.num_heads)
    if config.family == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
        return _unpermute_llama_rows(tensor, config.num_kv_heads)
    if config.family == "qwen3_5" and ".linear_attn." in name:
        dv, kd = config.linear_value_dim, 2 * config.linear_key_heads * config.linear_key_dim
        if name.endswith(("in_proj_qkv.weight", "conv_weight")):  # only the value rows were reordered
            return torch.cat((tensor[:kd], _untile_value_heads(tensor[kd:], config, dv)))
        if name.endswith("in_proj_z.weight"):
            return _untile_value_heads(tensor, config, dv)
        if name.endswith(("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")):
            return _untile_value_heads(tensor, config, 1)
    return tensor


def _untile_value_heads(rows: torch.Tensor, config: ModelConfig, head_dim: int) -> torch.Tensor:
    """Undo llama.cpp's value-head reorder for Qwen3.5 (its converter's _LinearAttentionVReorderBase): with fewer key
    heads than value heads it stores the value heads tiled ([v0 of each key head, v1 of each, ...]) for ggml's
    broadcast, where HF groups them by key head ([the value heads of key head 0, of key head 1, ...])."""
    k_heads, v_heads = config.linear_key_heads, config.linear_value_heads
    if k_heads == v_heads:
        return rows
    per_key = v_heads // k_heads
    shape = rows.shape
    return rows.reshape(per_key, k_heads, head_dim, *shape[1:]).transpose(0, 1).reshape(shape)


def _columns_reordered(name: str, config: ModelConfig) -> bool:
    """Whether the GGUF stores this tensor's columns in another order than HF's: such a tensor cannot run as the
    file's blocks (a block spans columns), so it is dequantized."""
    return (
        config.family == "qwen3_5"
        and config.linear_key_heads != config.linear_value_heads
        and name.endswith("linear_attn.out_proj.weight")
    )


def _gguf_cache_file(source: ModelSource, cache_dir: Path | None) -> Path:
    stat = source.path.stat()
    root = (cache_dir or default_cache_dir()).expanduser()
    key = f"{source.path.stem}-{stat.st_size}-{stat.st_mtime_ns}-v{GGUF_CACHE_VERSION}"
    return root / key / "model.safetensors"


def _load_quantized_cache(model: DecoderModel, file: Path, quantization: str, kernels: Kernels) -> None:
    """Fill `model` from a saved quantized state: a later start skips the float32 pass and reads a third of
    the bytes. Raises ValueError when the file does not fit the model."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    quantize_model(model, quantization, kernels, quantize=False)
    try:
        model.load_state_dict(load_file(str(file)), strict=True, assign=True)
    except (SafetensorError, OSError, RuntimeError) as e:
        raise ValueError(f"quantized cache {file} is unusable ({e})") from e


def _save_atomically(tensors: dict[str, torch.Tensor], file: Path, metadata: dict[str, str]) -> None:
    """tmp file, then rename: a crash or a concurrent start never leaves a half-written cache behind."""
    from safetensors.torch import save_file

    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_suffix(f".tmp{os.getpid()}")
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
        os.replace(tmp, file)
    finally:
        tmp.unlink(missing_ok=True)


def _write_gguf_cache(f: GGUFFile, config: ModelConfig, cache_file: Path) -> None:
    """Dequantize every tensor once and store them (float32) atomically: tmp file, then rename."""
    start = time.perf_counter()
    log.info(
        "first start of %s: dequantizing its tensors into %s (once; about 10 s for Gemma 3 270M)",
        f.path.name,
        cache_file,
    )
    tensors = dict(gguf_canonical_tensors(f, config))
    _save_atomically(tensors, cache_file, {"source": str(f.path), "layout": f"kvserve-canonical-v{GGUF_CACHE_VERSION}"})
    log.info("dequantized %s into %s in %.2f s", f.path.name, cache_file, time.perf_counter() - start)
