"""From an API request to the engine's SamplingParams, and the checks a request must pass first.

Why check here, before the engine sees the request: a client must learn of a bad request from a 400 before
any response (or stream) starts, with a message that says what to change; and the checks that involve the
prompt's length need the tokenized prompt, which the server has first.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvserve.sampling_params import SamplingParams
from kvserve.server.errors import APIError, bad_request
from kvserve.server.protocol import CacheFields, SamplingFields

if TYPE_CHECKING:
    from kvserve.engine.facts import EngineFacts
    from kvserve.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Request fields that fall back to the checkpoint's generation_config when the request leaves them out.
_GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


RETENTION_SECONDS = {"in_memory": 0.0, "24h": 86400.0}  # OpenAI's prompt_cache_retention values


def check_retention(request: CacheFields, facts: EngineFacts) -> None:
    """A 400 for prompt_cache_retention "24h" on a server that cannot keep it: it needs a disk offload tier."""
    if request.prompt_cache_retention == "24h" and not facts.retains_prompts:
        raise bad_request(
            'prompt_cache_retention "24h" needs a disk KV offload tier: start the server with --kv-offloading-size '
            "and --kv-offloading-path (docs/PROMPT_CACHING.md)",
            param="prompt_cache_retention",
        )


def build_sampling_params(
    request: SamplingFields,
    generation_defaults: Mapping[str, Any],
    *,
    max_tokens: int | None,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    structured_outputs: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """SamplingParams for a request; ValueError (a 400) for values out of range. `structured_outputs`: the
    request's constraint, checked already (kvserve.server.constraints)."""
    defaults: dict[str, Any] = {}
    for name in _GENERATION_DEFAULTS:
        value = getattr(request, name)
        if value is None:
            value = generation_defaults.get(name)
        if value is not None:
            defaults[name] = value
    return SamplingParams(
        n=request.n,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        seed=request.seed,
        stop=request.stop,
        stop_token_ids=request.stop_token_ids,
        ignore_eos=request.ignore_eos,
        max_tokens=max_tokens,
        min_tokens=request.min_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=request.skip_special_tokens,
        include_stop_str_in_output=request.include_stop_str_in_output,
        spaces_between_special_tokens=request.spaces_between_special_tokens,
        structured_outputs=structured_outputs,
        prompt_cache_key=request.prompt_cache_key,
        prompt_cache_retention_s=RETENTION_SECONDS.get(request.prompt_cache_retention or "in_memory", 0.0),
        **defaults,
    )


def check_fits(prompt_len: int, max_tokens: int | None, max_model_len: int) -> None:
    """400 when the prompt plus the tokens asked for cannot fit in max-model-len (both numbers given)."""
    if prompt_len >= max_model_len:
        raise bad_request(
            f"This model's maximum context length (max-model-len) is {max_model_len} tokens, but the prompt has "
            f"{prompt_len} tokens and at least one token must be generated; shorten the prompt to at most "
            f"{max_model_len - 1} tokens.",
            param="prompt",
        )
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise bad_request(
            f"This model's maximum context length (max-model-len) is {max_model_len} tokens, but you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the completion); "
            f"reduce max_tokens to at most {max_model_len - prompt_len} or shorten the prompt.",
            param="max_tokens",
        )


def reject_unsupported(request: SamplingFields, fields: Mapping[str, Any], max_n: int) -> None:
    """400 for features that would change the output's meaning if ignored, and for n over `max_n` (one
    request must not queue unbounded work); log unknown fields."""
    for name, value in fields.items():
        if value:
            raise bad_request(f"{name} is not supported by this server", param=name)
    if request.logit_bias:
        raise bad_request("logit_bias is not supported by this server", param="logit_bias")
    if request.n < 1:
        raise bad_request(f"n must be at least 1, got {request.n}", param="n")
    if request.n > max_n:
        raise bad_request(f"n must be at most max-num-seqs ({max_n}), got {request.n}", param="n")
    unknown = request.unknown_fields()
    if unknown:
        logger.info("ignoring unknown request fields: %s", ", ".join(unknown))


def check_num_prompts(num_prompts: int, limit: int) -> None:
    """400 for more prompts in one request than --max-prompts-per-request: a prompt list (with n samples
    each) must not let one client fill the queue that every client shares."""
    if num_prompts > limit:
        raise bad_request(
            f"this request has {num_prompts} prompts, more than this server accepts in one request "
            f"(--max-prompts-per-request {limit}); split it into several requests",
            param="prompt",
        )


def require(condition: bool, message: str, param: str | None = None) -> None:
    if not condition:
        raise APIError(400, message, param=param)


def fits(prompt_len: int, max_tokens: int | None, max_model_len: int) -> bool:
    """Whether check_fits would pass."""
    return prompt_len < max_model_len and (max_tokens is None or prompt_len + max_tokens <= max_model_len)
