"""How often a model calls tools when it should, and only then: 24 tool-use prompts against a running server.

Each prompt comes with one or two function tools and says whether answering needs a call. Under tool_choice "auto",
greedy, a case passes when a needed call comes back as a valid `tool_calls` entry (a requested function, arguments
that parse as JSON and validate against its parameters schema) and when an unneeded one comes back with no call.
The prompts were written for this script (docs/AGENTS.md has the figures and the command).

Usage: kvserve serve --model qwen2.5-coder-0.5b-instruct --enable-auto-tool-choice --tool-call-parser hermes &
       python scripts/eval_tool_calls.py [--base-url http://127.0.0.1:8000/v1] [--out docs/bench/tool_eval.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def _tool(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    parameters = {"type": "object", "properties": properties, "required": required}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


WEATHER = _tool("get_weather", "Get the current weather in a city", {"city": {"type": "string"}}, ["city"])
TIME = _tool("get_time", "Get the current local time in a city", {"city": {"type": "string"}}, ["city"])
STOCK = _tool("get_stock_price", "Get the latest price of a stock", {"ticker": {"type": "string"}}, ["ticker"])
EMAIL = _tool(
    "send_email",
    "Send an email",
    {"to": {"type": "string"}, "subject": {"type": "string"}, "body": {"type": "string"}},
    ["to", "subject", "body"],
)
SEARCH = _tool("search_files", "Search the repository's files for a text", {"query": {"type": "string"}}, ["query"])
CONVERT = _tool(
    "convert_currency",
    "Convert an amount between currencies at today's rate",
    {"amount": {"type": "number"}, "from": {"type": "string"}, "to": {"type": "string"}},
    ["amount", "from", "to"],
)

# (prompt, tools, the function a correct answer calls, or None when no call is needed)
CASES: list[tuple[str, list[dict[str, Any]], str | None]] = [
    ("What's the weather like in Paris today?", [WEATHER], "get_weather"),
    ("Is it raining in Tokyo right now?", [WEATHER], "get_weather"),
    ("What time is it in Sydney?", [WEATHER, TIME], "get_time"),
    ("How warm is it in Cairo at the moment?", [WEATHER, TIME], "get_weather"),
    ("What is Apple's stock price (AAPL) right now?", [STOCK], "get_stock_price"),
    ("Check the current price of NVDA for me.", [STOCK, WEATHER], "get_stock_price"),
    ("Email bob@example.com with subject 'Lunch' saying I'll be 10 minutes late.", [EMAIL], "send_email"),
    ("Find where the function parse_config is defined in the repo.", [SEARCH], "search_files"),
    ("Search the code for TODO comments.", [SEARCH, EMAIL], "search_files"),
    ("How much is 250 US dollars in euros today?", [CONVERT], "convert_currency"),
    ("Convert 1000 yen to British pounds.", [CONVERT, STOCK], "convert_currency"),
    ("Tell me the local time in New York.", [TIME], "get_time"),
    ("What is 12 times 12?", [WEATHER, TIME], None),
    ("Write a Python function that reverses a string.", [WEATHER], None),
    ("What is the capital of Italy?", [WEATHER], None),
    ("Explain what a hash map is in one sentence.", [SEARCH], None),
    ("Translate 'good morning' into Spanish.", [EMAIL], None),
    ("Hello! How are you?", [WEATHER, TIME], None),
    ("What does HTTP stand for?", [STOCK], None),
    ("Sort the list [3, 1, 2] in ascending order.", [SEARCH, EMAIL], None),
    ("Give me a synonym for 'happy'.", [CONVERT], None),
    ("Write a SQL query that counts the rows of a table named users.", [SEARCH], None),
    ("Who wrote Romeo and Juliet?", [WEATHER, STOCK], None),
    ("What is the square root of 81?", [CONVERT], None),
]


def _valid_call(call: Any, tools: list[dict[str, Any]]) -> bool:
    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    if call.function.name not in schemas:
        return False
    try:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default=None, help="default: the server's only model")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=None, help="write every case's outcome as JSON")
    args = ap.parse_args()

    import openai
    from tqdm import tqdm

    client = openai.OpenAI(base_url=args.base_url, api_key="unused")
    model = args.model or client.models.list().data[0].id
    rows = []
    for prompt, tools, expected in tqdm(CASES, desc="tool calls"):
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            tools=tools,  # type: ignore[arg-type]
            tool_choice="auto",
            temperature=0,
            max_tokens=args.max_tokens,
        )
        message = r.choices[0].message
        calls = message.tool_calls or []
        if expected is None:
            passed = not calls
        else:
            passed = bool(calls) and calls[0].function.name == expected and all(_valid_call(c, tools) for c in calls)
        rows.append(
            {
                "prompt": prompt,
                "tools": [t["function"]["name"] for t in tools],
                "expected": expected,
                "calls": [{"name": c.function.name, "arguments": c.function.arguments} for c in calls],
                "content": message.content,
                "finish_reason": r.choices[0].finish_reason,
                "passed": passed,
            }
        )
    needed = [r for r in rows if r["expected"] is not None]
    not_needed = [r for r in rows if r["expected"] is None]
    summary = {
        "model": model,
        "cases": len(rows),
        "call_when_needed": f"{sum(r['passed'] for r in needed)}/{len(needed)}",
        "no_call_when_not_needed": f"{sum(r['passed'] for r in not_needed)}/{len(not_needed)}",
        "passed": f"{sum(r['passed'] for r in rows)}/{len(rows)}",
    }
    print(json.dumps(summary, indent=1))
    for r in rows:
        if not r["passed"]:
            print(f"  FAILED {r['prompt']!r}: calls {r['calls']}, content {r['content']!r}", file=sys.stderr)
    if args.out is not None:
        args.out.write_text(json.dumps({"summary": summary, "cases": rows}, ensure_ascii=False, indent=1) + "\n")


if __name__ == "__main__":
    main()
