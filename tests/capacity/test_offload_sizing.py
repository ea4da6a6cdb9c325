"""`kvserve estimate` and `advise` with --kv-offloading-size: the blocks and tokens a tier of that size holds, in the
cache's own bytes per block (what the tier stores), with no torch import."""

from __future__ import annotations

import json

from kvserve.cli import main


def test_estimate_says_what_a_tier_holds(capsys) -> None:
    assert main(["estimate", "--kv-cache-memory-bytes", "4GiB", "--kv-offloading-size", "16", "--kv-cache-dtype",
                 "float32,int8", "--json"]) == 0  # fmt: skip
    doc = json.loads(capsys.readouterr().out)
    f32, i8 = doc["kv"]
    # Gemma 3 270M: 2,048 bytes a token and layer in float32, 520 in int8 (with its scales); a block is one KV cache
    # group's 3 layers x 16 tokens. Of a long prefix the tier stores the one full-attention group's blocks (and a
    # sliding group's window where a later request hits, left out): 16 tokens a block, 6x the uniform layout's 466032.
    assert f32["offload"] == {"bytes": 16 << 30, "num_blocks": (16 << 30) // (3 * 2048 * 16), "num_tokens": 2796192}
    assert i8["offload"]["num_blocks"] == (16 << 30) // (3 * 520 * 16)
    assert main(["estimate", "--kv-cache-memory-bytes", "4GiB", "--kv-offloading-size", "512MiB"]) == 0
    assert "an offload tier of 0.50 GiB holds 5461 blocks = 87376 tokens of long prefixes" in capsys.readouterr().out
    flags = ["--disable-hybrid-kv-cache-manager", "--json"]
    assert main(["estimate", "--kv-cache-memory-bytes", "4GiB", "--kv-offloading-size", "16", *flags]) == 0
    uniform = json.loads(capsys.readouterr().out)["kv"][0]["offload"]
    assert uniform == {"bytes": 16 << 30, "num_blocks": (16 << 30) // (36864 * 16), "num_tokens": 466032}


def test_advise_sizes_the_tier_in_the_recommended_dtype(capsys) -> None:
    assert main(["advise", "--kv-cache-memory-bytes", "4GiB", "--kv-offloading-size", "16", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    o, r = doc["offload"], doc["recommendation"]
    assert o["kv_cache_dtype"] == r["kv_cache_dtype"] and o["num_tokens"] == o["num_blocks"] * 16
    assert o["typical_requests"] == o["num_tokens"] // doc["scenario"]["typical_len"]
    assert r["command"].endswith("--kv-offloading-size 16")
    assert main(["advise", "--kv-cache-memory-bytes", "4GiB"]) == 0
    assert "Offload tier" not in capsys.readouterr().out
