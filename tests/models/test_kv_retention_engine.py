"""prompt_cache_retention's budgets through an engine's disk tier (kv/offload/retention.py): one tenant's many
24-hour retentions no longer push out another tenant's retained prefix (six of them marked 980 of a tier's 1,092
records for a day)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from tiny_models import build_tiny_hf_model, tiny_engine
from tiny_tokenizer import write_char_tokenizer

from kvserve.kv.hashing import salt_key
from kvserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    build_tiny_hf_model("llama_gqa").save_pretrained(path)
    write_char_tokenizer(path)
    return path


def test_one_tenants_retentions_never_push_out_anothers(tiny, tmp_path):
    """Tenant a retains its prompt for a day; tenant b then retains many long prompts for a day each. a's retained
    records are all still there (b's retentions were capped at its share and counted), b never marks more than its
    share of the tier, and retained records never fill the tier."""
    engine = tiny_engine(
        tiny, kv_offloading_size="1MiB", kv_offloading_path=str(tmp_path), max_retained_kv_fraction_per_tenant=0.25
    )
    tier = engine.core.offload
    capacity = tier.config.size_bytes // tier.layout.block_bytes
    day = SamplingParams(temperature=0, max_tokens=1, prompt_cache_retention_s=86400)

    def run(rid: str, prompt: list[int], salt: str) -> None:
        engine.add_request(rid, prompt, day, cache_salt=salt)
        while engine.has_unfinished_requests():
            engine.step()
        tier.flush()

    run("a", [2] + [10 + i % 200 for i in range(40)], "tenant-a")
    for n in range(6):
        run(f"b{n}", [2] + [(7 * n + i) % 240 + 5 for i in range(160)], "tenant-b")
    now = time.time()
    retained = [p for p in tmp_path.glob("*/blocks/*/*.kvb") if os.stat(p).st_mtime > now + 3600]
    connector = engine.core.scheduler.offload
    budgets = connector.retention[0]
    assert budgets.by_tenant[salt_key("tenant-a")] == 10  # a's 41-token prompt: 10 whole blocks, all retained
    assert budgets.by_tenant[salt_key("tenant-b")] == capacity // 4
    assert len(retained) <= capacity // 2 and connector.retention_capped > 0
    assert engine.stats().kv_retention_capped == connector.retention_capped
    engine.close()
