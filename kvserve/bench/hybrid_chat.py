"""`kvserve bench hybrid-chat`: prefix caching of hybrid models (LFM2's short convolutions, Qwen3.5's Gated DeltaNet)
over a multi-turn chat, kvserve against llama-server on the same GGUF file.

The models: random weights of the published shapes (`--shape`: LFM2-350M's or Qwen3.5-0.8B's config.json values,
in SHAPES), made with HF transformers, saved with a synthetic byte-level BPE vocabulary of the model's size, and
converted to GGUF by llama.cpp's own `convert_hf_to_gguf.py` (`--convert-script`: the one in the llama.cpp source
that scripts/build_llama_cpp.sh builds). Trained weights are not on the package registry; neither timing nor caching
depends on them. The converter is told the vocabulary's pre-tokenizer is "default" (its hash check knows only real
tokenizers), which is all that differs from converting a published checkpoint. Made once into `--workdir`.

The workload: `--users` users, each a system prompt of its own and a history growing over `--rounds` rounds: a
question, then the server's reply (`--output-len` tokens, greedy, EOS ignored). Prompts are token ids (random weights:
text means nothing), so both servers see the same ids. The reply joins the history *as the client renders it*, not
as the server sampled it: a canned reply of the same length, the same for every server. That is what chat clients do
(Qwen3.5's template drops the reasoning of earlier turns; a client re-renders the assistant message), and it is where
a server that keeps one recurrent state per slot must re-process the prompt: the new prompt diverges from the slot's
state where the reply starts. Each round sends every user's request at once, to one server after the other (the
order rotating each round).

TTFT: over HTTP, from sending the request to the first streamed token of /v1/completions. Hit rate: the prompt tokens
a server reports as taken from its cache (kvserve: usage.prompt_tokens_details.cached_tokens; llama-server: its
timings' cache_n) over the prompt tokens, per round."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.bench.options import add_output_args, new_command
from kvserve.vocab import ACTIVATION_QUANTIZATIONS

SCHEMA = """\
results: {"shape", "gguf", "workload": {"users", "rounds", "system_tokens", "question_tokens", "output_len",
                                        "shared_system_prompt"},
          "systems": {NAME: {"args", "rounds": [{"round", "ttft_ms_p50", "ttft_ms_p90", "hit_rate", "prompt_tokens",
                                                 "cached_tokens"}], "ttft_ms_p50_later_rounds"}}}
NAME: "kvserve", "llama-server default", "llama-server tuned" (with --llama-server).
ratios: {"ttft_p50_later_rounds_kvserve_over_<llama-server system>"}"""

SERVED_NAME = "bench"

# Published config.json values (LiquidAI/LFM2-350M; the text_config of Qwen/Qwen3.5-0.8B), as transformers takes them.
SHAPES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "lfm2-350m": (
        "Lfm2Config",
        "Lfm2ForCausalLM",
        dict(
            vocab_size=65536,
            hidden_size=1024,
            intermediate_size=6656,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=8,
            max_position_embeddings=128000,
            norm_eps=1e-5,
            conv_L_cache=3,
            conv_bias=False,
            block_multiple_of=256,
            block_ffn_dim_multiplier=1.0,
            block_auto_adjust_ff_dim=True,
            layer_types=["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)],
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
            bos_token_id=1,
            eos_token_id=7,
            pad_token_id=0,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3.5-0.8b": (
        "Qwen3_5TextConfig",
        "Qwen3_5ForCausalLM",
        dict(
            vocab_size=248320,
            hidden_size=1024,
            intermediate_size=3584,
            num_hidden_layers=24,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=256,
            linear_num_key_heads=16,
            linear_num_value_heads=16,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            rms_norm_eps=1e-6,
            max_position_embeddings=262144,
            tie_word_embeddings=True,
            eos_token_id=248044,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10_000_000.0,
                "partial_rotary_factor": 0.25,
                "mrope_section": [11, 11, 10],
                "mrope_interleaved": True,
            },
        ),
    ),
}

# llama-server's settings beside its defaults: a slot per user, and checkpoints of the recurrent state every 256
# tokens of a prompt (its default spacing is 8192, so chat-sized prompts get none), with its 8 GiB RAM prompt cache.
LLAMA_TUNED = ["--ctx-checkpoints", "32", "--checkpoint-min-step", "256"]


@dataclass(frozen=True, slots=True)
class ChatShape:
    users: int = 8
    rounds: int = 4
    system_tokens: int = 512
    question_tokens: int = 64
    output_len: int = 32
    seed: int = 0
    shared_system: bool = False  # every user the same system prompt (one application's), else one each


def synthetic_vocabulary(vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE vocabulary of exactly `vocab_size` tokens: the 256 byte symbols, then every pair of them with
    the merge that makes it, then (for vocabularies past 65,792) three-symbol tokens no merge makes (a random model's
    output ids reach them; no text encodes to them, which GGUF tokenizer readers take more readily than deep merges)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = list(bytes_to_unicode().values())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    merges: list[tuple[str, str]] = []
    for a in alphabet:
        for b in alphabet:
            if len(vocab) >= vocab_size:
                return vocab, merges
            vocab[a + b] = len(vocab)
            merges.append((a, b))
    for a in alphabet:
        for b in alphabet:
            for c in alphabet:
                if len(vocab) >= vocab_size:
                    return vocab, merges
                vocab[a + b + c] = len(vocab)
    return vocab, merges


def make_random_checkpoint(shape: str, directory: Path, seed: int = 0) -> None:
    """Random weights of `shape` (transformers' own initialization, seeded) in bfloat16, with the synthetic vocabulary
    as a tokenizer.json, into `directory`."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    config_cls, model_cls, kwargs = SHAPES[shape]
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    vocab, merges = synthetic_vocabulary(config.vocab_size)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    inverse = {i: t for t, i in vocab.items()}
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=inverse[1], eos_token=inverse[int(config.eos_token_id) % len(inverse)]
    )
    tokenizer.save_pretrained(directory)


