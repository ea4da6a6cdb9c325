"""`kvserve serve`: the OpenAI-compatible server on uvicorn, with vLLM's flag names.

Only argparse at import time: `kvserve --help` must stay fast, so the engine, FastAPI and uvicorn are
imported when the command runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from kvserve.cli import add_engine_args, engine_config_from_args

logger = logging.getLogger(__name__)

DEFAULT_PORT = 8000
_API_KEY_ENVS = ("KVSERVE_API_KEY", "VLLM_API_KEY")
_LOG_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except empty ones (None): their help text says what happens without the flag."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve", help="serve a model with the OpenAI API (completions, chat, models, tokenize, metrics)",
        description="Serve a model over HTTP with the OpenAI API. With no flags: the default model "
                    f"(Gemma 3 270M) on 127.0.0.1:{DEFAULT_PORT}.",
        formatter_class=_HelpFormatter)
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as in `vllm serve MODEL` (same as --model; default: Gemma 3 270M)")
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to listen on")
    s.add_argument("--served-model-name", dest="served_model_names", nargs="+", default=None, metavar="NAME",
                   help="model name(s) accepted in requests; the first is reported (default: the model's name)")
    s.add_argument("--api-key", default=None,
                   help=f"require `Authorization: Bearer KEY` on /v1/*, /tokenize and /detokenize "
                        f"(default: ${_API_KEY_ENVS[0]} or ${_API_KEY_ENVS[1]}; none: open)")
    s.add_argument("--max-num-queued-reqs", type=int, default=1000,
                   help="requests allowed to wait for admission; beyond it new requests get 503")
    s.add_argument("--chat-history-policy", choices=["reject", "truncate"], default="reject",
                   help="a chat longer than max-model-len: reject with 400, or drop the oldest turns after "
                        "the system prompt (reported in the X-Kvserve-Truncated-Turns header)")
    s.add_argument("--max-request-body-bytes", type=int, default=8 << 20,  # body_limit's default; not imported: --help stays fast
                   help="request bodies larger than this get 413 (bounds what one client makes the server hold)")
    s.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a `chat_template` field in chat requests (rendered sandboxed, but it runs "
                        "client code on the server); by default such requests get 400")
    s.add_argument("--shutdown-grace-seconds", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, how long running requests may finish before they are aborted")
    s.add_argument("--uvicorn-log-level", choices=_LOG_LEVELS, default="info", help="uvicorn's own log level")
    add_engine_args(p)
    p.set_defaults(func=run_serve)


def resolve_api_key(flag: str | None) -> str | None:
    if flag:
        return flag
    for name in _API_KEY_ENVS:
        if os.environ.get(name):
            return os.environ[name]
    return None


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from kvserve.engine.async_engine import AsyncLLMEngine
    from kvserve.engine.engine import LLMEngine
    from kvserve.server.app import build_app
    from kvserve.server.context import ServerSettings
    from kvserve.server.uvicorn_server import GracefulServer

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    if args.max_num_queued_reqs < 0:
        raise ValueError(f"--max-num-queued-reqs must be >= 0, got {args.max_num_queued_reqs}")
    config = engine_config_from_args(args)
    names = tuple(args.served_model_names or ())
    config.served_model_name = names[0] if names else None
    engine = LLMEngine.from_config(config)
    settings = ServerSettings(
        served_model_names=names or (str(engine.config.served_model_name),),
        api_key=resolve_api_key(args.api_key),
        chat_history_policy=args.chat_history_policy,
        model_root=args.model or str(engine.config.served_model_name),
        max_request_body_bytes=args.max_request_body_bytes,
        trust_request_chat_template=args.trust_request_chat_template,
    )
    app = build_app(AsyncLLMEngine(engine, max_queued_requests=args.max_num_queued_reqs), settings)
    print(f"kvserve: serving {settings.served_model_names[0]} on http://{args.host}:{args.port} "
          f"(max-model-len {engine.max_model_len}; {engine.cache_plan.describe()})", file=sys.stderr, flush=True)
    server = GracefulServer(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
        timeout_graceful_shutdown=args.shutdown_grace_seconds))
    server.run()
    return 0 if server.started else 1
