"""What every route of one app shares: the async engine, the server settings, the metrics, the engine's facts.

Why an explicit object: the app factory builds one per app and hands it to the route modules, so two
apps in one process (tests, embedding) never share state through module globals.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.server.body_limit import DEFAULT_MAX_REQUEST_BODY_BYTES
from kvserve.server.cache_diagnostics import FingerprintStore
from kvserve.server.errors import APIError
from kvserve.server.kv_report import check_kv_cache_report
from kvserve.server.response_store import ResponseStore
from kvserve.structured.tool_parsers import DEFAULT_STYLE, TOOL_PARSER_NAMES, ToolParserSpec, tool_parser

if TYPE_CHECKING:
    from kvserve.engine.client import EngineClient
    from kvserve.engine.facts import EngineFacts
    from kvserve.metrics import ServerMetrics
    from kvserve.model.chat_template import ToolPromptStyle
    from kvserve.server.logprobs import TokenTexts
    from kvserve.server.prepare import PromptPreparer

CHAT_HISTORY_POLICIES = ("reject", "truncate")
DEFAULT_MAX_PROMPTS_PER_REQUEST = 256
DEFAULT_STREAM_KEEPALIVE_S = 5.0


def check_tool_flags(enable_auto_tool_choice: bool, tool_call_parser: str | None) -> None:
    """ValueError for --enable-auto-tool-choice without a parser (as vLLM), or a parser that does not exist."""
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError(f"--enable-auto-tool-choice requires --tool-call-parser ({', '.join(TOOL_PARSER_NAMES)})")
    if tool_call_parser is not None:
        tool_parser(tool_call_parser)


def check_admin_key(api_key: str | None, admin_api_key: str | None) -> None:
    """ValueError for an admin key equal to the clients' key: it would open the operator's routes to every client."""
    if admin_api_key is not None and api_key is not None and admin_api_key.strip() == api_key.strip():
        raise ValueError("--admin-api-key must differ from --api-key: every client holds the API key")


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """Server-side options (the engine's live in EngineConfig). The first served name is the one
    reported; any of them is accepted in a request's `model` field."""

    served_model_names: tuple[str, ...]
    api_key: str | None = None
    chat_history_policy: str = "reject"  # "reject": 400 when a chat is too long; "truncate": drop old turns
    model_root: str | None = None  # where the model came from, for /v1/models
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES  # larger bodies get 413
    trust_request_chat_template: bool = False  # a request's own `chat_template` is refused unless set
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST  # a completions prompt list beyond it: 400
    enable_auto_tool_choice: bool = False  # tool_choice "auto" (the default with tools) is a 400 without it (vLLM)
    tool_call_parser: str | None = None  # reads "auto" replies' calls; its style writes tools for template-less chats
    exclude_tools_when_tool_choice_none: bool = False  # tool_choice "none": the prompt carries no tools (vLLM's flag)
    # --admin-api-key: the operator's key, which alone opens /metrics and the KV inspector's data (server/auth.py)
    admin_api_key: str | None = None
    disable_ui: bool = False  # --disable-ui: no KV inspector page (its data routes stay, behind the key)
    # --ui-redact-text / --no-ui-redact-text: the KV inspector's data carries no token ids (so no prompt text) and
    # tells misses as clients are told them; None: redacted when clients hold a key and no admin key is set
    ui_redact_text: bool | None = None
    kv_cache_report: str = "salted"  # --kv-cache-report: what include_kv_cache tells (kvserve.server.kv_report)
    # --clamp-max-tokens: max_tokens beyond the context left generates until the window is full (chat, completions,
    # Responses; the Messages API always does, as Anthropic's) instead of a 400
    clamp_max_tokens: bool = False
    # --ignore-unsupported-tools: hosted tools the server cannot run (web_search, ...) are dropped with a warning
    ignore_unsupported_tools: bool = False
    # --stream-keepalive-interval: seconds without a byte after which a stream sends a keepalive (0: never)
    stream_keepalive_s: float = DEFAULT_STREAM_KEEPALIVE_S

    def __post_init__(self) -> None:
        check_tool_flags(self.enable_auto_tool_choice, self.tool_call_parser)
        check_kv_cache_report(self.kv_cache_report)
        check_admin_key(self.api_key, self.admin_api_key)
        if not self.served_model_names:
            raise ValueError("at least one served model name is required")
        if self.max_prompts_per_request < 1:
            raise ValueError(f"--max-prompts-per-request must be >= 1, got {self.max_prompts_per_request}")
        if self.max_request_body_bytes < 1:
            raise ValueError(f"--max-request-body-bytes must be >= 1, got {self.max_request_body_bytes}")
        if not self.stream_keepalive_s >= 0:
            raise ValueError(f"--stream-keepalive-interval must be >= 0 seconds, got {self.stream_keepalive_s}")
        if self.chat_history_policy not in CHAT_HISTORY_POLICIES:
            raise ValueError(
                f"--chat-history-policy must be one of {', '.join(CHAT_HISTORY_POLICIES)}, "
                f"got {self.chat_history_policy!r}"
            )

    @property
    def redacts_ui_text(self) -> bool:
        """Whether the KV inspector's data is redacted: as asked, else when it is served to the clients' key (every
        tenant holds that one) rather than an admin key of its own."""
        if self.ui_redact_text is not None:
            return self.ui_redact_text
        return self.api_key is not None and self.admin_api_key is None

    @property
    def tool_parser(self) -> ToolParserSpec | None:
        return tool_parser(self.tool_call_parser) if self.tool_call_parser is not None else None

    @property
    def tool_style(self) -> ToolPromptStyle:
        """How tools are written into prompts whose chat template lacks them: the parser's format, else JSON."""
        parser = self.tool_parser
        return parser.style if parser is not None else DEFAULT_STYLE


@dataclass(slots=True)
class ServerContext:
    """The async engine (to submit requests to, never to read), the settings, the metrics, the engine's
    immutable facts, and the preparation thread. Handlers read limits from `facts` only: the engine itself
    belongs to its thread."""

    engine: EngineClient
    settings: ServerSettings
    metrics: ServerMetrics
    facts: EngineFacts
    preparer: PromptPreparer
    texts: TokenTexts
    responses: ResponseStore = field(default_factory=ResponseStore)  # /v1/responses' store (previous_response_id)
    # /v1/messages' opted-in prompt fingerprints (diagnostics.previous_message_id)
    fingerprints: FingerprintStore = field(default_factory=FingerprintStore)

    @property
    def max_model_len(self) -> int:
        return self.facts.max_model_len

    @property
    def model_name(self) -> str:
        return self.settings.served_model_names[0]

    def resolve_model(self, requested: str | None) -> str:
        """The model name to report; 404 for a model this server does not serve (None means ours)."""
        if requested is None or requested == "":
            return self.model_name
        if requested not in self.settings.served_model_names:
            raise APIError(
                404,
                f"The model `{requested}` does not exist; this server serves "
                f"{', '.join(repr(n) for n in self.settings.served_model_names)}.",
                param="model",
                code="model_not_found",
            )
        return requested

    @staticmethod
    def new_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"
