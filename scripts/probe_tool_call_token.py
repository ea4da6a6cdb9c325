"""How likely Qwen2.5-Coder-0.5B-Instruct is to open its reply with the `<tool_call>` tag its template asks for
(docs/AGENTS.md, "Why the call came back as content").

The weather chat with a get_weather tool, rendered by the file's own template with the generation prompt; the
logprob of each candidate first token of the reply is read as a prompt logprob (the candidate appended to the
prompt), beside the model's own top choices. Usage: python scripts/probe_tool_call_token.py (about 20 s).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_instruct_reference import WEATHER

CANDIDATES = ["<tool_call>", '{"', "```", "<"]


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from kvserve import SamplingParams
    from kvserve.engine.llm import LLM

    llm = LLM(model="qwen2.5-coder-0.5b-instruct", kv_cache_memory_bytes=256 << 20)
    tok = llm.get_tokenizer()
    chat = [{"role": "user", "content": "What's the weather like in Paris today?"}]
    prompt = tok.encode(
        tok.apply_chat_template(chat, tools=[WEATHER], add_generation_prompt=True), add_special_tokens=False
    )
    (top,) = llm.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1, logprobs=5), use_tqdm=False
    )
    print("the model's top 5 first tokens:")
    for token_id, lp in sorted(top.outputs[0].logprobs[0].items(), key=lambda kv: kv[1].rank):
        print(f"  {tok.decode([token_id])!r:>16}  logprob {lp.logprob:7.2f}")
    print("candidates:")
    for text in CANDIDATES:
        (token_id,) = tok.encode(text, add_special_tokens=False)
        params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
        (out,) = llm.generate([{"prompt_token_ids": [*prompt, token_id]}], params, use_tqdm=False)
        print(f"  {text!r:>16}  logprob {out.prompt_logprobs[-1][token_id].logprob:7.2f}")


if __name__ == "__main__":
    main()
