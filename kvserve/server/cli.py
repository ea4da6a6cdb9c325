"""`kvserve serve`: the OpenAI-compatible server on uvicorn, with vLLM's flag names.

Only argparse at import time: `kvserve --help` must stay fast, so the engine, FastAPI and uvicorn are
imported when the command runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import os
import sys
from typing import TYPE_CHECKING

from kvserve.engine_args import add_engine_args, engine_config_from_args

if TYPE_CHECKING:
    from kvserve.cluster.engine import ClusterEngine
    from kvserve.config import EngineConfig

logger = logging.getLogger(__name__)

DEFAULT_PORT = 8000
_API_KEY_ENVS = ("KVSERVE_API_KEY", "VLLM_API_KEY")
_ADMIN_API_KEY_ENV = "KVSERVE_ADMIN_API_KEY"
_LOG_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except empty ones (None): their help text says what happens without the flag."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve a model over HTTP: OpenAI's completions, chat and Responses APIs, Anthropic's Messages API, "
        "models, tokenize, metrics and the KV inspector",
        description="Serve a model over HTTP: OpenAI's API (/v1/completions, /v1/chat/completions, /v1/responses, "
        "/v1/models), Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens), vLLM's /tokenize and "
        "/detokenize, /metrics, /health and the KV inspector (/). With no flags: the default model "
        f"(Gemma 3 270M) on 127.0.0.1:{DEFAULT_PORT}.",
        formatter_class=_HelpFormatter,
    )
    p.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model, as in `vllm serve MODEL` (same as --model; default: Gemma 3 270M)",
    )
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to listen on")
    s.add_argument(
        "--served-model-name",
        dest="served_model_names",
        nargs="+",
        default=None,
        metavar="NAME",
        help="model name(s) accepted in requests; the first is reported (default: the model's name)",
    )
    s.add_argument(
        "--api-key",
        default=None,
        help=f"require `Authorization: Bearer KEY` (or Anthropic's `x-api-key: KEY`) on every route but /health, "
        f"/version and /metrics "
        f"(/v1/*, /tokenize, /detokenize, /docs, /redoc, /openapi.json), checked before the "
        f"body is read (default: ${_API_KEY_ENVS[0]} or ${_API_KEY_ENVS[1]}; none: open; an "
        f"empty key is an error)",
    )
    s.add_argument(
        "--max-num-queued-reqs",
        type=int,
        default=1000,
        help="sequences (prompts x n) allowed to wait for admission; a request that would go beyond "
        "it gets 503 (400 if it alone is larger)",
    )
    s.add_argument(
        "--max-prompts-per-request",
        type=int,
        default=256,  # = context.DEFAULT_MAX_PROMPTS_PER_REQUEST
        help="prompts one completions request may list; more get 400",
    )
    s.add_argument(
        "--chat-history-policy",
        choices=["reject", "truncate"],
        default="reject",
        help="a chat longer than max-model-len: reject with 400, or drop the oldest turns after "
        "the system prompt (reported in the X-Kvserve-Truncated-Turns header)",
    )
    s.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=8 << 20,  # body_limit's (not imported: fast --help)
        help="request bodies larger than this get 413 (bounds what one client makes the server hold)",
    )
    # The defaults below are transport.TransportLimits' (not imported: it imports uvicorn, and --help stays fast).
    s.add_argument(
        "--timeout-keep-alive",
        type=int,
        default=5,
        metavar="SECONDS",
        help="close a keep-alive connection idle this long between requests",
    )
    s.add_argument(
        "--timeout-header-read",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="close a connection that has not sent a request's complete headers this long after "
        "connecting or after its previous response (slow clients, slowloris)",
    )
    s.add_argument(
        "--timeout-body-read",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="a request body not complete this long after its headers gets 408 and the connection is closed",
    )
    s.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept a `chat_template` field in chat requests (rendered sandboxed, but it runs "
        "client code on the server); by default such requests get 400",
    )
    s.add_argument(
        "--shutdown-grace-seconds",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, how long running requests may finish; then each is aborted with a "
        "503 (a stream: an error frame and [DONE])",
    )
    s.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide whether to call tools (tool_choice "auto", the default when a '
        "request has tools; a 400 without this flag), reading its calls with --tool-call-parser",
    )
    s.add_argument(
        "--tool-call-parser",
        default=None,
        metavar="NAME",
        help="how the model writes tool calls, as vLLM names them: hermes (Hermes / Qwen "
        "<tool_call> JSON), pythonic (Gemma 3's and Llama 3.2's Python call list; alias gemma3), qwen3_coder "
        "(Qwen3-Coder's and Qwen3.5's <tool_call><function=...> XML); "
        "also the format in which tools are described to a chat template that lacks tool support",
    )
    s.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        help='render a request with tool_choice "none" without its tools (vLLM\'s flag): a small model then '
        "answers from a tool result instead of calling again; the prompt no longer shares the tool turns' prefix",
    )
    s.add_argument(
        "--clamp-max-tokens",
        action="store_true",
        help="max_tokens beyond the context left after the prompt generates until the context window is full "
        "(finish_reason length) instead of a 400, on chat, completions and Responses; the Messages API always "
        "does (stop_reason model_context_window_exceeded, as Anthropic's)",
    )
    s.add_argument(
        "--ignore-unsupported-tools",
        action="store_true",
        help="drop hosted tools the server cannot run (Responses' web_search, file_search, ...; Anthropic's server "
        "tools) from the prompt with a warning, instead of a 400 naming this flag (Codex sends web_search)",
    )
    s.add_argument(
        "--stream-keepalive-interval",
        type=float,
        default=5.0,  # = context.DEFAULT_STREAM_KEEPALIVE_S
        metavar="SECONDS",
        help="a stream that has sent nothing for this long (a long prompt being computed) sends a keepalive: an "
        "SSE comment, an Anthropic ping event on /v1/messages (0: never)",
    )
    s.add_argument(
        "--disable-ui",
        action="store_true",
        help="do not serve the KV inspector page at / and /ui (its data routes /v1/kv/* stay)",
    )
    s.add_argument(
        "--admin-api-key",
        default=None,
        help=f"the operator's key (default: ${_ADMIN_API_KEY_ENV}): /metrics and the KV inspector's data (/v1/kv/*) "
        "then need it (the --api-key does not open them: every tenant holds that one), /metrics counts the "
        "miss reasons only operators may see (different_cache_salt), and the inspector shows prompt text; it "
        "opens every other route too (give it to `kvserve doctor --api-key`). Without it /metrics is open and "
        "the inspector's data needs the --api-key",
    )
    s.add_argument(
        "--ui-redact-text",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the KV inspector's data (/v1/kv/*) carries no token ids, so no prompt text, and tells prefix misses as "
        "clients are told them (default: on when --api-key is set without an --admin-api-key, since every client "
        "holds that key; off otherwise)",
    )
    s.add_argument(
        "--kv-cache-report",
        choices=["salted", "blocks", "full", "off"],  # = kv_report.KV_CACHE_REPORTS (not imported: fast --help)
        default="salted",
        help="what a request's include_kv_cache report tells about where its prompt diverged from earlier ones: "
        "salted: to the token for a request with a cache_salt (its own tenant's prompts), in whole blocks for an "
        "unsalted one (anyone's); blocks: whole blocks for every request; full: to the token for every request "
        "(clients that trust each other); off: include_kv_cache is a 400 (docs/PROMPT_CACHING.md)",
    )
    s.add_argument("--uvicorn-log-level", choices=_LOG_LEVELS, default="info", help="uvicorn's own log level")
    d = p.add_argument_group("scale-out (needs `pip install -e '.[cluster]'`, see docs/SCALE_OUT.md)")
    d.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        metavar="N",
        help="serve N engine replicas on Ray behind this one endpoint (1: one process, no Ray)",
    )
    d.add_argument(
        "--data-parallel-backend",
        choices=["ray"],
        default="ray",
        help="what runs the replicas (vLLM's flag; Ray is the one kvserve has)",
    )
    d.add_argument(
        "--ray-address",
        default=None,
        help="join this Ray cluster (as `ray start --address`); default: $RAY_ADDRESS, else a local "
        "Ray instance started for this server",
    )
    d.add_argument(
        "--router",
        choices=["prefix_aware", "least_loaded", "round_robin"],
        default="prefix_aware",
        help="how requests are spread over the replicas: prefix_aware sends a request to the replica "
        "whose prefix cache holds most of its prompt, unless that replica is much busier",
    )
    add_engine_args(p)
    p.set_defaults(func=run_serve)


def resolve_api_key(
    flag: str | None, flag_name: str = "--api-key", envs: tuple[str, ...] = _API_KEY_ENVS
) -> str | None:
    """The key from the flag, else the first of `envs` set ($KVSERVE_API_KEY, else $VLLM_API_KEY for --api-key);
    None when none is. A given but empty key is a ValueError (exit 2): it would silently serve without one."""
    given = [(flag_name, flag)] if flag is not None else []
    given += [(f"${name}", os.environ[name]) for name in envs if name in os.environ]
    if not given:
        return None
    source, key = given[0]
    if not key.strip():
        raise ValueError(
            f"{source} is empty, which would serve without authentication: give a non-empty key, "
            f"or unset it to serve openly"
        )
    return key.strip()


def launch_cluster(config: "EngineConfig", args: argparse.Namespace) -> "ClusterEngine":
    """--data-parallel-size N > 1: N replicas on Ray; a clear error when Ray is not installed."""
    if importlib.util.find_spec("ray") is None:  # not imported here: kvserve sets Ray's auth mode before it is
        raise ValueError(
            "--data-parallel-size > 1 runs replicas on Ray, which is not installed: pip install -e '.[cluster]'"
        )
    from kvserve.cluster.engine import ClusterEngine

    return ClusterEngine.launch(
        config,
        args.data_parallel_size,
        router_policy=args.router,
        ray_address=args.ray_address,
        max_queued_requests=args.max_num_queued_reqs,
    )


def run_serve(args: argparse.Namespace) -> int:
    from kvserve.engine.async_engine import AsyncLLMEngine, build_for_engine_thread
    from kvserve.engine.client import EngineClient
    from kvserve.server.app import build_app
    from kvserve.server.context import ServerSettings, check_admin_key, check_tool_flags
    from kvserve.server.transport import ServerConfig, TransportLimits
    from kvserve.server.uvicorn_server import GracefulServer

    api_key = resolve_api_key(args.api_key)  # before the model loads: a refused key fails at once
    admin_api_key = resolve_api_key(args.admin_api_key, "--admin-api-key", (_ADMIN_API_KEY_ENV,))
    check_admin_key(api_key, admin_api_key)
    check_tool_flags(args.enable_auto_tool_choice, args.tool_call_parser)  # so do bad tool flags
    transport = TransportLimits(
        timeout_keep_alive=args.timeout_keep_alive,
        timeout_header_read=args.timeout_header_read,
        timeout_body_read=args.timeout_body_read,
    )
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    if args.max_num_queued_reqs < 0:
        raise ValueError(f"--max-num-queued-reqs must be >= 0, got {args.max_num_queued_reqs}")
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    names = tuple(args.served_model_names or ())
    config = engine_config_from_args(args)
    events = config.kv_events_config  # its `tcp://*` binds what the server listens on (--host), not every interface
    config = dataclasses.replace(
        config,
        served_model_name=names[0] if names else None,
        kv_events_config=None if events is None else events.listening_on(args.host),
    )
    async_engine: EngineClient
    if args.data_parallel_size > 1:
        async_engine = launch_cluster(config, args)
        served_name = str(async_engine.facts.served_model_name)
        description = f"{args.data_parallel_size} replicas on Ray, router {args.router}"
    else:
        engine = build_for_engine_thread(config)
        async_engine = AsyncLLMEngine(engine, max_queued_requests=args.max_num_queued_reqs)
        served_name = str(engine.config.served_model_name)
        description = engine.core.cache_plan.describe()
    settings = ServerSettings(
        served_model_names=names or (served_name,),
        api_key=api_key,
        chat_history_policy=args.chat_history_policy,
        model_root=args.model or served_name,
        max_request_body_bytes=args.max_request_body_bytes,
        trust_request_chat_template=args.trust_request_chat_template,
        max_prompts_per_request=args.max_prompts_per_request,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
        disable_ui=args.disable_ui,
        admin_api_key=admin_api_key,
        ui_redact_text=args.ui_redact_text,
        kv_cache_report=args.kv_cache_report,
        clamp_max_tokens=args.clamp_max_tokens,
        ignore_unsupported_tools=args.ignore_unsupported_tools,
        stream_keepalive_s=args.stream_keepalive_interval,
    )
    app = build_app(async_engine, settings, transport)
    print(
        f"kvserve: serving {settings.served_model_names[0]} on http://{args.host}:{args.port} "
        f"(max-model-len {async_engine.facts.max_model_len}; {description})",
        file=sys.stderr,
        flush=True,
    )
    server = GracefulServer(
        ServerConfig(
            app,
            transport,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            timeout_graceful_shutdown=args.shutdown_grace_seconds,
        ),
        on_grace_expired=async_engine.stop,
    )
    server.run()
    return 0 if server.started else 1
