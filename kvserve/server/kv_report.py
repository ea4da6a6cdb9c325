"""The `kv_cache` object a response carries when its request sets `include_kv_cache: true`: where the prompt's KV
came from (pool, offload tier, computed) and, when the prefix hit stopped short of the prompt, why
(kv/misses.py).

What a client is told is its own business only. A client learns nothing about prompts it did not send beyond whole
cached blocks (what `usage.cached_tokens` tells anyway), and nothing across salts:
- a prompt seen under another `cache_salt` is reported as `never_seen` (the true reason would tell one tenant that
  another sent the same text; operators see it in the metrics and the KV inspector);
- where a prompt diverged from an earlier one is told to the token only to a request with a `cache_salt` (the
  prompts compared with are its own tenant's: the miss history is kept per salt); an unsalted request, which may be
  anyone's, is told the block (kv/misses.py whole_blocks). Otherwise one client could read another's system prompt a
  token at a time: one guess per request, padded to a block, keeping the guess whose divergence moved a token on;
- the text around a divergence is decoded from this request's own prompt.
`--kv-cache-report` changes that: `salted` (the default, as above), `blocks` (whole blocks for every request, salted
or not), `full` (to the token for every request: for a server whose clients trust each other), `off` (a 400 for
include_kv_cache).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvserve.kv.misses import PrefixMiss, tenant_view, without_operator_reasons
from kvserve.kv.pins import PinOutcome
from kvserve.server.errors import bad_request
from kvserve.server.logprobs import TokenTexts

CONTEXT_TOKENS = 8  # tokens of the request's own prompt shown either side of a divergence
KV_CACHE_REPORTS = ("salted", "blocks", "full", "off")  # --kv-cache-report


def check_kv_cache_report(policy: str) -> None:
    if policy not in KV_CACHE_REPORTS:
        raise ValueError(f"--kv-cache-report must be one of {', '.join(KV_CACHE_REPORTS)}, got {policy!r}")


def check_include_kv_cache(include_kv_cache: bool, policy: str) -> None:
    """A 400 for include_kv_cache on a server that gives no report (--kv-cache-report off)."""
    if include_kv_cache and policy == "off":
        raise bad_request(
            "include_kv_cache is turned off on this server (--kv-cache-report off)", param="include_kv_cache"
        )


def client_miss(miss: PrefixMiss, policy: str, salted: bool) -> PrefixMiss:
    """What a client may be told of its request's miss under `policy` (see the module docstring)."""
    if policy == "full" or (policy == "salted" and salted):
        return without_operator_reasons(miss)
    return tenant_view(miss)


def kv_cache_report(
    texts: TokenTexts,
    prompt: Sequence[int],
    cached_tokens: int,
    restored_tokens: int,
    miss: PrefixMiss | None,
    pins: Sequence[PinOutcome] = (),
    *,
    policy: str,
    salted: bool,
) -> dict[str, Any]:
    """The report; `pins`: what became of the request's cache_control pins (known once it finished: a streamed
    reply's last report has them, its first usually not); `policy` (--kv-cache-report) and whether the request has a
    cache_salt decide how much of the miss it is told."""
    report: dict[str, Any] = {
        "pool_tokens": cached_tokens - restored_tokens,
        "tier_tokens": restored_tokens,
        "computed_tokens": len(prompt) - cached_tokens,
        "miss": None,
        "pins": [{"num_tokens": p.num_tokens, "outcome": p.outcome, "displaced": p.displaced} for p in pins],
    }
    if miss is None:
        return report
    miss = client_miss(miss, policy, salted)
    detail: dict[str, Any] = {"reason": miss.reason, "at_token": miss.at_token}
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
