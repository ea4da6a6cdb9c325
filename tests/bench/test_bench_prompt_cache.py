"""`kvserve bench prompt-cache`: the agent trace's shape (marks where Claude Code puts them, histories that only grow,
other tenants unmarked), and a whole run on the tiny model: two kvserve servers, the report's systems and ratio."""

from __future__ import annotations

import json
from pathlib import Path

from kvserve.bench.prompt_cache import AgentTrace, build_trace
from kvserve.cli import main

TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def marks(body: dict) -> list[str]:
    where = [f"system[{j}]" for j, b in enumerate(body.get("system", [])) if "cache_control" in b]
    for i, m in enumerate(body["messages"]):
        if isinstance(m["content"], list):
            where += [f"messages[{i}].content[{j}]" for j, b in enumerate(m["content"]) if "cache_control" in b]
    return where


def test_the_trace_marks_the_system_and_the_newest_message_and_histories_grow():
    t = AgentTrace(agents=3, turns=4, system_words=50, fillers=2, filler_words=30)
    trace = build_trace(t)
    assert len(trace) == t.turns * (t.agents + t.fillers)
    agent0 = [r for r in trace if r.agent == 0]
    for turn, r in enumerate(agent0):
        assert r.turn == turn and len(r.body["messages"]) == 2 * turn + 1
        assert marks(r.body) == ["system[1]", f"messages[{2 * turn}].content[0]"]
    earlier, later = agent0[1].body["messages"], agent0[2].body["messages"]
    assert later[: len(earlier) - 1] == earlier[:-1]  # the history only grows (the old question loses its mark)
    assert all(marks(r.body) == [] for r in trace if r.agent < 0)
    assert build_trace(t) == trace  # seeded


def test_a_run_on_the_tiny_model(tiny_model_dir: Path, tmp_path: Path, capsys):
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    out = tmp_path / "pc.json"
    args = ["bench", "prompt-cache", "--model", str(tiny_model_dir), "--chat-template", str(template)]
    args += ["--agents", "2", "--turns", "2", "--system-words", "20", "--question-words", "4", "--reply-words", "4"]
    args += ["--fillers", "1", "--filler-words", "20", "--max-model-len", "256", "--kv-cache-memory-bytes", "2MiB"]
    assert main([*args, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    systems = report["results"]["systems"]
    assert set(systems) == {"kvserve pins", "kvserve no pins"}
    for row in systems.values():
        assert len(row["ttft_ms"]) == 2 and row["prompt_tokens"] > 0 and 0 < row["hit_rate"] <= 1
    assert report["ratios"]["ttft_p50_pins_over_no_pins"] > 0
    assert "Agent trace" in capsys.readouterr().out
