"""What every route of one app shares: the async engine, the server settings, the metrics.

Why an explicit object: the app factory builds one per app and hands it to the route modules, so two
apps in one process (tests, embedding) never share state through module globals.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.server.body_limit import DEFAULT_MAX_REQUEST_BODY_BYTES
from kvserve.server.errors import APIError, bad_request
from kvserve.server.logprobs import TokenTexts

if TYPE_CHECKING:
    from kvserve.engine.async_engine import AsyncLLMEngine
    from kvserve.engine.engine import LLMEngine
    from kvserve.metrics import ServerMetrics
    from kvserve.model.tokenizer import Tokenizer

CHAT_HISTORY_POLICIES = ("reject", "truncate")


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

    def __post_init__(self) -> None:
        if not self.served_model_names:
            raise ValueError("at least one served model name is required")
        if self.max_request_body_bytes < 1:
            raise ValueError(f"--max-request-body-bytes must be >= 1, got {self.max_request_body_bytes}")
        if self.chat_history_policy not in CHAT_HISTORY_POLICIES:
            raise ValueError(f"--chat-history-policy must be one of {', '.join(CHAT_HISTORY_POLICIES)}, "
                             f"got {self.chat_history_policy!r}")


def max_prompt_chars(tokenizer: Tokenizer, max_model_len: int) -> int:
    """Text longer than this cannot fit in max_model_len tokens: no token covers more characters than
    the longest vocabulary entry (x2 for normalizers that compose characters). Tokenizing runs on the
    event loop at ~1 us per character, so a multi-megabyte prompt would stall every connection."""
    longest = max((len(t) for t in tokenizer.vocab()), default=1)
    return max_model_len * max(longest, 1) * 2


@dataclass(slots=True)
class ServerContext:
    engine: AsyncLLMEngine
    settings: ServerSettings
    metrics: ServerMetrics
    texts: TokenTexts = field(init=False)
    max_prompt_chars: int = field(init=False)

    def __post_init__(self) -> None:
        self.texts = TokenTexts(self.tokenizer)
        self.max_prompt_chars = max_prompt_chars(self.tokenizer, self.max_model_len)

    def check_prompt_chars(self, text: str, param: str = "prompt") -> None:
        """400 for text that cannot fit in max-model-len tokens, before spending seconds tokenizing it."""
        if len(text) > self.max_prompt_chars:
            raise bad_request(
                f"The prompt has {len(text)} characters, more than max-model-len ({self.max_model_len} tokens) "
                f"can hold with this tokenizer (at most {self.max_prompt_chars} characters); shorten it.",
                param=param)

    @property
    def core(self) -> LLMEngine:
        """The engine itself, for its immutable facts (tokenizer, limits); never to drive it."""
        return self.engine.engine

    @property
    def tokenizer(self) -> Tokenizer:
        return self.core.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def model_name(self) -> str:
        return self.settings.served_model_names[0]

    def resolve_model(self, requested: str | None) -> str:
        """The model name to report; 404 for a model this server does not serve (None means ours)."""
        if requested is None or requested == "":
            return self.model_name
        if requested not in self.settings.served_model_names:
            raise APIError(404, f"The model `{requested}` does not exist; this server serves "
                                f"{', '.join(repr(n) for n in self.settings.served_model_names)}.",
                           param="model", code="model_not_found")
        return requested

    @staticmethod
    def new_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"
