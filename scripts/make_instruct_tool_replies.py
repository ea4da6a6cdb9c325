"""Regenerate tests/fixtures/qwen25_coder_tool_replies.json: replies of the instruct model that greedy decoding never
writes, kept as the model wrote them so that the hermes parser is tested on the model's real output.

Greedy, Qwen2.5-Coder-0.5B-Instruct makes one call per reply even when asked for two (the greedy replies, checked
against HF, live in qwen25_coder_instruct_reference.json). Sampled, it writes parallel calls in two forms: one call
object per line inside one ```json fence, and bare objects one per line. kvserve samples them here (its greedy path
equals HF's; a sampled reply is the model's text whatever engine drew it, and the test only parses the stored text,
so a different host drawing other samples changes nothing). Each case records the chat, tools and sampling
parameters it was drawn with.

Usage: python scripts/make_instruct_tool_replies.py [--out PATH]   (about a minute on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
DEFAULT_OUT = REPO / "tests" / "fixtures" / "qwen25_coder_tool_replies.json"

from make_instruct_reference import TIME, WEATHER  # noqa: E402

TWICE = [{"role": "user", "content": "Call get_weather twice: once for Paris and once for London."}]
# Written for this fixture: name, messages, tools, sampling (temperature, seed, max_tokens).
CASES: list[dict] = [
    {"name": "parallel_fenced", "messages": TWICE, "tools": [WEATHER, TIME], "temperature": 0.8, "seed": 0},
    {"name": "parallel_bare", "messages": TWICE, "tools": [WEATHER, TIME], "temperature": 0.8, "seed": 1},
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from kvserve import SamplingParams
    from kvserve.engine.llm import LLM

    llm = LLM(model="qwen2.5-coder-0.5b-instruct", kv_cache_memory_bytes=256 << 20)
    replies = []
    for case in CASES:
        params = SamplingParams(temperature=case["temperature"], seed=case["seed"], max_tokens=200)
        (out,) = llm.chat([case["messages"]], params, tools=case["tools"], use_tqdm=False)
        completion = out.outputs[0]
        replies.append({**case, "max_tokens": 200, "text": completion.text, "finish_reason": completion.finish_reason})
        print(case["name"], repr(completion.text), completion.finish_reason, file=sys.stderr)
    doc = {"model": "qwen2.5-coder-0.5b-instruct", "drawn_by": "kvserve LLM.chat", "replies": replies}
    args.out.write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