_CONVERT = """\
import runpy, sys
script, source, out, outtype, *more = sys.argv[1:]
sys.path.insert(0, str(__import__("pathlib").Path(script).parent))
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"  # a synthetic vocabulary: no known hash
sys.argv = [script, source, "--outfile", out, "--outtype", outtype, *more]
runpy.run_path(script, run_name="__main__")
"""
# The converter's flags per shape beyond the defaults: the random Qwen3.5 has no multi-token-prediction layer (the
# published checkpoints do, and the converter expects one unless told).
CONVERT_FLAGS = {"qwen3.5-0.8b": ["--no-mtp"]}


def convert_to_gguf(convert_script: Path, source: Path, out: Path, outtype: str, flags: list[str]) -> None:
    """llama.cpp's convert_hf_to_gguf.py on `source`, told the synthetic vocabulary's pre-tokenizer is "default"."""
    cmd = [sys.executable, "-c", _CONVERT, str(convert_script), str(source), str(out), outtype, *flags]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or not out.is_file():
        raise ValueError(f"convert_hf_to_gguf.py failed ({done.returncode}):\n{done.stderr[-3000:]}")


def model_gguf(shape: str, workdir: Path, convert_script: Path | None, outtype: str) -> Path:
    """The shape's GGUF in `workdir`, made (random checkpoint, then llama.cpp's converter) when missing."""
    gguf = workdir / f"{shape}-random-{outtype}.gguf"
    if gguf.is_file():
        return gguf
    if convert_script is None:
        raise ValueError(f"{gguf} is not made yet: pass --convert-script (llama.cpp's convert_hf_to_gguf.py)")
    hf_dir = workdir / f"{shape}-random-hf"
    if not (hf_dir / "config.json").is_file():
        print(f"making random weights of {shape} in {hf_dir}", file=sys.stderr)
        make_random_checkpoint(shape, hf_dir)
    print(f"converting {hf_dir} with {convert_script}", file=sys.stderr)
    convert_to_gguf(convert_script, hf_dir, gguf, outtype, CONVERT_FLAGS.get(shape, []))
    return gguf


