"""The `kv_cache` object a response carries when its request sets `include_kv_cache: true`: where the prompt's KV
came from (pool, offload tier, computed) and, when the prefix hit stopped short of the prompt, why
(kv/misses.py).

What a client is told is its own business only: a prompt seen under another `cache_salt` is reported as
`never_seen` (the true reason would tell one tenant that another sent the same text; operators see it in the
metrics and the KV inspector), and the text around a divergence is decoded from this request's own prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvserve.kv.misses import PrefixMiss
from kvserve.kv.pins import PinOutcome
from kvserve.server.logprobs import TokenTexts

CONTEXT_TOKENS = 8  # tokens of the request's own prompt shown either side of a divergence
OPERATOR_ONLY = {"different_cache_salt": "never_seen"}


def kv_cache_report(
    texts: TokenTexts,
    prompt: Sequence[int],
    cached_tokens: int,
    restored_tokens: int,
    miss: PrefixMiss | None,
    pins: Sequence[PinOutcome] = (),
) -> dict[str, Any]:
    """The report; `pins`: what became of the request's cache_control pins (known once it finished: a streamed
    reply's last report has them, its first usually not)."""
    report: dict[str, Any] = {
        "pool_tokens": cached_tokens - restored_tokens,
        "tier_tokens": restored_tokens,
        "computed_tokens": len(prompt) - cached_tokens,
        "miss": None,
        "pins": [{"num_tokens": p.num_tokens, "outcome": p.outcome, "displaced": p.displaced} for p in pins],
    }
    if miss is None:
        return report
    detail: dict[str, Any] = {"reason": OPERATOR_ONLY.get(miss.reason, miss.reason), "at_token": miss.at_token}
    if miss.reason in ("evicted", "pin_expired"):
        detail["evicted_ago_s"] = miss.evicted_ago_s
        detail["evicted_blocks_since"] = miss.evicted_blocks_since
    if miss.diverged_at_token is not None:
        i = miss.diverged_at_token
        detail["diverged_at_token"] = i
        detail["before"] = texts.decode(prompt[max(0, i - CONTEXT_TOKENS) : i])
        detail["after"] = texts.decode(prompt[i : i + CONTEXT_TOKENS])
    report["miss"] = detail
    return report
