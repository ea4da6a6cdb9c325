"""doctor's diagnoses: each check reads measured values (scrapes of /metrics, an optional probe) and returns a
finding with the numbers that triggered it and the fix, or nothing. Thresholds are data, not constants in code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from kvserve.tools.metrics_snapshot import Snapshot, Window, windows
from kvserve.units import GiB
from kvserve.vocab import is_8bit_kv_dtype


@dataclass(frozen=True, slots=True)
class Thresholds:
    growth_factor: float = 1.5  # prompt length and prefill time both grow at least this much across the scrapes
    min_trend_windows: int = 4  # windows of strictly rising prompt length that make a trend (not chance)
    queue_wait_s: float = 1.0  # mean wait for admission (s) that counts as queueing
    near_limit: float = 0.5  # mean prompt length as a share of max-model-len that means "history grows unbounded"
    kv_full: float = 0.9  # kv_cache_usage_perc at or above this is "near full"
    slow_decode_s: float = 0.05  # mean inter-token latency (s) that counts as slow decode
    small_batch: float = 4  # running requests at or below this is a small batch
    large_context_tokens: int = 4096  # cached tokens per running request that make decode bandwidth-bound
    low_hit_rate: float = 0.1
    min_prefix_queries: float = 1000  # prompt tokens looked up before a hit rate means anything
    concurrency_slowdown: float = 2.0  # probe: latency at the highest concurrency over latency alone
    # Speculative decoding: accepted / drafted tokens below this leave little or none of the gain. A verifying step
    # costs 1.34x a plain one at batch 1 and 1.77x at batch 2 on a CPU (docs/SPECULATIVE.md), so with k = 4 drafts
    # the break-even is 9% / 19% accepted; 30% leaves room for drafting's own overhead and the step-time noise.
    low_spec_acceptance: float = 0.3
    min_spec_draft_tokens: float = 200  # drafted tokens before an acceptance rate means anything
    # Prompt tokens that missed only because the pool had just evicted them, as a share of those looked up: past it,
    # an offload tier (or a larger one) would have kept a noticeable share of the prefill.
    evicted_miss_share: float = 0.1
    offload_full: float = 0.9  # kv_offload_bytes / kv_offload_capacity_bytes at or above this is a full tier
    min_restored_blocks: float = 20  # restored blocks before a restore rate means anything
    # Prefix misses (kv/misses.py): requests whose hit stopped short before their reasons mean anything, and the share
    # of them one fixable reason must explain to be reported.
    min_miss_requests: float = 20
    miss_reason_share: float = 0.3


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """What `doctor --probe` measured itself."""

    ttft_by_prompt_len: list[tuple[int, float]]  # (prompt tokens, seconds to the first token)
    latency_by_concurrency: list[tuple[int, float, float]]  # (concurrency, mean latency s, s per output token)

    @property
    def slowdown(self) -> float | None:
        rows = self.latency_by_concurrency
        return rows[-1][1] / rows[0][1] if len(rows) > 1 and rows[0][1] > 0 else None


@dataclass(frozen=True, slots=True)
class Finding:
    code: str
    summary: str
    evidence: dict[str, Any]
    fix: str


@dataclass(frozen=True, slots=True)
class Evidence:
    snapshots: list[Snapshot]
    probe: ProbeResult | None = None
    windows: list[Window] = field(init=False)

    def __post_init__(self) -> None:
        if not self.snapshots:
            raise ValueError("doctor needs at least one /metrics scrape")
        object.__setattr__(self, "windows", windows(self.snapshots))

    @property
    def last(self) -> Snapshot:
        return self.snapshots[-1]

    def busy_windows(self) -> list[Window]:
        return [w for w in self.windows if w.requests > 0]

    def max_of(self, name: str) -> float | None:
        values = [v for v in (s.get(name) for s in self.snapshots) if v is not None]
        return max(values) if values else None

    def overall(self) -> Window:
        """One window over all the scrapes (since the server started, with one scrape)."""
        if len(self.snapshots) == 1:
            return self.windows[0]
        return Window.between(self.snapshots[0], self.snapshots[-1])

    def preemptions(self) -> float:
        """Preemptions during the scrapes (or since start, with one scrape)."""
        return sum(w.preemptions for w in self.windows)


Check = Callable[[Evidence, Thresholds], Finding | None]


def check_growing_prompts(ev: Evidence, th: Thresholds) -> Finding | None:
    trend = _prompt_trend(ev, th)
    if trend is not None:
        return trend
    busy = [w for w in ev.busy_windows() if w.prompt_len_mean and w.ttft_mean]
    max_len = ev.last.config_int("max_model_len")
    if busy and max_len:
        mean = busy[-1].prompt_len_mean
        assert mean is not None
        if mean >= th.near_limit * max_len:
            return _growth_finding(
                {
                    "prompt_len_mean": round(mean, 1),
                    "max_model_len": max_len,
                    "ttft_mean_s": round(busy[-1].ttft_mean or 0.0, 4),
                },
                f"prompts average {mean:.0f} tokens, {100 * mean / max_len:.0f}% of max-model-len {max_len}",
            )
    return None


def _prompt_trend(ev: Evidence, th: Thresholds) -> Finding | None:
    """Prompts that grow window after window, with the time from admission to the first token growing too.

    Why so strict: random-length traffic makes two windows differ by 2x by chance, and a queue raises TTFT
    whatever the prompts are; only a sustained rise, with the prefill part of TTFT (queue time taken out)
    rising with it, says that conversations keep growing."""
    busy = [w for w in ev.busy_windows() if w.prompt_len_mean and w.compute_mean]
    if len(busy) < th.min_trend_windows:
        return None
    prompts = [w.prompt_len_mean or 0.0 for w in busy]
    computes = [w.compute_mean or 0.0 for w in busy]
    if not all(b > a for a, b in pairwise(prompts)):
        return None
    if prompts[-1] < th.growth_factor * prompts[0] or computes[-1] < th.growth_factor * computes[0]:
        return None
    evidence: dict[str, Any] = {
        "prompt_len_mean_by_window": [round(p, 1) for p in prompts],
        "ttft_mean_s_by_window": [round(w.ttft_mean or 0.0, 4) for w in busy],
        "prefill_mean_s_by_window": [round(c, 4) for c in computes],
    }
    if all(w.queue_mean is not None for w in busy):
        evidence["queue_time_mean_s_by_window"] = [round(w.queue_mean or 0.0, 4) for w in busy]
    return _growth_finding(
        evidence,
        f"mean prompt length grew {prompts[-1] / prompts[0]:.1f}x over {len(busy)} "
        f"windows in a row and the time from admission to the first token grew "
        f"{computes[-1] / computes[0]:.1f}x with it",
    )


def _growth_finding(evidence: dict[str, Any], what: str) -> Finding:
    return Finding(
        "growing_prompts",
        f"Time to first token grows with prompt length: {what}.",
        evidence,
        "Conversations are growing without bound. Truncate or summarize old turns (kvserve serve "
        "--chat-history-policy truncate drops the oldest turns after the system prompt), and keep the "
        "start of each prompt identical turn to turn so earlier turns are prefix-cache hits.",
    )


def check_kv_pressure(ev: Evidence, th: Thresholds) -> Finding | None:
    usage = ev.max_of("kv_cache_usage_perc")
    preempted = ev.preemptions()
    if usage is None or usage < th.kv_full or preempted <= 0:
        return None
    evidence: dict[str, Any] = {
        "kv_cache_usage_perc_max": round(usage, 3),
        "preemptions": preempted,
        "num_requests_running_max": ev.max_of("num_requests_running"),
        "num_requests_waiting_max": ev.max_of("num_requests_waiting"),
    }
    climb = ""
    if ev.probe is not None and ev.probe.slowdown is not None:
        evidence["probe_latency_slowdown"] = round(ev.probe.slowdown, 2)
        if ev.probe.slowdown >= th.concurrency_slowdown:
            climb = (
                f"; latency at concurrency {ev.probe.latency_by_concurrency[-1][0]} is "
                f"{ev.probe.slowdown:.1f}x that of one request"
            )
    config = ev.last.cache_config
    layout = ""
    if config.get("hybrid_kv_cache_manager", "").lower() == "false" and config.get(
        "sliding_window_layers", "0"
    ) not in (
        "",
        "0",
    ):
        evidence["sliding_window_layers"] = int(config["sliding_window_layers"])
        layout = (
            f"First, this model has {config['sliding_window_layers']} sliding-window layers whose out-of-window "
            "blocks the server keeps (--disable-hybrid-kv-cache-manager): without that flag they go back to the "
            "pool as requests advance (Gemma 3: about 5x the requests of max-model-len; `kvserve estimate` shows "
            "both layouts). "
        )
    return Finding(
        "kv_cache_pressure",
        f"The KV cache is near full ({100 * usage:.0f}% used) and {preempted:.0f} requests were preempted{climb}.",
        evidence,
        layout + "Lower --max-num-seqs so running requests fit without preemption, raise the KV budget "
        "(--kv-cache-memory-bytes / --gpu-memory-utilization), or use an 8-bit KV dtype "
        "(--kv-cache-dtype fp8) for about twice the tokens; `kvserve advise` sizes these.",
    )


def check_queueing(ev: Evidence, th: Thresholds) -> Finding | None:
    """Requests wait seconds for admission: a server in that state is never healthy, whatever the cause."""
    usage = ev.max_of("kv_cache_usage_perc")
    if usage is not None and usage >= th.kv_full and ev.preemptions() > 0:
        return None  # kv_cache_pressure names this queue's cause and its fix
    wait = _queue_wait(ev)
    if wait is None or wait[0] < th.queue_wait_s:
        return None
    seconds, source = wait
    peak = max(ev.snapshots, key=lambda snap: snap.running or 0.0)
    running = peak.running or 0.0
    evidence: dict[str, Any] = {
        "queue_time_mean_s": round(seconds, 4),
        "queue_time_source": source,
        "num_requests_waiting_max": ev.max_of("num_requests_waiting"),
        "num_requests_running_max": running,
        "kv_cache_usage_perc_max": None if usage is None else round(usage, 4),
    }
    if usage is not None and usage >= th.kv_full:
        evidence["limited_by"] = "kv_cache"
        return Finding(
            "requests_queued",
            f"Requests wait {seconds:.1f} s on average to be admitted because the KV cache is full "
            f"({100 * usage:.0f}% used).",
            evidence,
            "Raise the KV budget (--kv-cache-memory-bytes / --gpu-memory-utilization), use an 8-bit KV "
            "dtype (--kv-cache-dtype fp8) for about twice the tokens, or add replicas; `kvserve advise` "
            "sizes these.",
        )
    evidence["limited_by"] = "max_num_seqs"
    room = ""
    if peak.kv_usage:
        fits = int(round(running * th.kv_full / peak.kv_usage, 6))  # round first: 2 x 0.9 / 0.004 is 450, not 449
        evidence["requests_that_fit_estimate"] = fits
        room = (
            f"; at the peak, {running:.0f} running requests used {100 * peak.kv_usage:.1f}% of it (about "
            f"{fits} such requests would fit)"
        )
    used = "" if usage is None else f" ({100 * usage:.1f}% used at most)"
    return Finding(
        "requests_queued",
        f"Requests wait {seconds:.1f} s on average to be admitted while the KV cache has room{used}: "
        f"the running batch, not memory, is the limit{room}.",
        evidence,
        "Raise --max-num-seqs (the cap on running requests) so more requests share each step, or add "
        "replicas; with long prompts, also check --max-num-batched-tokens.",
    )


def _queue_wait(ev: Evidence) -> tuple[float, str] | None:
    """Mean wait for admission over the scrapes, and where it was read: the queue-time histogram (TTFT on a server
    without one), or the standing queue the gauges show (_standing_queue), whichever says more."""
    overall = ev.overall()
    found: tuple[float, str] | None = None
    if overall.queue_mean is not None:
        found = overall.queue_mean, "request_queue_time_seconds"
    elif overall.ttft_mean is not None and ev.max_of("num_requests_waiting"):
        found = overall.ttft_mean, "time_to_first_token_seconds (no queue-time histogram)"  # TTFT bounds the wait
    standing = _standing_queue(ev)
    if standing is not None and (found is None or standing[0] > found[0]):
        return standing
    return found


def _standing_queue(ev: Evidence) -> tuple[float, str] | None:
    """The wait a queue that stood through every scrape implies, from the gauges and the clock, never from how fast
    requests run: the histograms are observed as requests finish, so on a busy or shared host, where few finish
    between scrapes, they say little or nothing (doctor called such a server healthy, twice). With requests waiting
    at every scrape, Little's law gives the mean wait: requests waiting (on average) x the time covered / the
    requests that finished in it; when none finished, none was admitted either (a slot frees only when a request
    ends), so those waiting waited the whole time covered at least. Needs scrapes taken by doctor itself (saved
    ones carry no time)."""
    snaps = ev.snapshots
    span = snaps[-1].time - snaps[0].time
    waiting = [s.get("num_requests_waiting") or 0.0 for s in snaps]
    if len(snaps) < 2 or span <= 0 or min(waiting) <= 0:
        return None
    finished = max(
        (snaps[-1].get(name) or 0.0) - (snaps[0].get(name) or 0.0)
        for name in ("request_queue_time_seconds_count", "e2e_request_latency_seconds_count")
    )
    if finished <= 0:
        return (
            span,
            f"num_requests_waiting: requests waited through all {len(snaps)} scrapes ({span:.1f} s), none ended",
        )
    mean_waiting = sum(waiting) / len(waiting)
    return mean_waiting * span / finished, (
        f"num_requests_waiting: {mean_waiting:.1f} waiting at every scrape over {span:.1f} s while {finished:.0f} "
        "requests ended (Little's law)"
    )


def check_bandwidth_bound(ev: Evidence, th: Thresholds) -> Finding | None:
    dtype = ev.last.cache_config.get("kv_cache_dtype", "")
    if is_8bit_kv_dtype(dtype):
        return None
    busy = [w for w in ev.busy_windows() if w.itl_mean is not None]
    itl = busy[-1].itl_mean if busy else None
    source = "inter_token_latency_seconds"
    if itl is None and ev.probe is not None and ev.probe.latency_by_concurrency:
        itl, source = ev.probe.latency_by_concurrency[0][2], "probe at concurrency 1"
    num_blocks, block_size = ev.last.config_int("num_blocks"), ev.last.config_int("block_size")
    peak = max(ev.snapshots, key=lambda s: s.running or 0.0)
    running = peak.running or 0.0
    if itl is None or itl < th.slow_decode_s or not num_blocks or not block_size or peak.kv_usage is None:
        return None
    if running > th.small_batch or running < 1:
        return None
    tokens_per_request = peak.kv_usage * num_blocks * block_size / running
    if tokens_per_request < th.large_context_tokens:
        return None
    return Finding(
        "memory_bandwidth_bound",
        f"Decode is slow ({1000 * itl:.0f} ms per token) with only {running:.0f} running requests holding "
        f"about {tokens_per_request:.0f} cached tokens each: each step is bound by reading the KV cache.",
        {
            "itl_mean_s": round(itl, 4),
            "itl_source": source,
            "num_requests_running": running,
            "cached_tokens_per_request": round(tokens_per_request),
            "kv_cache_dtype": dtype or None,
        },
        "Use an 8-bit KV dtype (--kv-cache-dtype fp8 or int8): it halves the bytes read per decode step "
        "next to 16-bit KV (a quarter of fp32).",
    )


def check_prefix_hits(ev: Evidence, th: Thresholds) -> Finding | None:
    if ev.last.cache_config.get("enable_prefix_caching", "").lower() in ("false", "0"):
        return Finding(
            "prefix_caching_off",
            "Prefix caching is off, so shared prompt prefixes are recomputed.",
            {"enable_prefix_caching": ev.last.cache_config["enable_prefix_caching"]},
            "Start the server with --enable-prefix-caching (the default).",
        )
    queries = sum(w.prefix_queries for w in ev.windows)
    hits = sum(w.prefix_hits for w in ev.windows)
    if queries < th.min_prefix_queries or hits / queries >= th.low_hit_rate:
        return None
    return Finding(
        "low_prefix_hit_rate",
        f"The prefix cache hit rate is {100 * hits / queries:.1f}% ({hits:.0f} of {queries:.0f} prompt tokens).",
        {"prefix_cache_queries": queries, "prefix_cache_hits": hits, "hit_rate": round(hits / queries, 4)},
        "If your prompts share a system prompt, their beginnings still differ: something varying "
        "(a timestamp, a user id, a request id) sits before the shared part. Move the varying parts to "
        "the end of the prompt so the shared prefix is byte-identical.",
    )


def check_spec_acceptance(ev: Evidence, th: Thresholds) -> Finding | None:
    """Speculation is on (tokens were drafted) but few drafted tokens are accepted: verification costs more than
    it saves. Over the scrapes (or since start, with one scrape)."""
    first = ev.snapshots[0] if len(ev.snapshots) > 1 else None

    def delta(name: str) -> float:
        return (ev.last.get(name) or 0.0) - ((first.get(name) or 0.0) if first is not None else 0.0)

    drafted = delta("spec_decode_num_draft_tokens_total")
    accepted = delta("spec_decode_num_accepted_tokens_total")
    drafts = delta("spec_decode_num_drafts_total")
    if drafted < th.min_spec_draft_tokens or accepted / drafted >= th.low_spec_acceptance:
        return None
    rate = accepted / drafted
    evidence: dict[str, Any] = {
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "drafts": drafts,
        "acceptance_rate": round(rate, 4),
    }
    name = "spec_decode_num_accepted_tokens_per_pos_total"
    per_pos = ev.last.by_int_label(name, "position")
    if per_pos and drafts > 0:  # share of drafts accepted at each draft position (vLLM's per-position rate)
        before = first.by_int_label(name, "position") if first is not None else {}
        evidence["acceptance_by_position"] = [
            round((per_pos[i] - before.get(i, 0.0)) / drafts, 4) for i in sorted(per_pos)
        ]
    return Finding(
        "low_spec_acceptance",
        f"Speculative decoding accepts only {100 * rate:.1f}% of drafted tokens ({accepted:.0f} of "
        f"{drafted:.0f}, threshold {100 * th.low_spec_acceptance:.0f}%): verifying drafts costs more than "
        "it saves.",
        evidence,
        "Lower num_speculative_tokens in --speculative-config (acceptance_by_position shows where drafts "
        "stop being kept), raise prompt_lookup_min so only longer n-gram matches draft, or turn "
        "speculation off (drop --speculative-config) for open-ended traffic, which rarely repeats its "
        "prompt.",
    )


def check_offload(ev: Evidence, th: Thresholds) -> Finding | None:
    """Prefix hits lost to the pool's evictions (no tier, or a full one), and restores slower than recomputing."""
    first = ev.snapshots[0] if len(ev.snapshots) > 1 else None

    def delta(name: str) -> float:
        return (ev.last.get(name) or 0.0) - ((first.get(name) or 0.0) if first is not None else 0.0)

    capacity = ev.last.get("kv_offload_capacity_bytes")
    block_size = ev.last.config_int("block_size") or 16
    restored = delta("kv_offload_restored_blocks_total")
    restore_s = delta("kv_offload_restore_seconds_sum")
    computed = delta("prompt_tokens_total")
    prefill_s = delta("request_prefill_time_seconds_sum")
    if capacity and restored >= th.min_restored_blocks and computed > 0 and prefill_s > 0:
        per_block = restore_s / restored
        recompute = prefill_s / computed * block_size
        if per_block > recompute:
            return Finding(
                "offload_restores_slow",
                f"Restoring a block from the KV offload tier takes {1000 * per_block:.2f} ms, more than the "
                f"{1000 * recompute:.2f} ms its {block_size} tokens take to recompute.",
                {
                    "restore_ms_per_block": round(1000 * per_block, 3),
                    "recompute_ms_per_block": round(1000 * recompute, 3),
                },
                "Put the tier on faster storage: host memory (drop --kv-offloading-path) or a local SSD; a network "
                "filesystem is the usual cause. The engine stops restoring where it measures restores to be slower.",
            )
    queries = delta("prefix_cache_queries_total")
    lost = delta("prefix_cache_evicted_misses_total")
    if queries < th.min_prefix_queries or lost / queries < th.evicted_miss_share:
        return None
    evidence: dict[str, Any] = {
        "prefix_cache_queries": queries,
        "evicted_misses": lost,
        "evicted_miss_share": round(lost / queries, 4),
    }
    if not capacity:
        return Finding(
            "prefix_hits_lost_to_eviction",
            f"{100 * lost / queries:.1f}% of the prompt tokens looked up ({lost:.0f} of {queries:.0f}) missed the "
            "prefix cache only because the pool had evicted them shortly before: they were recomputed.",
            evidence,
            "Add a KV offload tier, which keeps evicted prefixes and restores them instead of recomputing: "
            "--kv-offloading-size 16 (GiB of host memory), or with --kv-offloading-path DIR on disk, where it also "
            "survives restarts (`kvserve estimate --kv-offloading-size` says how many tokens a size holds). A larger "
            "--kv-cache-memory-bytes helps too.",
        )
    used = ev.last.get("kv_offload_bytes") or 0.0
    evidence |= {"kv_offload_bytes": used, "kv_offload_capacity_bytes": capacity}
    if used < th.offload_full * capacity:
        return None
    return Finding(
        "offload_tier_too_small",
        f"The KV offload tier is full ({100 * used / capacity:.0f}% of {capacity / GiB:.2f} GiB) and "
        f"{100 * lost / queries:.1f}% of the prompt tokens looked up were still recomputed after an eviction.",
        evidence,
        "Raise --kv-offloading-size (`kvserve estimate --kv-offloading-size` says how many tokens a size holds).",
    )


