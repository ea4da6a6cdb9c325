"""The `kvserve` command: generate (and, as they land, serve, estimate, advise, bench, doctor)."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import resource
import sys
import time
from collections.abc import Sequence

from kvserve.engine_args import add_engine_args, engine_config_from_args
from kvserve.outputs import RequestOutput
from kvserve.units import KiB, format_gib


def _peak_rss_bytes() -> int:
    """Peak resident memory of this process (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KiB


def cmd_generate(args: argparse.Namespace) -> int:
    from kvserve.engine.engine import LLMEngine
    from kvserve.engine.llm import LLM
    from kvserve.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.sampling_seed,
        stop=args.stop or None,
        ignore_eos=args.ignore_eos,
        repetition_penalty=args.repetition_penalty,
        n=args.n,
    )
    start = time.perf_counter()
    engine = LLMEngine.from_config(engine_config_from_args(args))
    print(
        f"Loaded {engine.config.served_model_name} in {time.perf_counter() - start:.1f} s; "
        f"peak memory {format_gib(_peak_rss_bytes())}; {engine.core.cache_plan.describe()}",
        file=sys.stderr,
    )
    llm = LLM(engine=engine)
    prompts = args.prompt
    if args.chat:
        prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    elapsed = time.perf_counter() - start
    num_out = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    from kvserve.tools.report import emit

    doc = [
        {
            "prompt": o.prompt,
            "prompt_token_ids": o.prompt_token_ids,
            "outputs": [
                {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason} for c in o.outputs
            ],
        }
        for o in outputs
    ]
    text = _generated_text(outputs, args.echo)
    emit(doc, text, args.json)
    print(f"{num_out} tokens in {elapsed:.2f} s ({num_out / max(elapsed, 1e-9):.1f} tokens/s)", file=sys.stderr)
    return 0


def _generated_text(outputs: Sequence[RequestOutput], echo: bool) -> str:
    """One prompt and one completion: its text as it is. Several: each under a header naming its prompt (and its
    sample, with --n), so that a batch's outputs are told apart."""
    pieces = [(i, o, c) for i, o in enumerate(outputs, start=1) for c in o.outputs]
    if len(pieces) == 1:
        _, o, c = pieces[0]
        return f"{o.prompt}{c.text}" if echo else c.text
    lines = []
    for i, o, c in pieces:
        sample = f", completion {c.index + 1} of {len(o.outputs)}" if len(o.outputs) > 1 else ""
        lines.append(f"=== prompt {i} of {len(outputs)}{sample}: {o.prompt!r} ===")
        lines.append(f"{o.prompt}{c.text}" if echo else c.text)
    return "\n".join(lines)


# Modules that each define `add_parser(subparsers)`, registering one subcommand whose parser sets `func`
# (a callable taking the parsed args and returning an exit code). Heavy imports belong inside `func`.
SUBCOMMAND_MODULES: tuple[str, ...] = (
    "kvserve.tools.estimate",
    "kvserve.tools.advise",
    "kvserve.tools.doctor",
    "kvserve.server.cli",
    "kvserve.bench.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="LLM inference built around a paged KV cache")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser(
        "generate", help="generate text for one or more prompts", formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
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
    o.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="PATH",
        help="JSON output: on stdout (no PATH or -) or into PATH; a list of {prompt, prompt_token_ids, "
        "outputs: [{text, token_ids, finish_reason}]}",
    )
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)
    for module in SUBCOMMAND_MODULES:
        importlib.import_module(module).add_parser(sub)
    return parser


def _command_parser(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.ArgumentParser:
    """The (sub)command's own parser that `argv` selects: `kvserve serve ...` -> serve's, `kvserve bench serve ...`
    -> bench serve's; so that its usage, not the top level's, comes with an error about its flags."""
    for token in argv:
        actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if actions and token in actions[0].choices:
            parser = actions[0].choices[token]
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # argparse would blame the top-level parser and print its usage
        _command_parser(parser, argv).error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        if getattr(args, "plot", None):
            from kvserve.bench.plot import check_plot_target

            check_plot_target(args.plot)
        return int(args.func(args))
    except (ValueError, FileNotFoundError, NotImplementedError) as e:
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader left (`kvserve estimate --list-models | head`): stop quietly, as a Unix tool does; what is
        # still buffered goes nowhere instead of raising again when the interpreter flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
