"""`kvserve bench hybrid-chat`: the synthetic vocabulary llama.cpp's converter is given (its size and merges), the
conversation's shape, and a whole run on a tiny LFM2 checkpoint (kvserve alone: no llama.cpp in CI)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_models import build_tiny_hf_model
from tiny_tokenizer import write_char_tokenizer

from kvserve.bench.hybrid_chat import ChatShape, _conversation, synthetic_vocabulary
from kvserve.cli import main


@pytest.mark.parametrize("size", [300, 65536, 70000])
def test_the_synthetic_vocabulary_has_the_models_size_and_a_merge_per_token(size):
    vocab, merges = synthetic_vocabulary(size)
    assert len(vocab) == size and sorted(vocab.values()) == list(range(size))
    assert len(merges) == min(size, 256 + 256 * 256) - 256
    assert all(a in vocab and b in vocab and a + b in vocab for a, b in merges[:: max(1, size // 500)])


def test_the_conversation_is_seeded_and_shaped():
    c = ChatShape(users=3, rounds=2, system_tokens=10, question_tokens=4, output_len=5)
    systems, questions, replies = _conversation(c, 1000)
    assert [len(s) for s in systems] == [10] * 3 and [len(q) for q in questions[0]] == [4, 4]
    assert [len(r) for r in replies] == [5, 5] and all(37 <= t < 999 for s in systems for t in s)
    assert _conversation(c, 1000) == (systems, questions, replies)
    shared, _, _ = _conversation(ChatShape(users=3, system_tokens=10, shared_system=True), 1000)
    assert shared[0] == shared[1] == shared[2]


def test_a_run_on_a_tiny_lfm2(tmp_path: Path, capsys):
    model = tmp_path / "lfm2"
    build_tiny_hf_model("lfm2_hybrid").save_pretrained(model)
    write_char_tokenizer(model)
    out = tmp_path / "hc.json"
    args = ["bench", "hybrid-chat", "--model", str(model), "--users", "2", "--rounds", "3", "--system-tokens", "40"]
    args += ["--question-tokens", "6", "--output-len", "4", "--max-model-len", "256", "--kv-cache-memory-bytes", "4MiB"]
    assert main([*args, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    row = report["results"]["systems"]["kvserve"]
    assert [r["round"] for r in row["rounds"]] == [1, 2, 3]
    assert row["rounds"][0]["hit_rate"] == 0
    # later rounds hit the previous round's prompt through its state snapshot (at least its system prompt's blocks)
    assert all(r["hit_rate"] >= 32 * 2 / r["prompt_tokens"] for r in row["rounds"][1:])
    assert row["ttft_ms_p50_later_rounds"] > 0
    assert "users x 3 rounds" in capsys.readouterr().out
