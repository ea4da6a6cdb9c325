"""What Qwen2.5-Coder-0.5B-Instruct does after a tool result (docs/AGENTS.md, "The loop after a tool result").

The chat: the weather question, the model's call, and the tool's result in four forms (JSON, a sentence, terse
text, a city-prefixed line), rendered by the file's own template, greedy. Printed for each: the reply with the tools
in the prompt, and without them (what --exclude-tools-when-tool-choice-none renders for tool_choice "none"), with no
system prompt and with one that says to answer. Usage: python scripts/probe_tool_result_loop.py (about a minute).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_instruct_reference import WEATHER

ANSWER = "You are a helpful assistant. Once a tool result is given, answer the user in one sentence."
RESULTS = [
    '{"temperature": 18, "sky": "sunny"}',
    "It is 18 degrees Celsius and sunny in Paris.",
    "18 C, sunny",
    "Paris: 18 C, sunny",
]


def chat(result: str, system: str | None) -> list[dict]:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    return [
        *([{"role": "system", "content": system}] if system else []),
        {"role": "user", "content": "What's the weather like in Paris today?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": result},
    ]


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from kvserve import SamplingParams
    from kvserve.engine.llm import LLM
    from kvserve.structured.tool_calls import extract_all
    from kvserve.structured.tool_parsers import HermesExtractor

    llm = LLM(model="qwen2.5-coder-0.5b-instruct", kv_cache_memory_bytes=256 << 20)
    params = SamplingParams(temperature=0, max_tokens=60)
    for system in (None, ANSWER):
        for tools in ([WEATHER], None):
            chats = [chat(r, system) for r in RESULTS]
            outs = llm.chat(chats, params, tools=tools, use_tqdm=False)
            answered = 0
            for result, out in zip(RESULTS, outs):
                text = out.outputs[0].text
                called = bool(extract_all(HermesExtractor(["get_weather"]), text).calls)
                answered += not called
                print(f"  {'calls again' if called else 'answers    '} | result {result!r}: {text[:90]!r}")
            where = "tools in the prompt" if tools else "no tools"
            print(f"system prompt {'answer' if system else 'none'}, {where}: {answered}/{len(RESULTS)} answer\n")


if __name__ == "__main__":
    main()
