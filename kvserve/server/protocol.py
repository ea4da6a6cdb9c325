"""Request and response bodies of the OpenAI-compatible API (plus vLLM's extra sampling fields).

Why pydantic models rather than dicts: FastAPI validates bodies against them (a wrong type becomes a
400 naming the field), and the response shapes are written down once. Request models accept unknown
fields (clients send many) so that the server can log and ignore them, as vLLM does.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
)

from kvserve.kv.hashing import check_cache_salt_length

_SCALARS = frozenset({int, float, bool, type(None)})

_T = TypeVar("_T")
# A request's list stops validating at its first bad item (pydantic's fail_fast, which applies to a list, not to a
# union holding lists: hence per list): an invalid 8 MiB body of a million items costs one error, not a million.
FastList = Annotated[list[_T], Field(fail_fast=True)]


def _not_utf8(value: Any) -> str | None:
    """Where in `value` (keys included, nested lists and dicts walked; "" for `value` itself) the first string
    is that cannot be encoded as UTF-8 (a lone surrogate, which JSON's \\ud800 escape can carry), or None.
    Nested request models are not walked: they check their own fields."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return where
        elif isinstance(item, dict):
            for key, sub in item.items():
                stack.append((key, where))
                stack.append((sub, f"{where}.{key}" if where else str(key)))
        elif isinstance(item, (list, tuple)) and not set(map(type, item)) <= _SCALARS:  # token ids: one C pass
            stack.extend((sub, f"{where}.{i}" if where else str(i)) for i, sub in enumerate(item))
    return None


def _require_utf8(value: Any) -> Any:
    """`value`, if all its text is valid UTF-8; ValueError (a 400 naming the field) otherwise."""
    where = _not_utf8(value)
    if where is not None:
        at = f" (at {where})" if where else ""
        raise ValueError(
            f"text must be valid UTF-8, but this field contains a lone surrogate{at}: an unpaired "
            "\\ud800-\\udfff escape"
        )
    return value


class StrictRequestModel(BaseModel):
    """Strict types, as OpenAI's API: an integer field takes only a JSON integer (not "5", not true), a
    number field a JSON number, a boolean field true or false; and every string, anywhere in the body, must
    be encodable as UTF-8 (a lone surrogate would fail later, in the tokenizer or the KV cache's hashing, as
    a 500 or on the engine thread). Unknown fields are kept aside in `model_extra`, not rejected, but their
    text is checked too (their names are logged)."""

    model_config = ConfigDict(extra="allow", strict=True)
    __pydantic_extra__: dict[str, Annotated[Any, AfterValidator(_require_utf8)]]

    @field_validator("*", mode="after")
    @classmethod
    def _utf8_field(cls, value: Any) -> Any:
        return _require_utf8(value)


class OpenAIRequest(StrictRequestModel):
    """Base of request bodies."""

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class StreamOptions(StrictRequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class CacheFields(OpenAIRequest):
    """The per-request prefix-cache fields, one definition for every generating endpoint (completions, chat,
    responses): `cache_salt` (vLLM's) joins the block hashes, so requests of different salts never share KV."""

    cache_salt: str | None = None
    # kvserve's: the response carries a `kv_cache` object (where the prompt's KV came from, and why a prefix hit
    # stopped short; kvserve.server.kv_report)
    include_kv_cache: bool = False
    # OpenAI's: requests with the same key are routed to the same replica while it has room (cluster/router.py) and
    # grouped by it in the KV inspector
    prompt_cache_key: str | None = Field(default=None, min_length=1, max_length=1024)
    # OpenAI's: "24h" keeps the prompt's KV blocks in the disk offload tier for 24 hours (a 400 without one);
    # "in_memory" is the default behaviour
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None

    @field_validator("cache_salt")
    @classmethod
    def _salt_not_empty(cls, value: str | None) -> str | None:
        """An empty salt would silently share the unsalted prefix cache (vLLM refuses it too); one of megabytes cost
        memory and engine time (bounded as `prompt_cache_key` is)."""
        if value == "":
            raise ValueError("cache_salt must not be empty: leave the field out for no salt")
        if value is not None:
            check_cache_salt_length(value)
        return value


class SamplingFields(CacheFields):
    """Sampling fields shared by completions and chat; None means the model's or vLLM's default."""

    model: str | None = None
    n: int = 1
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | FastList[str] | None = None
    stop_token_ids: FastList[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    spaces_between_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # Output constraints (kvserve.server.constraints): OpenAI's response_format, vLLM's structured_outputs (a
    # StructuredOutputsParams as a dict: one constraint and/or its options) and vLLM's older guided_* fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: FastList[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None


class CompletionRequest(SamplingFields):
    prompt: str | FastList[str] | FastList[int] | FastList[FastList[int]]
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def num_prompts(self) -> int:
        """How many prompts: a string or a token-id list is one; a list of strings or of token-id lists, its
        length (counted before tokenizing, so that a request with too many is refused cheaply)."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return 1
        return len(prompt)


class ChatMessage(StrictRequestModel):
    role: str
    content: str | FastList[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: FastList[dict[str, Any]] | None = None  # an assistant's calls, sent back on the next turn
    tool_call_id: str | None = None  # a `tool` message: the call it answers


class ChatCompletionRequest(SamplingFields):
    messages: FastList[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    add_generation_prompt: bool = True
    chat_template: str | None = None
    tools: FastList[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # None: true, OpenAI's default
    functions: FastList[dict[str, Any]] | None = None
    function_call: Any = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens not computed: prefix-cache hits, from the pool or the KV offload tier
    # kvserve's own: of cached_tokens, those restored from the KV offload tier (docs/KV_OFFLOAD.md); the rest were in
    # the pool. 0 without a tier.
    restored_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy logprobs: parallel lists, one entry per token (prompt tokens too with echo)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


def _now() -> int:
    return int(time.time())


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatLogprob] | None = None


def _without_none(keys: tuple[str, ...], data: dict[str, Any]) -> dict[str, Any]:
    """`data` less those of `keys` whose value is None (fields that OpenAI leaves out rather than sending null)."""
    return {k: v for k, v in data.items() if not (k in keys and v is None)}


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_none(("name", "arguments"), handler(self))


class DeltaToolCall(BaseModel):
    """One piece of a streamed call: `index` always; `id`, `type` and `function.name` in the call's first piece
    only (left out after: the openai SDK's stream accumulator would overwrite `type` with a null)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_none(("id", "type"), handler(self))


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None  # left out when the reply calls nothing

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_none(("tool_calls",), handler(self))


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_none(("tool_calls",), handler(self))


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "kvserve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(OpenAIRequest):
    """Either `prompt` (with add_special_tokens) or chat `messages` (with add_generation_prompt)."""

    model: str | None = None
    prompt: str | None = None
    messages: FastList[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    tools: FastList[dict[str, Any]] | None = None  # rendered with `messages`, as in a chat request


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIRequest):
    model: str | None = None
    tokens: FastList[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
