"""The sizing flags shared by estimate and advise, and how they resolve into dtype, weights and KV budget."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from kvserve.capacity import Budget, budget_from_memory, resolve_compute_dtype, resolve_quantization
from kvserve.config import DEFAULT_CPU_KV_CACHE_BYTES, config_default
from kvserve.tools.model_facts import ModelFacts
from kvserve.tools.report import size_arg
from kvserve.vocab import COMPUTE_DTYPES, KV_DTYPES, QUANTIZATION_METHODS

Q8_0_BYTES_PER_WEIGHT = 1 + 4 / 32  # int8, and a float32 scale per 32 weights (kvserve/kernels/q8.py)


def add_sizing_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="an HF config.json or checkpoint directory (weights optional), a .gguf file, or a "
        "catalog name such as llama-3.1-8b (see --list-models); default: kvserve's default model",
    )
    parser.add_argument("--list-models", action="store_true", help="list the built-in catalog and exit")
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=None,
        help="where the model would run: decides what --dtype auto means (default: cuda when "
        "--memory is given, else cpu)",
    )
    parser.add_argument(
        "--dtype",
        default=config_default("dtype"),
        choices=["auto", *COMPUTE_DTYPES],
        help="weights/compute dtype as `kvserve serve` takes it: auto = float32 on CPU, the "
        "checkpoint's dtype (bfloat16 when unknown) on CUDA",
    )
    parser.add_argument("--block-size", type=int, default=config_default("block_size"), help="tokens per KV block")
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=config_default("max_num_batched_tokens"),
        help="as for kvserve serve: a sliding window's KV cache group holds its window plus one prefill chunk of up "
        "to this many tokens while a request prefills",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=config_default("max_num_seqs"),
        help="as for kvserve serve: a model with state layers (LFM2) keeps a state slot per sequence, and 4 state "
        "snapshots per sequence for prefix hits, out of the KV budget",
    )
    parser.add_argument(
        "--disable-hybrid-kv-cache-manager",
        action="store_true",
        help="as for kvserve serve: size the uniform layout, in which every layer keeps every token",
    )
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument(
        "--kv-cache-memory-bytes",
        type=size_arg,
        default=None,
        help="the KV budget itself, as the engine takes it (e.g. 4GiB); default on CPU: 4GiB",
    )
    budget.add_argument(
        "--memory",
        type=size_arg,
        default=None,
        help="device memory (e.g. 80GiB): KV budget = memory x --gpu-memory-utilization - weights - --overhead",
    )
    parser.add_argument("--gpu-memory-utilization", type=float, default=config_default("gpu_memory_utilization"))
    parser.add_argument(
        "--overhead",
        type=size_arg,
        default=0,
        help="memory for activations and runtime, subtracted with --memory (vLLM profiles it)",
    )
    parser.add_argument(
        "--quantization",
        "-q",
        default=config_default("quantization"),
        choices=["auto", *QUANTIZATION_METHODS],
        help="the weights as `kvserve serve` would hold them: auto = the GGUF file's own blocks (gguf) for a GGUF "
        "file on CPU, else the checkpoint's weights in --dtype (none); q8_0 = int8 plus a float32 scale per 32",
    )
    parser.add_argument(
        "--weights-bytes", type=size_arg, default=None, help="override the weights' size (e.g. for quantized weights)"
    )


@dataclass(frozen=True, slots=True)
class Setup:
    """The resolved sizing inputs: what the engine would run with, and the KV budget it would get."""

    device: str
    dtype: str
    quantization: str  # as `kvserve serve` would resolve --quantization
    block_size: int
    weights_bytes: int | None
    weights_formula: str
    budget: Budget | None
    hybrid: bool = (
        True  # KV cache groups that give sliding windows' blocks back (not --disable-hybrid-kv-cache-manager)
    )
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256

    def to_json(self) -> dict[str, Any]:
        budget = (
            None
            if self.budget is None
            else {"kv_bytes": self.budget.kv_bytes, "source": self.budget.source, "formula": self.budget.formula}
        )
        return {
            "device": self.device,
            "dtype": self.dtype,
            "quantization": self.quantization,
            "block_size": self.block_size,
            "hybrid_kv_cache_manager": self.hybrid,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_num_seqs": self.max_num_seqs,
            "weights": {"bytes": self.weights_bytes, "formula": self.weights_formula},
            "budget": budget,
        }


def resolve_setup(args: argparse.Namespace, facts: ModelFacts) -> Setup:
    if args.block_size < 1:
        raise ValueError(f"--block-size must be >= 1, got {args.block_size}")
    if args.max_num_batched_tokens < 1:
        raise ValueError(f"--max-num-batched-tokens must be >= 1, got {args.max_num_batched_tokens}")
    if args.max_num_seqs < 1:
        raise ValueError(f"--max-num-seqs must be >= 1, got {args.max_num_seqs}")
    device = args.device or ("cuda" if args.memory is not None else "cpu")
    dtype = resolve_compute_dtype(args.dtype, device, facts.checkpoint_dtype)
    quantization = resolve_quantization(args.quantization, device, "gguf" if facts.kind == "gguf" else "hf")
    if args.weights_bytes is not None:
        weights, formula = args.weights_bytes, f"{args.weights_bytes} bytes (--weights-bytes)"
    elif quantization == "gguf" and facts.file_bytes is not None:
        weights = facts.file_bytes
        formula = f"{weights} bytes: the GGUF file's own blocks, run as stored (--quantization gguf)"
    elif quantization == "q8_0" and facts.num_parameters is not None:
        weights = round(facts.num_parameters * Q8_0_BYTES_PER_WEIGHT)
        formula = (
            f"{facts.num_parameters} parameters ({facts.num_parameters_note}) x {Q8_0_BYTES_PER_WEIGHT} bytes "
            f"(q8_0: int8 and a float32 scale per 32) = {weights} bytes"
        )
    elif facts.num_parameters is not None:
        elem = KV_DTYPES[dtype].element_bytes
        weights = facts.num_parameters * elem
        formula = (
            f"{facts.num_parameters} parameters ({facts.num_parameters_note}) x {elem} bytes ({dtype}) "
            f"= {weights} bytes"
        )
    else:
        weights, formula = None, f"unknown: {facts.num_parameters_note}"
    return Setup(
        device,
        dtype,
        quantization,
        args.block_size,
        weights,
        formula,
        _budget(args, device, weights),
        hybrid=not args.disable_hybrid_kv_cache_manager,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
    )


def _budget(args: argparse.Namespace, device: str, weights: int | None) -> Budget | None:
    if args.kv_cache_memory_bytes is not None:
        return Budget(
            args.kv_cache_memory_bytes,
            "kv-cache-memory-bytes",
            f"{args.kv_cache_memory_bytes} bytes (--kv-cache-memory-bytes)",
        )
    if args.memory is not None:
        if weights is None:
            raise ValueError("--memory needs the weights' size, which is unknown for this model; pass --weights-bytes")
        return budget_from_memory(args.memory, args.gpu_memory_utilization, weights, args.overhead)
    if device == "cpu":
        return Budget(
            DEFAULT_CPU_KV_CACHE_BYTES,
            "cpu-default",
            f"{DEFAULT_CPU_KV_CACHE_BYTES} bytes (kvserve serve's default --kv-cache-memory-bytes on CPU)",
        )
    return None
