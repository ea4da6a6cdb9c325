"""The README's quoted outputs are what the program prints: each block after a `<!-- checked by
tests/e2e/test_readme_outputs.py: NAME -->` marker is compared with the output NAME stands for, so that a quote
cannot drift from the program again (it had: 116496 tokens and 3.56x against the 116480 and 3.55x printed).

A quoted line must equal a line of the output (trailing spaces aside); one that ends in `...` was cut short and
must begin a line of the output."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvserve.capacity import plan_kv_cache
from kvserve.cli import main
from kvserve.kv.groups import make_kv_cache_layout

pytestmark = pytest.mark.real_model  # the default model's file (its metadata; no weights are loaded)
README = Path(__file__).resolve().parents[2] / "README.md"
MARKER = re.compile(r"<!-- checked by tests/e2e/test_readme_outputs.py: (.+?) -->\n```[a-z]*\n(.*?)```", re.DOTALL)


def quoted_blocks() -> dict[str, list[str]]:
    return {name: block.rstrip("\n").split("\n") for name, block in MARKER.findall(README.read_text())}


def assert_quoted(quote: list[str], output: str) -> None:
    lines = [line.rstrip() for line in output.splitlines()]
    for line in quote:
        line = line.rstrip()
        if line.endswith("..."):
            head = line[:-3].rstrip()
            assert any(out.startswith(head) for out in lines), f"no output line begins {head!r}"
        else:
            assert line in lines, f"the program does not print {line!r}"


def test_the_readme_marks_its_quoted_outputs() -> None:
    assert set(quoted_blocks()) == {"the start-up log", "kvserve estimate"}


def test_estimate_prints_what_the_readme_quotes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate"]) == 0
    assert_quoted(quoted_blocks()["kvserve estimate"], capsys.readouterr().out)


def test_the_start_up_log_line_is_the_engines_plan(capsys: pytest.CaptureFixture[str]) -> None:
    """The engine logs CachePlan.describe() of plan_kv_cache over the default model's KV spec and budget: here
    from `kvserve estimate --json`, whose block counts are the engine's own (tests/capacity checks that)."""
    assert main(["estimate", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    kv, model = doc["kv"][0], doc["model"]
    layout = make_kv_cache_layout(model["sliding_windows"], doc["hybrid_kv_cache_manager"])
    plan = plan_kv_cache(
        kv["bytes_per_block"],
        doc["block_size"],
        model["context_len"],
        budget_bytes=doc["budget"]["kv_bytes"],
        layout=layout,
        max_num_batched_tokens=doc["max_num_batched_tokens"],
    )
    assert_quoted(quoted_blocks()["the start-up log"], plan.describe())


def test_the_default_models_file_given_by_its_path_is_served_under_the_readmes_name() -> None:
    """`kvserve serve ~/.cache/.../gemma-3-270m-q4_k_m.gguf` answers the README's requests (model "gemma-3-270m")
    as `kvserve serve` does; another .gguf file keeps its own stem."""
    from kvserve.model.source import DEFAULT_MODEL_NAME, default_model_path, resolve_model

    path = default_model_path()
    assert resolve_model(str(path)).name == DEFAULT_MODEL_NAME == resolve_model(None).name
