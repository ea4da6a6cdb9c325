"""The KV offload tier behind the HTTP API: a restarted server's first request is served from the disk tier an earlier
server filled (usage.prompt_tokens_details.cached_tokens), and /metrics shows the tier in vLLM's external prefix cache
series and kvserve's kv_offload_* ones."""

from __future__ import annotations

import time

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


def test_prompt_cache_retention_keeps_the_prompt_in_the_disk_tier(make_server, tmp_path):
    """OpenAI's prompt_cache_retention "24h": every whole block of the prompt is retained in the disk tier (its record's
    time set a day ahead, which eviction passes over and a restart keeps: tests/unit/test_kv_offload_store.py); another
    request's blocks are not. Without a disk tier it is a 400."""
    from kvserve.kv.offload.store_dir import parse_record_name

    server = make_server(kv_offloading_size="16MiB", kv_offloading_path=str(tmp_path))
    with server.client() as c:
        body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "prompt_cache_retention": "24h"}
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        other = c.post("/v1/completions", json={"prompt": "an unrelated prompt, kept as usual " * 3, "max_tokens": 2})
        assert other.status_code == 200
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    server.stop()  # the tier's writers finish first
    records = [p for p in tmp_path.rglob("*") if p.is_file() and parse_record_name(p.name) is not None]
    retained = [p for p in records if p.stat().st_mtime > time.time() + 23 * 3600]
    assert len(retained) == prompt_tokens // 4 and len(records) > len(retained)  # block size 4, one KV cache group
    plain = make_server()
    with plain.client() as c:
        refused = c.post("/v1/completions", json={**body, "max_tokens": 1})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_cache_retention"
