"""`kvserve bench memory` end to end on a tiny checkpoint: the analytic part follows the capacity math, the
measured part runs the same requests paged and reserving max-model-len, and paging never admits fewer
requests at once. Timings are not asserted."""

from __future__ import annotations

from bench_schema import assert_png, load_report

from kvserve.capacity import compare_layouts
from kvserve.cli import main

# The tiny model stores 512 bytes per token: 2 KiB per 4-token block. 128 KiB = 64 blocks at full size;
# the measured run at 1/4 scale has 16 blocks and max-model-len 16, so reserving fits 4 requests at once.
ARGS = [
    "--max-model-len",
    "64",
    "--kv-cache-memory-bytes",
    "128KiB",
    "--block-size",
    "4",
    "--scale",
    "4",
    "--mean-len",
    "40",
    "--num-requests",
    "10",
    "--samples",
    "500",
    "--repeats",
    "2",
]
PLAN = {"budget_bytes", "num_blocks", "block_size", "bytes_per_token", "max_model_len", "lengths", "paged", "reserved"}
LAYOUT = {"kv_tokens_per_request", "requests_that_fit", "waste_perc"}
RUN = {
    "elapsed_s",
    "output_tokens",
    "steps",
    "max_running",
    "mean_running",
    "peak_kv_usage_perc",
    "waste_perc",
    "preemptions",
}


def test_bench_memory_paged_fits_at_least_as_many_as_reserved(tiny_model_dir, tmp_path, capsys):
    out_json, out_png = tmp_path / "memory.json", tmp_path / "memory.png"
    argv = [
        "--log-level",
        "WARNING",
        "bench",
        "memory",
        "--model",
        str(tiny_model_dir),
        *ARGS,
        "--json",
        str(out_json),
        "--plot",
        str(out_png),
    ]
    assert main(argv) == 0
    assert_png(out_png)
    doc = load_report(out_json, "memory")
    analytic, measured = doc["results"]["analytic"], doc["results"]["measured"]
    assert set(analytic) == PLAN and set(measured["plan"]) == PLAN
    assert analytic["num_blocks"] == 64 and analytic["bytes_per_token"] == 512
    assert analytic["lengths"]["summary"]["count"] == 500 and analytic["lengths"]["summary"]["max"] <= 64
    for plan in (analytic, measured["plan"]):
        assert set(plan["paged"]) == set(plan["reserved"]) == LAYOUT
        assert plan["paged"]["requests_that_fit"] >= plan["reserved"]["requests_that_fit"]
        assert plan["paged"]["waste_perc"] <= plan["reserved"]["waste_perc"]
        assert plan["reserved"]["kv_tokens_per_request"] == plan["max_model_len"]
    small = measured["plan"]
    assert (small["num_blocks"], small["max_model_len"], small["reserved"]["requests_that_fit"]) == (16, 16, 4)

    layouts = {row["layout"]: row for row in measured["layouts"]}
    assert set(layouts) == {"paged", "reserved"}
    for row in layouts.values():
        assert len(row["runs"]) == 2 and all(set(r) == RUN for r in row["runs"])
        assert row["output_tokens_per_s"] > 0 and row["max_running"] == max(r["max_running"] for r in row["runs"])
    runs = layouts["paged"]["runs"] + layouts["reserved"]["runs"]
    assert all(r["output_tokens"] == measured["output_tokens"] for r in runs)  # the same requests every round
    assert layouts["reserved"]["max_running"] <= 4  # a reservation of 4 blocks each, in 16 blocks
    assert layouts["paged"]["max_running"] >= layouts["reserved"]["max_running"]
    assert set(doc["ratios"]) == {
        "concurrency:paged/reserved",
        "measured_concurrency:paged/reserved",
        "output_tokens_per_s:paged/reserved",
    }
    assert [t["columns"][0] for t in doc["tables"]] == ["cache layout", "cache layout"]
    assert "reserve max-model-len" in capsys.readouterr().out


def test_compare_layouts_matches_compare_contiguous_on_equal_lengths():
    cmp = compare_layouts([100] * 10, 1000, 16, max_len=1000, budget_bytes=10_000_000)
    assert cmp.paged.requests_that_fit == 89 and cmp.contiguous.requests_that_fit == 10
    mixed = compare_layouts([1, 16, 17], 1, 16, max_len=32, budget_bytes=320)
    # blocks 1 + 1 + 2 = 4 (64 slots) for 34 tokens; contiguous 96 slots; 320 // 32 = 10 contiguous,
    # 320 * 3 // 64 = 15 paged
    assert (mixed.paged.allocated_bytes, mixed.contiguous.allocated_bytes, mixed.paged.used_bytes) == (64, 96, 34)
    assert (mixed.paged.requests_that_fit, mixed.contiguous.requests_that_fit) == (15, 10)
