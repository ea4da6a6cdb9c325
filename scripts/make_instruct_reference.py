"""Regenerate tests/fixtures/qwen25_coder_instruct_reference.json: HF transformers on the instruct model's GGUF.

The instruct model (`--model qwen2.5-coder-0.5b-instruct`, kvserve/model/packaged.py) is checked against an
independent reference, as the default model is (scripts/make_reference_outputs.py):
- `tokenizer`: HF's GGUF tokenizer's ids for mixed text (code, Chinese, special tokens, tool tags);
- `templates`: the prompt text HF's apply_chat_template renders from the file's own chat template, for chats with
  tools, past tool calls and tool results (kvserve must render exactly this);
- `prompts`: per chat, the prompt ids, HF's greedy tokens (no EOS stop; the first stop index recorded) with each
  position's top-5 ids and logprobs (for vLLM's near-tie rule), and the decoded text: the raw replies of the tool
  chats are what tests/structured feed the hermes parser (the real model's own call formats).

HF's Qwen2ForCausalLM is loaded from the same GGUF, dequantized to float32 (eager attention). Each step is a full
no-cache forward over prompt + generated tokens, so no KV-cache code of HF's stands between model and reference.

`--chats FILE` (a JSON list of {"name", "messages", "tools"?}) records other chats into another `--out`: a reference
for prompts the tests do not contain, checked when KVSERVE_INSTRUCT_REFERENCE names it.

Usage: python scripts/make_instruct_reference.py [--out PATH] [--new-tokens 40] [--chats FILE]
Takes about 3 minutes and ~4 GB of memory on CPU (2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DEFAULT_OUT = REPO / "tests" / "fixtures" / "qwen25_coder_instruct_reference.json"
TOP_K = 5

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the current local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

# Written for this fixture.
CHATS: list[dict] = [
    {"name": "capital", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {
        "name": "code",
        "messages": [
            {"role": "user", "content": "Write a Python function is_prime(n) that checks whether n is prime."}
        ],
    },
    {"name": "chinese", "messages": [{"role": "user", "content": "用一句话介绍一下北京。"}]},
    {
        "name": "system",
        "messages": [
            {"role": "system", "content": "You answer in exactly one short sentence."},
            {"role": "user", "content": "Why is the sky blue?"},
        ],
    },
    {
        "name": "tool_weather",
        "messages": [{"role": "user", "content": "What's the weather like in Paris today?"}],
        "tools": [WEATHER],
    },
    {
        "name": "tool_two",
        "messages": [{"role": "user", "content": "What is the weather in Tokyo, and what time is it there?"}],
        "tools": [WEATHER, TIME],
    },
    {
        "name": "tool_not_needed",
        "messages": [{"role": "user", "content": "What is 12 times 12?"}],
        "tools": [WEATHER, TIME],
    },
    {
        "name": "tool_result",
        "messages": [
            {"role": "user", "content": "What's the weather like in Paris today?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18, "sky": "sunny"}'},
        ],
        "tools": [WEATHER],
    },
]

TOKENIZER_TEXTS = [
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "北京是中华人民共和国的首都。Mixed 中文 and English, 123.45!",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "<tools>\n</tools> <tool_response>ok</tool_response> <|endoftext|> <|fim_prefix|>x<|fim_suffix|>y<|fim_middle|>",
    "  leading spaces, tabs\t\tand emoji 🙂 — dashes… ",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--chats", type=Path, default=None, help="a JSON list of {name, messages, tools?}")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch
    import transformers
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvserve.model.source import resolve_model

    chats = json.loads(args.chats.read_text()) if args.chats else CHATS
    source = resolve_model("qwen2.5-coder-0.5b-instruct")
    started = time.time()
    tok = AutoTokenizer.from_pretrained(source.path.parent, gguf_file=source.path.name)
    model = AutoModelForCausalLM.from_pretrained(
        source.path.parent, gguf_file=source.path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    print(f"loaded in {time.time() - started:.0f} s", file=sys.stderr)
    stop_ids = sorted({tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")})

    prompts, templates = [], {}
    for chat in tqdm(chats, desc="greedy (HF, no cache)"):
        text = tok.apply_chat_template(
            chat["messages"], tools=chat.get("tools"), add_generation_prompt=True, tokenize=False
        )
        if chat.get("tools"):
            templates[chat["name"]] = text
        ids = tok(text, add_special_tokens=False)["input_ids"]
        seq, generated, top_ids, top_lps = list(ids), [], [], []
        with torch.no_grad():
            for _ in range(args.new_tokens):
                logits = model(torch.tensor([seq])).logits[0, -1].float()
                lp = torch.log_softmax(logits, dim=-1)
                values, indices = lp.topk(TOP_K)
                top_ids.append(indices.tolist())
                top_lps.append([round(v, 5) for v in values.tolist()])
                nxt = int(indices[0])
                generated.append(nxt)
                seq.append(nxt)
        first_stop = next((i for i, t in enumerate(generated) if t in stop_ids), None)
        reply = generated[:first_stop] if first_stop is not None else generated
        prompts.append(
            {
                "name": chat["name"],
                "prompt_token_ids": ids,
                "num_prompt_tokens": len(ids),
                "token_ids": generated,
                "top_ids": top_ids,
                "top_logprobs": top_lps,
                "first_stop_index": first_stop,
                "text": tok.decode(reply, skip_special_tokens=False),
            }
        )
    out = {
        "model": source.name,
        "model_file_size": source.path.stat().st_size,
        "reference": "HF transformers Qwen2ForCausalLM from the same GGUF, float32, eager, full forward per step",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "new_tokens": args.new_tokens,
        "top_k": TOP_K,
        "stop_ids": stop_ids,
        "tokenizer": [{"text": t, "ids": tok(t, add_special_tokens=False)["input_ids"]} for t in TOKENIZER_TEXTS],
        "chats": chats,
        "templates": templates,
        "prompts": prompts,
    }
    args.out.write_text(json.dumps(out, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {args.out} in {time.time() - started:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