# What to do about the prefix misses of each reason (kv/misses.py), for check_miss_reasons.
MISS_FIXES = {
    "evicted": "the pool evicts prefixes before they are reused: a larger --kv-cache-memory-bytes, a KV offload tier "
    "(--kv-offloading-size), or cache_control pins for the prefixes that matter",
    "pin_expired": "pinned prefixes expire before their next use: a 1h cache_control TTL, or reuse within the TTL",
    "diverged": "prompts share a prefix and then change early (a date, a request id near the top): move what varies "
    "to the end; the KV inspector's prefix_missed events name the token",
    "outside_sliding_window": "a sliding-window model gave back the window a hit needs: pin the prefix "
    "(cache_control), or add a KV offload tier (it keeps each prompt's last window)",
    "different_cache_salt": "the same prompts arrive under different cache_salt values: give one tenant one salt",
    "no_state_snapshot": "a hybrid model's prefix hits stop at its last state snapshot: a larger --max-num-seqs "
    "(4 snapshots a sequence slot, up to a quarter of the KV budget) keeps more of them",
    "tier_record_failed_check": "the offload tier's records fail their checks: check the tier's disk",
}


def check_miss_reasons(ev: Evidence, th: Thresholds) -> Finding | None:
    """Why prefix hits stopped short, over the scrapes (or since start, with one scrape): the leading reason that
    something could be done about (never_seen is a cold prefix), when it ended enough requests' hits."""
    name = "prefix_cache_miss_reasons_total"
    now = ev.last.by_str_label(name, "reason")
    before = ev.snapshots[0].by_str_label(name, "reason") if len(ev.snapshots) > 1 else {}
    counts = {reason: now[reason] - before.get(reason, 0.0) for reason in now}
    total = sum(counts.values())
    fixable = {r: n for r, n in counts.items() if r in MISS_FIXES and n > 0}
    if total < th.min_miss_requests or not fixable:
        return None
    reason, count = max(fixable.items(), key=lambda item: item[1])
    if count / total < th.miss_reason_share:
        return None
    return Finding(
        "prefix_misses_" + reason,
        f"{100 * count / total:.0f}% of the requests whose prefix hit stopped short ({count:.0f} of {total:.0f}) "
        f"stopped for the same reason: {reason.replace('_', ' ')}.",
        {"miss_reasons": {r: n for r, n in sorted(counts.items(), key=lambda item: -item[1])}},
        MISS_FIXES[reason][0].upper() + MISS_FIXES[reason][1:] + " (docs/PROMPT_CACHING.md).",
    )


CHECKS: tuple[Check, ...] = (
    check_growing_prompts,
    check_kv_pressure,
    check_queueing,
    check_bandwidth_bound,
    check_prefix_hits,
    check_spec_acceptance,
    check_offload,
    check_miss_reasons,
)


def diagnose(ev: Evidence, th: Thresholds | None = None) -> list[Finding]:
    th = th or Thresholds()
    return [f for f in (check(ev, th) for check in CHECKS) if f is not None]
