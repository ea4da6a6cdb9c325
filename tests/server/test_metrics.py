"""/metrics in Prometheus text format, parsed with prometheus_client's own parser."""

from __future__ import annotations

from server_support import metric_values

GAUGES = [
    "kvserve:num_requests_running",
    "kvserve:num_requests_waiting",
    "kvserve:kv_cache_usage_perc",
    "kvserve:prefix_cache_hit_rate",
]
COUNTERS = [
    "kvserve:prefix_cache_queries_total",
    "kvserve:prefix_cache_hits_total",
    "kvserve:num_preemptions_total",
    "kvserve:prompt_tokens_total",
    "kvserve:generation_tokens_total",
]
HISTOGRAMS = [
    "kvserve:time_to_first_token_seconds",
    "kvserve:inter_token_latency_seconds",
    "kvserve:e2e_request_latency_seconds",
    "kvserve:request_queue_time_seconds",
    "kvserve:request_prefill_time_seconds",
    "kvserve:request_decode_time_seconds",
    "kvserve:request_inference_time_seconds",
    "kvserve:request_time_per_output_token_seconds",
    "kvserve:request_prompt_tokens",
    "kvserve:request_generation_tokens",
    "kvserve:request_params_n",
    "kvserve:request_params_max_tokens",
]


def test_metrics_names_and_values(make_server):
    srv = make_server()
    prompt = "a prompt long enough to fill some blocks"
    with srv.client() as c:
        empty = metric_values(c)
        for name in GAUGES + COUNTERS:
            assert empty[name] == 0, name
        info = [k for k in empty if k.startswith("kvserve:cache_config_info{")]
        expected = (
            "kvserve:cache_config_info{block_size=4,enable_prefix_caching=True,hybrid_kv_cache_manager=False,"
            "kv_cache_dtype=float32,kv_cache_groups=full attention 1 x 2 layers,max_concurrency=3.98,"
            "max_model_len=256,num_blocks=256,sliding_window_layers=0}"
        )
        assert info == [expected]

        for _ in range(2):  # the second one hits the prefix cache
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 5, "ignore_eos": True})
            assert r.status_code == 200
        r = c.post(
            "/v1/completions", json={"prompt": "xyz", "max_tokens": 5, "ignore_eos": True, "n": 2, "stream": True}
        )
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        m = metric_values(c)

    assert m["kvserve:generation_tokens_total"] == 5 + 5 + 2 * 5
    assert m["kvserve:request_success_total{finished_reason=length}"] == 4
    assert m["kvserve:prefix_cache_hits_total"] > 0
    assert 0 < m["kvserve:prefix_cache_hit_rate"] <= 1
    assert m["kvserve:prompt_tokens_total"] > 0
    assert m["kvserve:kv_cache_usage_perc"] == 0 and m["kvserve:num_requests_running"] == 0
    for name in HISTOGRAMS:
        assert m[f"{name}_count"] >= 3, name
        assert m[f"{name}_bucket{{le=+Inf}}"] == m[f"{name}_count"]
    assert m["kvserve:inter_token_latency_seconds_count"] <= 4 * 4  # at most one gap per token after the first
    # vLLM's request-level series: 3 requests (one with n=2), 5 tokens per sample, max_tokens 5.
    assert m["kvserve:request_generation_tokens_sum"] == 5 + 5 + 2 * 5
    assert m["kvserve:request_params_n_sum"] == 1 + 1 + 2 and m["kvserve:request_params_max_tokens_sum"] == 15
    assert m["kvserve:request_prompt_tokens_count"] == 3
    # Steps by their tokens, from the engine: every token the engine computed is in some step.
    assert m["kvserve:iteration_tokens_total_sum"] >= m["kvserve:generation_tokens_total"]
    assert m["kvserve:iteration_tokens_total_bucket{le=+Inf}"] == m["kvserve:iteration_tokens_total_count"] > 0


def test_every_series_carries_the_model_name(make_server):
    """vLLM's dashboards filter every query on model_name: each kvserve series but the cache_config info has it,
    set to the first served name."""
    from prometheus_client.parser import text_string_to_metric_families

    srv = make_server()
    with srv.client() as c:
        assert c.post("/v1/completions", json={"prompt": "ab", "max_tokens": 3}).status_code == 200
        families = list(text_string_to_metric_families(c.get("/metrics").text))
    samples = [
        s
        for f in families
        for s in f.samples
        if s.name.startswith("kvserve:") and s.name != "kvserve:cache_config_info"
    ]
    assert len(samples) > 50
    assert all(s.labels.get("model_name") == "tiny" for s in samples), [
        s for s in samples if "model_name" not in s.labels
    ]
