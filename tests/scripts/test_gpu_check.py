"""scripts/gpu_check.py, the prepared GPU proof of issue #20, run here on CPU in --tiny mode: end to end as the
device tool runs it (a subprocess, kvserve on PYTHONPATH), then its checks shown able to fail, and its report
shown to survive a failing section and an overrun one."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check  # noqa: E402
from gpu_check_markdown import markdown  # noqa: E402
from gpu_check_measure import LogitsCase, check_greedy, check_logits, random_prompts  # noqa: E402
from gpu_check_models import ARCHS, build_checkpoint  # noqa: E402

from kvserve.config import EngineConfig  # noqa: E402
from kvserve.engine.engine import LLMEngine  # noqa: E402

TINY_BATCHES = gpu_check.Plan.for_run(tiny=True, budget_s=None, dtypes=None).speed_batches


# Runs the script as `python scripts/gpu_check.py ARGS` would, in a process where the packages the GPU machine
# lacks cannot be imported (None in sys.modules makes their import fail): proof that the engine path needs none.
WITHOUT_ABSENT_PACKAGES = """
import runpy, sys
sys.modules.update(dict.fromkeys(sys.argv[1].split(",")))
sys.argv = sys.argv[2:]
sys.path.insert(0, sys.argv[0].rpartition("/")[0])
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_script(out: Path, *args: str, **variables: str) -> subprocess.CompletedProcess[str]:
    """`python scripts/gpu_check.py --device cpu --tiny --out OUT ARGS`, without the GPU machine's absent packages,
    with `variables` added to the environment."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **variables}
    absent = ",".join(gpu_check.ABSENT_ON_GPU_MACHINE)
    script = str(ROOT / "scripts" / "gpu_check.py")
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            WITHOUT_ABSENT_PACKAGES,
            absent,
            script,
            "--device",
            "cpu",
            "--tiny",
            "--out",
            str(out),
            *args,
        ],
        env=env,
        cwd=out.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("gpu_check") / "report.json"
    proc = run_script(out)
    assert "llama31_8b.speed_b1" in proc.stdout  # one line per section, for the device tool's output tail
    return json.loads(out.read_text())


def test_every_section_ran_and_passed(report: dict[str, Any]) -> None:
    per_arch = [
        "checkpoint",
        "engine_float32",
        "logits_float32",
        "greedy_float32",
        "speed_engine",
        *(f"speed_b{b}" for b in TINY_BATCHES),
    ]
    expected = {"machine", "ceilings", "import_audit", *(f"{a}.{s}" for a in ARCHS for s in per_arch)}
    expected.add("gemma3_270m.layouts_float32")  # the sliding-window model: hybrid against uniform KV layout
    assert set(report["sections"]) == expected
    layouts = report["sections"]["gemma3_270m.layouts_float32"]
    assert (
        layouts["passed"] and layouts["identical"] == layouts["prompts"] == 3 and "sliding window" in layouts["groups"]
    )
    assert {name: s["status"] for name, s in report["sections"].items() if s["status"] != "ok"} == {}
    assert report["summary"]["passed"] and report["summary"]["not_passed"] == []
    assert report["engine_options"] == {"applied": {"device": "cpu"}, "unavailable": {}}
    assert report["sections"]["machine"]["torch"] == torch.__version__


def test_correctness_figures(report: dict[str, Any]) -> None:
    sections = report["sections"]
    for arch in ARCHS:
        logits = sections[f"{arch}.logits_float32"]
        expected_positions = sum(n + logits["continuation"] - 1 for n in logits["prompt_lengths"])
        assert logits["positions"] == expected_positions  # every prompt and decode position was compared
        assert logits["kvserve_vs_hf_float32"]["max_abs"] < 1e-4  # on CPU: far inside the GPU's tolerance
        greedy = sections[f"{arch}.greedy_float32"]
        assert greedy["preemptions"] > 0
        assert greedy["tokens"]["wrong"] == 0
        assert sum(greedy["tokens"].values()) == greedy["requests"] * greedy["new_tokens"]
    # Gemma's prompts outgrow its sliding window (8 in --tiny), so the window is exercised.
    assert min(sections["gemma3_270m.logits_float32"]["prompt_lengths"]) > 8


def test_speed_rows_and_targets(report: dict[str, Any]) -> None:
    for arch in ARCHS:
        for batch in TINY_BATCHES:
            row = report["sections"][f"{arch}.speed_b{batch}"]
            assert row["batch"] == batch
            for side in ("kvserve", "hf"):
                figures = row[side]
                assert figures["decode_tok_s"] > 0 and figures["prefill_tok_s"] > 0
                assert figures["decode_x_floor"] >= 1  # a floor nobody beats, or the floor's arithmetic is wrong
            assert row["kvserve_over_hf_decode"] == pytest.approx(
                row["kvserve"]["decode_tok_s"] / row["hf"]["decode_tok_s"]
            )
    targets = report["targets"]
    assert targets["meaningful"] is False
    assert (
        targets["batch1_decode_x_floor"]["value"]
        == report["sections"]["llama31_8b.speed_b1"]["kvserve"]["decode_x_floor"]
    )
    assert targets["batch64_decode_over_hf"]["met"] is None  # --tiny has no batch 64


def test_markdown_tables(report: dict[str, Any]) -> None:
    text = markdown(report)
    assert text.count("| llama31_8b | ") == 2 + len(TINY_BATCHES)  # two correctness rows, one row per batch
    assert "| gemma3_270m | logits_float32 | ok |" in text
    assert "target batch64_decode_over_hf: - (wanted >= 10.0): not measured" in text


def test_import_audit(report: dict[str, Any]) -> None:
    audit = report["sections"]["import_audit"]
    assert "kvserve" in audit["third_party"] and "torch" in audit["third_party"]
    assert audit["imported_but_absent_there"] == []


def test_the_triton_backend_through_the_engine(tmp_path: Path) -> None:
    """The correctness sections with --attention-backend triton, its kernels in Triton's interpreter on CPU: the
    engine's whole Triton path (chunked prefill over a paged prefix, batched decode, preemption; MQA with sliding
    windows in Gemma, GQA in Llama) against HF, as the GPU run will check it on the device."""
    if importlib.util.find_spec("triton") is None:  # found, not imported: see tests/attention/conftest.py
        pytest.skip("triton is not installed")
    out = tmp_path / "report.json"
    run_script(
        out,
        "--attention-backend",
        "triton",
        "--models",
        "gemma3_270m,llama31_8b",
        "--speed-batches",
        "",
        TRITON_INTERPRET="1",
    )
    sections = json.loads(out.read_text())["sections"]
    for arch in ("gemma3_270m", "llama31_8b"):
        assert sections[f"{arch}.engine_float32"]["config"]["attention_backend"] == "triton"
        assert sections[f"{arch}.logits_float32"]["status"] == sections[f"{arch}.greedy_float32"]["status"] == "ok"
    assert not any(".speed" in name for name in sections)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, LLMEngine]:
    ck = build_checkpoint(ARCHS["llama31_8b"], True, torch.device("cpu"), tmp_path_factory.mktemp("llama"))
    engine = LLMEngine.from_config(
        EngineConfig(
            model=str(ck.path),
            dtype="float32",
            num_gpu_blocks_override=64,
            max_model_len=128,
            max_num_batched_tokens=16,
        )
    )
    return ck, engine


def _impostor() -> Any:
    """The same architecture with other random weights: a reference kvserve cannot match."""
    import transformers

    torch.manual_seed(1)
    return transformers.LlamaForCausalLM(ARCHS["llama31_8b"].hf_config(tiny=True)).float().eval()


def test_the_checks_can_fail(tiny_llama: tuple[Any, LLMEngine]) -> None:
    ck, engine = tiny_llama
    case = LogitsCase(random_prompts([20, 13], ck.vocab_size, seed=3), continuation=4)
    assert check_logits(engine, "float32", case, ck.reference, ck.hf_bf16, ck.vocab_size)["passed"]
    impostor = _impostor()
    assert not check_logits(engine, "float32", case, impostor, ck.hf_bf16, ck.vocab_size)["passed"]
    bf16 = LLMEngine.from_config(
        EngineConfig(model=str(ck.path), dtype="bfloat16", num_gpu_blocks_override=64, max_model_len=128)
    )
    assert check_logits(bf16, "bfloat16", case, ck.reference, ck.hf_bf16, ck.vocab_size)["passed"]
    assert not check_logits(bf16, "bfloat16", case, impostor, ck.hf_bf16, ck.vocab_size)["passed"]
    small = engine.sibling(num_gpu_blocks_override=5, max_model_len=64)
    prompts = random_prompts([9, 15, 21], ck.vocab_size, seed=4)
    result = check_greedy(engine, small, prompts, 12, impostor)
    assert result["preemptions"] > 0 and result["tokens"]["wrong"] > 0 and not result["passed"]


def test_engine_options_report_what_this_kvserve_lacks() -> None:
    applied, unavailable = gpu_check.engine_options("cpu", "no-such-backend", {"not_a_field": 1, "block_size": 32})
    assert applied == {"device": "cpu", "block_size": 32}
    assert set(unavailable) == {"attention_backend", "not_a_field"}


def test_a_failing_engine_keeps_the_early_sections(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    rc = gpu_check.main(
        ["--device", "cpu", "--tiny", "--models", "llama31_8b", "--out", str(out), "--engine-arg", "max_num_seqs=0"]
    )  # EngineConfig refuses it: every engine fails
    sections = json.loads(out.read_text())["sections"]
    assert rc == 1
    assert sections["machine"]["status"] == sections["llama31_8b.checkpoint"]["status"] == "ok"
    assert sections["llama31_8b.engine_float32"]["status"] == "error"
    assert "max_num_seqs" in sections["llama31_8b.engine_float32"]["error"].replace("-", "_")
    assert sections["llama31_8b.logits_float32"]["status"] == "skipped"
    assert sections["llama31_8b.speed_b1"]["reason"] == "needs llama31_8b.engine_float32"


def test_an_overrun_section_times_out_and_the_rest_is_skipped(tmp_path: Path) -> None:
    def slow() -> gpu_check.Outcome:
        time.sleep(30)
        return gpu_check.Outcome({})

    report = gpu_check.Report(tmp_path / "r.json", {}, budget_s=0.5)
    assert report.run("slow", slow, min_s=0.1) is None
    assert report.run("later", lambda: gpu_check.Outcome({"x": 1}), min_s=1) is None
    sections = json.loads((tmp_path / "r.json").read_text())["sections"]
    assert sections["slow"]["status"] == "timeout" and sections["slow"]["seconds"] < 30
    assert sections["later"]["status"] == "skipped"
