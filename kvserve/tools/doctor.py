"""`kvserve doctor`: diagnose a running server from its /metrics (or saved scrapes), optionally with a probe.

Every finding comes from measured values and carries the numbers that triggered it and the fix; a healthy
server is reported as healthy. Exit status: 0 healthy, 1 findings, 2 errors.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

from tqdm.auto import tqdm

from kvserve.tools.doctor_checks import Evidence, Finding, ProbeResult, Thresholds, diagnose
from kvserve.tools.metrics_snapshot import Snapshot
from kvserve.tools.report import add_json_arg, emit, int_list, table

SCHEMA = (
    "{source, scrapes, cache_config: {label: value}, models: [id] | null, summary: {kv_cache_usage_perc_max, "
    "num_requests_running_max, num_requests_waiting_max, num_preemptions_total, prefix_cache_hit_rate, requests, "
    "ttft_mean_s, queue_time_mean_s, itl_mean_s}, windows: [{requests, ttft_mean, prompt_len_mean, itl_mean, "
    "e2e_mean, preemptions, prefix_queries, prefix_hits, kv_usage, running, waiting, queue_mean, prefill_mean}], "
    "probe: {ttft_by_prompt_len: [{prompt_tokens, ttft_s}], "
    "latency_by_concurrency: [{concurrency, latency_s, s_per_output_token}]} | null, healthy, "
    "findings: [{code, summary, evidence, fix}], notes: [str]}"
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "doctor",
        help="diagnose a running kvserve server from its metrics",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    src.add_argument(
        "--metrics-file",
        action="append",
        default=None,
        metavar="FILE",
        help="a saved /metrics scrape instead of a server (repeat, oldest first, for trends)",
    )
    p.add_argument(
        "--scrapes",
        type=int,
        default=5,
        help=f"how many times to read /metrics (trends need >= {Thresholds().min_trend_windows + 1})",
    )
    p.add_argument("--interval", type=float, default=5.0, help="seconds between scrapes")
    p.add_argument(
        "--probe", action="store_true", help="also send a few requests: growing prompt length, then growing concurrency"
    )
    p.add_argument(
        "--probe-prompt-lens",
        type=int_list,
        default="64,256,1024",
        help="approximate prompt tokens of the probe's one-token requests",
    )
    p.add_argument(
        "--probe-concurrency",
        type=int_list,
        default="1,4,16",
        help="concurrency levels of the probe's 16-token requests",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="bearer token, if the server wants one (its --admin-api-key where it has one: /metrics needs that key)",
    )
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per HTTP request")
    add_json_arg(p, SCHEMA)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    probe = None
    models = None
    if args.metrics_file:
        snapshots = [_read_snapshot(path) for path in args.metrics_file]
        source = ", ".join(args.metrics_file)
    else:
        client = Client(args.url, args.api_key, args.timeout)
        models = client.models()
        scrapes = max(args.scrapes, 1)
        # What it is doing and for how long (the scrapes alone take (scrapes - 1) x interval: 20 s by default).
        print(
            f"kvserve doctor: reading {args.url}/metrics {scrapes} times, {args.interval:g} s apart "
            f"(about {(scrapes - 1) * args.interval:.0f} s{', after the probe' if args.probe else ''})",
            file=sys.stderr,
        )
        with tqdm(total=scrapes, desc="scrapes", unit="scrape", file=sys.stderr) as bar:
            snapshots = [client.snapshot()]
            bar.update(1)
            if args.probe:
                bar.set_description("probe")
                model = models[0] if models else None
                probe = run_probe(client, model, args.probe_prompt_lens, args.probe_concurrency)
                bar.set_description("scrapes")
            for _ in range(scrapes - 1):
                time.sleep(args.interval)
                snapshots.append(client.snapshot())
                bar.update(1)
        source = args.url
    ev = Evidence(snapshots, probe)
    findings = diagnose(ev, Thresholds())
    doc = report(ev, findings, source, models)
    emit(doc, render(doc), args.json)
    return 1 if findings else 0


def _read_snapshot(path: str) -> Snapshot:
    try:
        with open(path) as f:
            return Snapshot.parse(f.read())
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e


class Client:
    """The few HTTP calls doctor makes, with the standard library only."""

    def __init__(self, base_url: str, api_key: str | None, timeout: float) -> None:
        self.base = base_url.rstrip("/")
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout = timeout

    def _request(self, path: str, body: dict[str, Any] | None = None) -> bytes:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, headers=self.headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read()[:300].decode(errors="replace")
            raise ValueError(f"{self.base}{path} answered HTTP {e.code}: {detail}") from e
        except (urllib.error.URLError, OSError) as e:
            raise ValueError(f"cannot reach {self.base}{path}: {e}") from e

    def snapshot(self) -> Snapshot:
        return Snapshot.parse(self._request("/metrics").decode(), time=time.monotonic())

    def models(self) -> list[str] | None:
        try:
            return [m["id"] for m in json.loads(self._request("/v1/models"))["data"]]
        except (ValueError, KeyError, TypeError):
            return None

    def complete(self, model: str | None, prompt: str, max_tokens: int) -> float:
        """Seconds for one non-streaming completion."""
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        if model:
            body["model"] = model
        start = time.perf_counter()
        self._request("/v1/completions", body)
        return time.perf_counter() - start


def _prompt(tokens: int) -> str:
    """About `tokens` tokens, starting with a unique tag so no two probe prompts share a cached prefix."""
    return f"{uuid.uuid4().hex} " + " ".join(["the"] * max(tokens - 1, 1))


def run_probe(
    client: Client, model: str | None, prompt_lens: list[int], concurrencies: list[int], output_tokens: int = 16
) -> ProbeResult:
    """TTFT (a one-token completion) at growing prompt lengths, then latency at growing concurrency."""
    ttft = [(n, client.complete(model, _prompt(n), 1)) for n in prompt_lens]
    short = prompt_lens[0]
    first = ttft[0][1]
    rows = []
    for c in concurrencies:
        with ThreadPoolExecutor(max_workers=c) as pool:
            latencies = list(pool.map(lambda _: client.complete(model, _prompt(short), output_tokens), range(c)))
        mean = sum(latencies) / len(latencies)
        rows.append((c, mean, max(mean - first, 0.0) / max(output_tokens - 1, 1)))
    return ProbeResult(ttft, rows)


def report(ev: Evidence, findings: list[Finding], source: str, models: list[str] | None) -> dict[str, Any]:
    busy = ev.busy_windows()
    queries = sum(w.prefix_queries for w in ev.windows)
    last_busy = busy[-1] if busy else None
    summary = {
        "kv_cache_usage_perc_max": ev.max_of("kv_cache_usage_perc"),
        "num_requests_running_max": ev.max_of("num_requests_running"),
        "num_requests_waiting_max": ev.max_of("num_requests_waiting"),
        "num_preemptions_total": ev.last.get("num_preemptions_total"),
        "prefix_cache_hit_rate": sum(w.prefix_hits for w in ev.windows) / queries if queries else None,
        "requests": sum(w.requests for w in ev.windows),
        "ttft_mean_s": None if last_busy is None else last_busy.ttft_mean,
        "queue_time_mean_s": ev.overall().queue_mean,
        "itl_mean_s": None if last_busy is None else last_busy.itl_mean,
    }
    notes = []
    if not busy:
        notes.append(
            "no requests completed their first token during the scrapes: latency checks had nothing to "
            "measure (send traffic, scrape over a longer --interval, or use --probe)"
        )
    trend_scrapes = Thresholds().min_trend_windows + 1
    if len(ev.snapshots) < trend_scrapes:
        notes.append(f"trends across turns need at least {trend_scrapes} scrapes with traffic between them")
    probe = (
        None
        if ev.probe is None
        else {
            "ttft_by_prompt_len": [{"prompt_tokens": n, "ttft_s": t} for n, t in ev.probe.ttft_by_prompt_len],
            "latency_by_concurrency": [
                {"concurrency": c, "latency_s": t, "s_per_output_token": s}
                for c, t, s in ev.probe.latency_by_concurrency
            ],
        }
    )
    return {
        "source": source,
        "scrapes": len(ev.snapshots),
        "cache_config": ev.last.cache_config,
        "models": models,
        "summary": summary,
        "windows": [asdict(w) for w in ev.windows],
        "probe": probe,
        "healthy": not findings,
        "findings": [asdict(f) for f in findings],
        "notes": notes,
    }


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def render(doc: dict[str, Any]) -> str:
    lines = [f"kvserve doctor: {doc['source']} ({doc['scrapes']} scrape{'s' if doc['scrapes'] != 1 else ''})"]
    if doc["cache_config"]:
        lines.append("  cache: " + ", ".join(f"{k}={v}" for k, v in sorted(doc["cache_config"].items())))
    lines.append("  " + ", ".join(f"{k}={_fmt(v)}" for k, v in doc["summary"].items()))
    if doc["probe"]:
        p = doc["probe"]
        lines += [
            "",
            "Probe: time to first token by prompt length",
            table(
                ["prompt tokens", "TTFT s"],
                [(r["prompt_tokens"], f"{r['ttft_s']:.3f}") for r in p["ttft_by_prompt_len"]],
            ),
            "Probe: latency by concurrency",
            table(
                ["concurrency", "latency s", "s/output token"],
                [
                    (r["concurrency"], f"{r['latency_s']:.3f}", f"{r['s_per_output_token']:.4f}")
                    for r in p["latency_by_concurrency"]
                ],
            ),
        ]
    lines.append("")
    if doc["healthy"]:
        lines.append("Healthy: no finding was triggered by the measured values.")
    for f in doc["findings"]:
        lines += [
            f"[{f['code']}] {f['summary']}",
            "  measured: " + ", ".join(f"{k}={_fmt(v)}" for k, v in f["evidence"].items()),
            f"  fix: {f['fix']}",
        ]
    lines += [f"Note: {n}" for n in doc["notes"]]
    return "\n".join(lines)
