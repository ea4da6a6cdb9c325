"""`kvserve bench router` (#17): the KV budget and workload it builds, and one end-to-end run on the tiny
checkpoint (real `kvserve serve` processes, two replicas on a local Ray instance) where prefix-aware routing
must find more cached tokens than round robin: four tenants, each replica's cache holding two of their
prefixes. Timings are not asserted."""

from __future__ import annotations

import argparse
import random

import pytest
from bench_schema import SUMMARY, assert_png, load_report

from kvserve.bench.router import KVBudget, evaluate, policy_list
from kvserve.bench.workload import TokenRange, tenant_requests, word_token_ids
from kvserve.cli import main

ROUTER_CONFIG = {
    "name",
    "replicas",
    "router",
    "command",
    "startup_s",
    "completed",
    "failed",
    "errors",
    "duration_s",
    "output_tokens_per_s",
    "requests_per_s",
    "prompt_tokens",
    "cached_tokens",
    "hit_rate",
    "server_hit_rate",
    "preemptions",
    "router_decisions",
    "ttft_ms",
    "itl_ms",
    "e2e_ms",
}


def test_kv_budget_holds_the_asked_share_of_prefixes():
    args = argparse.Namespace(
        block_size=16,
        prefix_tokens=1000,
        question_tokens=TokenRange(16, 32),
        max_tokens=16,
        num_tenants=8,
        kv_tenants=None,
        kv_slack_requests=4,
    )
    budget = KVBudget.plan(args)
    assert budget.prefix_blocks == 62  # full blocks only: the partial last one is never shared
    assert budget.request_blocks == 66 - 62  # ceil((1000 + 32 + 16) / 16) blocks for the longest request
    assert budget.num_blocks == 1 + 4 * 62 + 4 * 4
    assert "4 tenants' prefixes" in budget.describe()
    args.kv_tenants, args.kv_slack_requests = 0.1, 0  # never below one whole request
    assert KVBudget.plan(args).num_blocks == 1 + 62 + 4


def test_policy_list_parses_and_rejects():
    assert policy_list("round_robin, prefix_aware,round_robin") == ["round_robin", "prefix_aware"]
    with pytest.raises(argparse.ArgumentTypeError):
        policy_list("prefix_aware,random")


def test_targets_compare_prefix_aware_with_the_other_policies():
    def row(router: str | None, hit: float, p90: float, tps: float) -> dict:
        return {"router": router, "hit_rate": hit, "ttft_ms": {"p90": p90}, "output_tokens_per_s": tps}

    rows = [
        row(None, 0.5, 9000, 5.0),
        row("prefix_aware", 0.95, 400, 9.6),
        row("least_loaded", 0.5, 8000, 9.0),
        row("round_robin", 0.5, 6000, 10.0),
    ]
    targets = {t["name"]: t for t in evaluate(rows)}
    hit, ttft, tput = (
        targets[n]
        for n in (
            "hit rate, prefix_aware / round_robin",
            "TTFT p90, prefix_aware / round_robin",
            "output tokens/s, prefix_aware / best other policy",
        )
    )
    assert hit["value"] == pytest.approx(1.9) and hit["met"] is True
    assert ttft["value"] == pytest.approx(400 / 6000) and ttft["met"] is True
    assert tput["value"] == pytest.approx(0.96) and tput["met"] is True  # against the best other (10.0), not 9.0
    rows[3]["hit_rate"] = 0.6
    assert {t["name"]: t["met"] for t in evaluate(rows)}["hit rate, prefix_aware / round_robin"] is False
    assert all(t["value"] is None and t["met"] is None for t in evaluate(rows[:2]))  # no round_robin, no other


