"""The KV offload tier behind the HTTP API: a restarted server's first request is served from the disk tier an earlier
server filled (usage.prompt_tokens_details.cached_tokens), and /metrics shows the tier in vLLM's external prefix cache
series and kvserve's kv_offload_* ones."""

from __future__ import annotations

from server_support import metric_values

PROMPT = "the offload tier keeps this prompt's blocks across a restart of the server " * 3


def complete(server) -> dict:
    with server.client() as c:
        r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()


def test_a_restarted_server_restores_its_first_request_from_disk(make_server, tmp_path):
    tier = dict(kv_offloading_size="16MiB", kv_offloading_path=str(tmp_path))
    first = make_server(**tier)
    cold = complete(first)
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    with first.client() as c:
        m = metric_values(c)
    assert m["kvserve:kv_offload_stored_blocks_total{medium=DISK}"] >= 0  # the writer may still be writing
    assert m["kvserve:kv_offload_available{medium=DISK}"] == 1
    assert m["kvserve:kv_offload_capacity_bytes{medium=DISK}"] == 16 << 20
    first.stop()  # the engine closes: what is queued for the disk is written first

    second = make_server(**tier)
    warm = complete(second)
    prompt_tokens = warm["usage"]["prompt_tokens"]
    cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (prompt_tokens - 1) // 4 * 4 > 0  # every full block before the last prompt token's
    assert warm["usage"]["prompt_tokens_details"]["restored_tokens"] == cached  # all of them from the tier
    assert cold["usage"]["prompt_tokens_details"]["restored_tokens"] == 0
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
    with second.client() as c:
        m = metric_values(c)
    assert m["kvserve:external_prefix_cache_hits_total{medium=DISK}"] == cached
    assert m["kvserve:external_prefix_cache_queries_total{medium=DISK}"] == prompt_tokens
    assert m["kvserve:kv_offload_restored_blocks_total{medium=DISK}"] == cached // 4
    assert m["kvserve:kv_offload_restore_seconds_count{medium=DISK}"] == 1
    assert m["kvserve:kv_offload_restore_failures_total{medium=DISK}"] == 0
    assert m["kvserve:kv_offload_blocks{medium=DISK}"] >= cached // 4
    again = complete(second)["usage"]["prompt_tokens_details"]  # now in the pool: cached, none restored
    assert again["cached_tokens"] == cached and again["restored_tokens"] == 0
