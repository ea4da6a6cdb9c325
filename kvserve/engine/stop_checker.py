"""The token-level stop conditions the engine core checks after each sampled token (vLLM v1's check_stop).

Stop strings are not here: they need text, which is the front end's (engine/output_processor.py); a stop string's
hit comes back to the core as an abort of that sequence. Everything here reads token ids and counts only."""

from __future__ import annotations

from collections.abc import Collection

from kvserve.engine.request import Request, RequestStatus


def check_stop(
    request: Request, token_id: int, eos_token_ids: Collection[int], max_model_len: int, grammar_done: bool
) -> tuple[RequestStatus, int | None] | None:
    """(status, stop token id) when `token_id`, just appended to `request`'s output, ends it; None otherwise.
    A complete grammar ends it as "stop" whatever min_tokens or ignore_eos say (its mask allows nothing but stop
    tokens from there on); EOS and stop_token_ids count once min_tokens are out; then max_tokens and the context."""
    params = request.sampling_params
    num_out = len(request.output_token_ids)
    if grammar_done:
        return RequestStatus.FINISHED_STOPPED, None
    if num_out >= params.min_tokens and not (params.ignore_eos and token_id in eos_token_ids):
        if token_id in eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, None
        if token_id in (params.stop_token_ids or ()):  # a list since SamplingParams.__post_init__
            return RequestStatus.FINISHED_STOPPED, token_id
    if (params.max_tokens is not None and num_out >= params.max_tokens) or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH, None
    return None