def test_tenant_requests_share_exact_prefixes():
    def encode(text: str) -> list[int]:
        return [ord(c) for c in text]

    assert len(word_token_ids(random.Random(0), 37, encode)) == 37
    requests = tenant_requests(3, 50, 10, TokenRange(4, 6), encode, [2], seed=1, requests_per_tenant=2)
    assert [r.tenant for r in requests[:6]] == [0, 1, 2, 0, 1, 2]  # the warm-up: tenants in turn
    assert len(requests) == 16
    prefixes = {r.tenant: r.prompt_token_ids[:50] for r in requests}
    assert len(set(map(tuple, prefixes.values()))) == 3 and all(p[0] == 2 for p in prefixes.values())
    for r in requests:
        assert r.prompt_token_ids[:50] == prefixes[r.tenant] and 54 <= len(r.prompt_token_ids) <= 56
    assert len({tuple(r.prompt_token_ids) for r in requests}) == 16  # every question distinct
    again = tenant_requests(3, 50, 10, TokenRange(4, 6), encode, [2], seed=1, requests_per_tenant=2)
    assert [r.prompt_token_ids for r in again] == [r.prompt_token_ids for r in requests]  # seeded


def test_bench_router_prefix_aware_hits_more_than_round_robin(tiny_model_dir, tmp_path, capsys):
    out_json, out_png = tmp_path / "router.json", tmp_path / "router.png"
    argv = [
        "--log-level",
        "WARNING",
        "bench",
        "router",
        "--model",
        str(tiny_model_dir),
        "--block-size",
        "4",
        "--num-tenants",
        "4",
        "--prefix-tokens",
        "64",
        "--question-tokens",
        "4-8",
        "--max-tokens",
        "3",
        "--num-requests",
        "16",
        "--request-rate",
        "8",
        "--policies",
        "prefix_aware,round_robin",
        "--json",
        str(out_json),
        "--plot",
        str(out_png),
    ]
    assert main(argv) == 0
    assert_png(out_png)
    doc = load_report(out_json, "router")
    results = doc["results"]
    assert set(results) == {"workload", "kv_budget", "configs", "targets"}
    assert results["kv_budget"]["num_blocks"] == 1 + 2 * 16 + 4 * 3
    configs = {c["name"]: c for c in results["configs"]}
    assert list(configs) == ["1 replica", "2x prefix_aware", "2x round_robin"]
    for c in configs.values():
        assert set(c) == ROUTER_CONFIG
        assert c["completed"] == 16 and c["failed"] == 0 and set(c["ttft_ms"]) == SUMMARY
        assert 16 * 68 <= c["prompt_tokens"] <= 16 * 72 and 0 <= c["cached_tokens"] <= c["prompt_tokens"]
        assert 0.0 <= c["hit_rate"] <= 1.0 and c["output_tokens_per_s"] > 0
        assert "--num-gpu-blocks-override 45" in c["command"]
    aware, rr = configs["2x prefix_aware"], configs["2x round_robin"]
    assert configs["1 replica"]["router"] is None and configs["1 replica"]["router_decisions"] == {}
    assert rr["router_decisions"] == {"round_robin": 16}
    assert sum(aware["router_decisions"].values()) == 16 and aware["router_decisions"].get("prefix_hit", 0) > 0
    assert aware["hit_rate"] >= rr["hit_rate"]
    assert aware["hit_rate"] > 0 and aware["server_hit_rate"] > 0  # from usage, and from the engines' counters
    assert {t["name"] for t in results["targets"]} == {
        "hit rate, prefix_aware / round_robin",
        "TTFT p90, prefix_aware / round_robin",
        "output tokens/s, prefix_aware / best other policy",
    }
    assert set(doc["ratios"]) == {
        "hit_rate:prefix_aware/round_robin",
        "ttft_p90:prefix_aware/round_robin",
        "output_tokens_per_s:prefix_aware/best_other",
        "output_tokens_per_s:prefix_aware/single",
    }
    out = capsys.readouterr().out
    assert "2x prefix_aware" in out and "KV budget: 45 blocks of 4 tokens" in out
