"""`kvserve bench all` and the docs it regenerates: only the text between a section's markers changes, and
the whole suite runs end to end on a tiny checkpoint into a temporary docs page. Timings are not asserted."""

from __future__ import annotations

import json

import pytest
from bench_schema import assert_png, load_report

from kvserve.bench.docs import markdown_table, replace_section, update_sections
from kvserve.cli import main

PAGE = """# Benchmarks

Prose before, kept as written.

## Throughput
<!-- bench:throughput:start -->
| old | table |
|---|---|
| 1 | 2 |
<!-- bench:throughput:end -->

Prose between, about throughput.

## Memory
<!-- bench:memory:start -->
(no figures yet)
<!-- bench:memory:end -->
![memory](bench/memory.png)

Prose after.
"""


def test_replace_section_rewrites_only_between_its_markers():
    text = replace_section(PAGE, "memory", "| new |\n|---|")
    assert "| new |\n|---|" in text and "(no figures yet)" not in text
    assert text.replace("| new |\n|---|", "(no figures yet)") == PAGE  # nothing else moved
    again = replace_section(text, "memory", "second")
    assert "| new |" not in again and again.count("<!-- bench:memory:start -->") == 1


def test_update_sections_reports_sections_without_markers_and_rejects_broken_ones():
    text, missing = update_sections(PAGE, {"throughput": "T", "latency": "L"})
    assert missing == ["latency"] and "| old | table |" not in text and "\nT\n" in text
    assert text.split("<!-- bench:throughput:end -->")[1] == PAGE.split("<!-- bench:throughput:end -->")[1]
    with pytest.raises(ValueError, match="expected one"):
        replace_section(PAGE.replace("<!-- bench:memory:end -->", ""), "memory", "x")
    swapped = PAGE.replace("<!-- bench:memory:start -->", "@@").replace(
        "<!-- bench:memory:end -->", "<!-- bench:memory:start -->"
    )
    with pytest.raises(ValueError, match="comes before"):
        replace_section(swapped.replace("@@", "<!-- bench:memory:end -->"), "memory", "x")


def test_markdown_table_aligns_numbers_right():
    md = markdown_table({"title": "T", "columns": ["name", "value"], "rows": [["a|b", 1.23456], ["c", None]]})
    assert md.splitlines()[2:] == ["| name | value |", "|---|---:|", "| a\\|b | 1.23 |", "| c | - |"]


def test_bench_all_runs_the_chosen_commands_and_regenerates_the_docs(tiny_model_dir, tmp_path, capsys):
    docs, out = tmp_path / "BENCHMARKS.md", tmp_path / "bench"
    docs.write_text(PAGE.replace("throughput", "kv-cache"))
    argv = [
        "--log-level",
        "WARNING",
        "bench",
        "all",
        "--only",
        "kv-cache,memory,serve",
        "--no-peers",
        "--model",
        str(tiny_model_dir),
        "--out-dir",
        str(out),
        "--docs",
        str(docs),
        "--args",
        "engine=--block-size 4 --cpu-threads 1",
        "--args",
        "kv-cache=--context-lens 8,16 --decode-tokens 1 --kv-cache-memory-bytes 8MiB",
        "--args",
        (
            "memory=--max-model-len 64 --kv-cache-memory-bytes 128KiB --scale 4 --mean-len 40 "
            "--num-requests 6 --samples 200 --repeats 1"
        ),
    ]
    assert main([*argv, "--dry-run"]) == 0
    planned = capsys.readouterr().out
    assert "kvserve bench memory" in planned and "# skipped: no --url" in planned and not out.exists()

    assert main(argv) == 0
    assert load_report(out / "kv_cache.json", "kv-cache")["results"]["points"][1]["context_len"] == 16
    assert load_report(out / "memory.json", "memory")["results"]["measured"]["plan"]["max_model_len"] == 16
    assert_png(out / "kv_cache.png")
    assert_png(out / "memory.png")
    manifest = json.loads((out / "all.json").read_text())
    assert set(manifest["commands"]) == {"kv-cache", "memory", "serve"}
    assert manifest["commands"]["memory"]["ok"] and manifest["commands"]["serve"]["skipped"]
    assert manifest["commands"]["memory"]["command"].startswith("kvserve bench memory ")
    assert "--block-size 4 --cpu-threads 1" in manifest["commands"]["kv-cache"]["command"]

    text = docs.read_text()
    memory = text.split("<!-- bench:memory:start -->")[1].split("<!-- bench:memory:end -->")[0]
    assert "(no figures yet)" not in memory and "| cache layout |" in memory and "kvserve bench memory" in memory
    assert "`measured_concurrency:paged/reserved`" in memory and "bench/memory.json" in memory
    assert "| context |" in text and "| old | table |" not in text
    for prose in (
        "Prose before, kept as written.",
        "Prose between, about kv-cache.",
        "Prose after.",
        "![memory](bench/memory.png)",
    ):
        assert text.count(prose) == 1

    (out / "kv_cache.json").unlink()  # --docs-only renders what is there; a missing report leaves its section
    assert main([*argv, "--docs-only"]) == 0
    assert docs.read_text().split("<!-- bench:memory:end -->")[1] == text.split("<!-- bench:memory:end -->")[1]
    assert "| context |" in docs.read_text()


def test_the_router_step_takes_only_the_flags_it_has_and_is_skipped_without_ray(monkeypatch, tmp_path):
    """`bench router` starts `kvserve serve` processes: it takes --model and --cpu-threads, not bench all's --device,
    --dtype or `--args engine=...` (engine flags of the in-process commands), and without Ray it is skipped."""
    from kvserve.bench import suite

    argv = [
        "all",
        "--only",
        "router,kv-cache",
        "--model",
        "m.gguf",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--cpu-threads",
        "1",
        "--args",
        "engine=--block-size 4",
        "--out-dir",
        str(tmp_path),
    ]
    steps = {s.quick.name: s for s in suite.plan(suite.parse(argv))}
    router = steps["router"].argv
    assert router[router.index("--model") + 1] == "m.gguf" and router[router.index("--cpu-threads") + 1] == "1"
    assert "--device" not in router and "--dtype" not in router and "--block-size" not in router
    assert "--device" in steps["kv-cache"].argv and "--block-size" in steps["kv-cache"].argv
    assert steps["router"].skipped is None  # Ray is installed with the [test] extra

    real_find_spec = suite.importlib.util.find_spec
    monkeypatch.setattr(
        suite.importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real_find_spec(name, *a)
    )
    skipped = {s.quick.name: s for s in suite.plan(suite.parse(argv))}["router"]
    assert skipped.skipped is not None and "[cluster]" in skipped.skipped
