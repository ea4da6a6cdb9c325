"""`kvserve bench offload` end to end on a tiny checkpoint: every scenario runs, the tiers hit where they should (the
multi-round chat's tier restores, the restart restores, no reuse never hits, the exact tier's restores are identical
to cold and the int8 tier's blocks are about 4x smaller), the JSON has the documented shape and the plot is drawn;
and the llama-server comparison drives `kvserve serve` and a stand-in llama-server. Timings are not asserted."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from bench_schema import assert_png, load_report

from kvserve.cli import main

SMALL = [
    "--users", "3", "--rounds", "3", "--system-tokens", "40", "--question-tokens", "6", "--output-len", "4",
    "--pool-bytes", "48KiB", "--tier-bytes", "16MiB", "--restart-tokens", "60", "--no-reuse-requests", "3",
    "--no-reuse-tokens", "20", "--accuracy-prompts", "2", "--accuracy-tokens", "40", "--accuracy-output", "6",
    "--repeats", "1", "--block-size", "4",
]  # fmt: skip


def test_bench_offload_reports_every_scenario(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """With the disk tier's writers starved as on a host busy with other work (they run only on idle cores): here no
    record is written until someone waits for the writes. The disk tier's hit rate once came out 0.0 under load, the
    next round asking before the writes were done; the benchmark now waits for them between rounds (think time)."""
    import threading

    from kvserve.kv.offload.disk_tier import DiskTier
    from kvserve.kv.offload.stores import DiskStore

    waited_for = threading.Event()
    write, flush = DiskStore.write, DiskTier.flush

    def starved_write(self, *args, **kwargs):
        waited_for.wait()
        return write(self, *args, **kwargs)

    def waited_flush(self, timeout):
        waited_for.set()
        try:
            flush(self, timeout)
        finally:
            waited_for.clear()

    monkeypatch.setattr(DiskStore, "write", starved_write)
    monkeypatch.setattr(DiskTier, "flush", waited_flush)
    out_json, out_png = tmp_path / "offload.json", tmp_path / "offload.png"
    argv = ["--log-level", "WARNING", "bench", "offload", "--model", str(tiny_model_dir), *SMALL]
    assert main([*argv, "--json", str(out_json), "--plot", str(out_png)]) == 0
    assert_png(out_png)
    doc = load_report(out_json, "offload")
    multi = doc["results"]["multi_round"]
    systems = multi["systems"]
    assert set(systems) == {"no tier", "host tier", "disk tier", "pool + tier bytes"}
    assert multi["working_set_tokens"] > 2 * multi["pool_tokens"]
    assert systems["no tier"]["tier_hit_rate"] == 0 and systems["pool + tier bytes"]["tier_hit_rate"] == 0
    assert systems["host tier"]["tier_hit_rate"] > 0 and systems["disk tier"]["tier_hit_rate"] > 0
    assert all(len(s["ttft_ms"]) == 9 for s in systems.values())
    (restart,) = doc["results"]["restart"]
    assert restart["prompt_tokens"] == 60 and restart["restored_tokens"] == 56
    no_reuse = doc["results"]["no_reuse"]["systems"]
    assert set(no_reuse) == {"no tier", "host tier", "disk tier"}
    assert no_reuse["no tier"]["stored_blocks"] == no_reuse["no tier"]["dropped_blocks"] == 0
    for name in ("host tier", "disk tier"):  # every full block of every run is stored or dropped, counted
        assert no_reuse[name]["stored_blocks"] + no_reuse[name]["dropped_blocks"] > 0
    accuracy = doc["results"]["accuracy"]["tiers"]
    assert accuracy["auto"]["identical_continuations"] == 2 and accuracy["auto"]["restored_tokens"] > 0
    assert 3.0 < doc["ratios"]["int8_tier_blocks_over_exact"] < 4.0  # head_dim 16: 4 x 16 / (16 + 4)
    assert doc["results"]["llama_server"] is None and doc["ratios"]["llama_server_ttft_p50_kvserve_over_peer"] is None
    assert "Restart" in capsys.readouterr().out


def test_bench_offload_against_llama_server(tiny_model_dir, tmp_path):
    fake = tmp_path / "fake_llama_server.py"
    shutil.copy(Path(__file__).with_name("fake_llama_server.py"), fake)
    binary = tmp_path / "llama-server"
    binary.write_text(f'#!/bin/sh\nexec {sys.executable} {fake} "$@"\n')
    binary.chmod(0o755)
    out_json = tmp_path / "offload.json"
    argv = ["--log-level", "WARNING", "bench", "offload", "--model", str(tiny_model_dir), *SMALL]
    assert main([*argv, "--llama-server", str(binary), "--json", str(out_json)]) == 0
    peer = load_report(out_json, "offload")["results"]["llama_server"]
    assert set(peer["systems"]) == {"kvserve", "llama-server"}
    assert all(len(s["ttft_ms"]) == 9 for s in peer["systems"].values())
    assert peer["systems"]["kvserve"]["cached_tokens_reported"] > 0  # the tier and the pool served prefixes
    started = json.loads((tmp_path / "args.json").read_text())
    assert started[started.index("--cache-ram") + 1] == "16" and "-np" in started


def test_the_http_comparison_serves_with_the_runs_numerics():
    """The `kvserve serve` of the llama-server comparison computes as the run's in-process engines: the flags that
    change kvserve's arithmetic are passed on, defaults are not spelled out."""
    from kvserve.bench.offload import _numerics_flags
    from kvserve.cli import build_parser

    parser = build_parser()
    assert _numerics_flags(parser.parse_args(["bench", "offload"])) == []
    args = parser.parse_args(["bench", "offload", "--activation-quantization", "int8", "--kv-cache-dtype", "int8"])
    assert _numerics_flags(args) == ["--activation-quantization", "int8", "--kv-cache-dtype", "int8"]