def _conversation(c: ChatShape, vocab_size: int) -> tuple[list[list[int]], list[list[list[int]]], list[list[int]]]:
    """Per user its system prompt; per user and round its question; per round the canned reply the client renders."""
    rng = random.Random(c.seed)
    low, high = min(300, vocab_size // 8), min(vocab_size, 60000) - 1  # clear of special ids at the start

    def ids(n: int) -> list[int]:
        return [rng.randrange(low, high) for _ in range(n)]

    systems = [ids(c.system_tokens) for _ in range(c.users)]
    if c.shared_system:
        systems = [systems[0]] * c.users
    questions = [[ids(c.question_tokens) for _ in range(c.rounds)] for _ in range(c.users)]
    replies = [ids(c.output_len) for _ in range(c.rounds)]
    return systems, questions, replies


async def _send(client: Any, url: str, prompt: list[int], output_len: int) -> tuple[float, int | None]:
    """Stream one completion: (seconds to the first token, prompt tokens the server says it took from its cache)."""
    start = time.perf_counter()
    ttft: float | None = None
    cached: int | None = None
    body = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: {r.status_code} {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line.strip() == "data: [DONE]":
                continue
            try:
                chunk = json.loads(line[len("data: ") :])
            except json.JSONDecodeError:
                # llama-server has written a text chunk with a broken \uXXXX escape (a random model's bytes cut inside a
                # character): it is still a token's arrival; its text does not matter here.
                ttft = ttft if ttft is not None else time.perf_counter() - start
                continue
            if ttft is None and chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                ttft = time.perf_counter() - start
            details = (chunk.get("usage") or {}).get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                cached = int(details["cached_tokens"])
            timings = chunk.get("timings") or {}
            if timings.get("cache_n") is not None:
                cached = int(timings["cache_n"])
    return (ttft if ttft is not None else time.perf_counter() - start), cached


async def _run(c: ChatShape, vocab_size: int, urls: dict[str, str]) -> dict[str, list[dict[str, Any]]]:
    import httpx

    from kvserve.bench.stats import percentile

    systems, questions, replies = _conversation(c, vocab_size)
    names = list(urls)
    out: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    async with httpx.AsyncClient(timeout=3600.0) as client:
        for r in range(c.rounds):
            prompts = []
            for u in range(c.users):
                history = list(systems[u])
                for k in range(r):
                    history += questions[u][k] + replies[k]
                prompts.append(history + questions[u][r])
            for name in names[r % len(names) :] + names[: r % len(names)]:
                sent = [_send(client, urls[name], p, c.output_len) for p in prompts]
                results = await asyncio.gather(*sent)
                ttfts = [1e3 * t for t, _ in results]
                reported = [h for _, h in results]
                total = sum(len(p) for p in prompts)
                cached = None if any(h is None for h in reported) else sum(h for h in reported if h is not None)
                out[name].append(
                    {
                        "round": r + 1,
                        "ttft_ms_p50": percentile(ttfts, 50),
                        "ttft_ms_p90": percentile(ttfts, 90),
                        "hit_rate": None if cached is None else cached / total,
                        "prompt_tokens": total,
                        "cached_tokens": cached,
                        "ttft_ms": ttfts,
                    }
                )
                print(f"round {r + 1} {name}: TTFT p50 {out[name][-1]['ttft_ms_p50']:.0f} ms", file=sys.stderr)
    return out


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = new_command(
        sub,
        "hybrid-chat",
        "hybrid models' (LFM2, Qwen3.5) prefix caching over a multi-turn chat, against llama-server on the same GGUF",
        __doc__,
        SCHEMA,
    )
    d = ChatShape()
    p.add_argument("--shape", choices=sorted(SHAPES), default="lfm2-350m", help="the published shape, random weights")
    p.add_argument(
        "--model", default=None, help="a GGUF (or, without --llama-server, any model) to use instead of making one"
    )
    p.add_argument("--workdir", default=None, help="where the random models are made (default: the kvserve cache)")
    p.add_argument("--convert-script", default=None, metavar="PATH", help="llama.cpp's convert_hf_to_gguf.py")
    p.add_argument("--outtype", default="q8_0", help="the converter's --outtype (q8_0, bf16, f32)")
    p.add_argument("--users", type=int, default=d.users)
    p.add_argument("--rounds", type=int, default=d.rounds)
    p.add_argument("--system-tokens", type=int, default=d.system_tokens)
    p.add_argument("--question-tokens", type=int, default=d.question_tokens)
    p.add_argument("--output-len", type=int, default=d.output_len)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--shared-system-prompt", action="store_true", help="one system prompt for every user")
    p.add_argument("--kv-cache-memory-bytes", default="3GiB", help="kvserve's KV budget (states come out of it)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="kvserve's token budget a step (default: its own)"
    )
    p.add_argument(
        "--max-num-partial-prefills", type=int, default=None, help="kvserve's limit on unfinished prompts after a step"
    )
    p.add_argument(
        "--activation-quantization",
        choices=ACTIVATION_QUANTIZATIONS,
        default="none",
        help="kvserve's --activation-quantization (int8: 8-bit activations, as llama.cpp's q8_0 dot products)",
    )
    p.add_argument("--llama-server", default=None, metavar="PATH", help="also llama-server on the same GGUF")
    add_output_args(p, "TTFT p50 per round, per system")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvserve.bench.machine import machine_info
    from kvserve.bench.offload_peer import LlamaServer
    from kvserve.bench.report import Report, Table, config_of, emit
    from kvserve.bench.server_process import ServerProcess
    from kvserve.bench.stats import percentile, ratio
    from kvserve.model.loader import load_model_config
    from kvserve.model.source import resolve_model
    from kvserve.model.tokenizer import default_cache_dir

    if args.plot:
        from kvserve.bench.plot import check_plot_target

        check_plot_target(args.plot)
    workdir = Path(args.workdir).expanduser() if args.workdir else default_cache_dir().expanduser() / "bench-models"
    workdir.mkdir(parents=True, exist_ok=True)
    convert = Path(args.convert_script).expanduser() if args.convert_script else None
    gguf = Path(args.model) if args.model else model_gguf(args.shape, workdir, convert, args.outtype)
    vocab_size = load_model_config(resolve_model(str(gguf))).vocab_size
    shape = ChatShape(
        args.users,
        args.rounds,
        args.system_tokens,
        args.question_tokens,
        args.output_len,
        args.seed,
        args.shared_system_prompt,
    )
    logs = Path(tempfile.mkdtemp(prefix="kvserve-bench-hybrid-chat-"))
    context = str(args.max_model_len)
    kvserve_args = [
        "--model",
        str(gguf),
        "--served-model-name",
        SERVED_NAME,
        "--kv-cache-memory-bytes",
        args.kv_cache_memory_bytes,
        "--max-model-len",
        context,
        "--max-num-seqs",
        str(max(args.users, 1)),
    ]
    if args.max_num_batched_tokens is not None:
        kvserve_args += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.max_num_partial_prefills is not None:
        kvserve_args += ["--max-num-partial-prefills", str(args.max_num_partial_prefills)]
    if args.activation_quantization != "none":
        kvserve_args += ["--activation-quantization", args.activation_quantization]
    llama_default = ["-m", str(gguf), "-c", str(args.max_model_len * args.users)]
    llama_tuned = [*llama_default, "-np", str(args.users), *LLAMA_TUNED]
    system_args: dict[str, list[str]] = {"kvserve": kvserve_args}
    servers: list[Any] = []
    try:
        kv = ServerProcess.start(kvserve_args, logs / "kvserve.log", timeout_s=900.0)
        servers.append(kv)
        urls = {"kvserve": kv.base_url}
        if args.llama_server:
            for name, llama_args in (("llama-server default", llama_default), ("llama-server tuned", llama_tuned)):
                peer = LlamaServer(args.llama_server, llama_args, logs / f"{name.replace(' ', '-')}.log")
                servers.append(peer)
                urls[name] = peer.base_url
                system_args[name] = llama_args
        rounds = asyncio.run(_run(shape, vocab_size, urls))
    finally:
        for server in servers:
            server.stop()
    systems: dict[str, dict[str, Any]] = {}
    for name, per_round in rounds.items():
        later = [t for row in per_round[1:] for t in row["ttft_ms"]]
        systems[name] = {
            "args": system_args[name],
            "rounds": per_round,
            "ttft_ms_p50_later_rounds": percentile(later, 50) if later else None,
        }
    table = Table(
        f"{args.shape} (random weights, {gguf.name}): {args.users} users x {args.rounds} rounds, "
        f"{args.system_tokens}-token system prompts{' (one shared)' if args.shared_system_prompt else ''}, "
        f"{args.question_tokens}-token questions, {args.output_len}-token replies; TTFT p50 ms / hit rate per round",
        ["system", *(f"round {r + 1}" for r in range(args.rounds)), "rounds 2+ TTFT p50 ms"],
    )
    for name, row in systems.items():
        cells = [
            f"{r['ttft_ms_p50']:.0f} / {'-' if r['hit_rate'] is None else format(r['hit_rate'], '.2f')}"
            for r in row["rounds"]
        ]
        table.add(name, *cells, row["ttft_ms_p50_later_rounds"])
    report = Report("hybrid-chat", machine_info(), config_of(args))
    report.results = {
        "shape": args.shape,
        "gguf": gguf.name,
        "workload": {
            "users": args.users,
            "rounds": args.rounds,
            "system_tokens": args.system_tokens,
            "question_tokens": args.question_tokens,
            "output_len": args.output_len,
            "shared_system_prompt": args.shared_system_prompt,
        },
        "systems": systems,
    }
    mine = systems["kvserve"]["ttft_ms_p50_later_rounds"]
    report.ratios = {
        f"ttft_p50_later_rounds_kvserve_over_{name.replace(' ', '_').replace('-', '_')}": ratio(
            mine, row["ttft_ms_p50_later_rounds"]
        )
        for name, row in systems.items()
        if name != "kvserve"
    }
    report.tables.append(table)
    emit(report, args.json)
    if args.plot:
        _plot(systems, args.plot, args.shape)
    return 0


def _plot(systems: dict[str, dict[str, Any]], path: str, shape: str) -> None:
    """TTFT p50 per round, one line per system (log scale)."""
    from kvserve.bench.plot import Panel, Series, line_plot

    series = [
        Series(name, [r["round"] for r in row["rounds"]], [r["ttft_ms_p50"] for r in row["rounds"]])
        for name, row in systems.items()
    ]
    title = f"{shape}: multi-turn chat, TTFT p50 per round"
    line_plot(path, [Panel(title, "round", "TTFT p50 ms", series, log_y=True)])
