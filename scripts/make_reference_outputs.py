"""Regenerate tests/fixtures/gemma3_270m_reference.json: HF transformers' greedy outputs on the default GGUF.

The reference is HF's Gemma3ForCausalLM loaded from the same GGUF (dequantized to float32, eager
attention so that the sliding-window mask is explicit). For each prompt it records the prompt ids (BOS
once), 32 greedy tokens with no EOS stop (the first EOS/<end_of_turn> index is recorded instead), the
decoded text, and each position's top-5 ids and logprobs, so that near-ties can be judged the way vLLM's
check_logprobs_close does. Every step is a full no-cache forward over prompt + generated tokens: slower,
but no KV-cache code of HF's stands between the model and the reference.

One prompt is longer than 600 tokens, so prompt and generation cross the 512-token sliding window; the
script checks that the window changes the logits (a full-attention run must differ) and records that.

`--prompts FILE` (a JSON list of strings) records other prompts instead, into another `--out`: a reference for
prompts the tests do not contain, which tests/e2e/test_gguf_blocks_real.py checks when KVSERVE_GREEDY_REFERENCE
names it (#16: the default path must equal HF there too).

Usage: python scripts/make_reference_outputs.py [--gguf PATH] [--out PATH] [--new-tokens 32] [--prompts FILE]
Takes a few minutes and ~3 GB of memory on CPU.
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
DEFAULT_OUT = REPO / "tests" / "fixtures" / "gemma3_270m_reference.json"
BOS_ID = 2
STOP_IDS = (1, 106)  # <eos>, <end_of_turn>
TOP_K = 5

# Written for this fixture (no outside text): varied sentences so the model sees no exact loop.
_LONG_PARTS = [
    "The old lighthouse stood at the edge of the northern cliffs, where the wind never rested.",
    "Every evening the keeper climbed its one hundred and twelve steps to light the great lamp.",
    "Fishermen far out at sea watched for the beam, and when it swept across the water they knew the way home.",
    "In winter the storms came from the west, heavy with rain, and the waves struck the rocks like drums.",
    "The keeper wrote in a small book each night: the weather, the ships that passed, "
    "the birds that rested on the rail.",
    "Over forty years the book grew into a shelf of books, and the shelf into a wall of them.",
    "Children from the village sometimes walked up the path to ask him about the sea and its moods.",
    "He told them that the sea was patient, that it remembered everything, and that it forgave nothing.",
]


def long_prompt(min_words: int = 520) -> str:
    """A >600-token story: the parts cycled with a counter so that no paragraph repeats verbatim."""
    paras, words, i = [], 0, 0
    while words < min_words:
        part = _LONG_PARTS[i % len(_LONG_PARTS)]
        para = f"In year {1900 + 3 * i} of the keeper's watch: {part}"
        paras.append(para)
        words += len(para.split())
        i += 1
    return " ".join(paras) + " On the last night of his watch, the keeper"


def prompts(hf_tok) -> list[dict]:
    from kvserve.model.chat_template import GEMMA_CHAT_TEMPLATE

    chat_messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    chat_text = hf_tok.apply_chat_template(
        chat_messages, chat_template=GEMMA_CHAT_TEMPLATE, add_generation_prompt=True, tokenize=False
    )
    return [
        {"name": "capital_france", "text": "The capital of France is"},
        {"name": "largest_planet", "text": "The largest planet in our solar system is"},
        {"name": "code_fibonacci", "text": 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'},
        {"name": "chat_rainbow", "text": chat_text, "messages": chat_messages},
        {"name": "long_lighthouse", "text": long_prompt()},
    ]


def encode(hf_tok, text: str) -> list[int]:
    """kvserve's rule: BOS once (a chat template's own <bos> is not doubled)."""
    ids = hf_tok.encode(text, add_special_tokens=False)
    return ids if ids[:1] == [BOS_ID] else [BOS_ID, *ids]


def greedy(model, ids: list[int], n: int) -> dict:
    import torch

    seq = list(ids)
    out = {"token_ids": [], "top_ids": [], "top_logprobs": [], "first_stop_index": None}
    for step in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([seq]), use_cache=False).logits[0, -1].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        top = torch.topk(logprobs, TOP_K)
        nxt = int(torch.argmax(logits))
        out["token_ids"].append(nxt)
        out["top_ids"].append([int(i) for i in top.indices])
        out["top_logprobs"].append([round(float(v), 5) for v in top.values])
        if nxt in STOP_IDS and out["first_stop_index"] is None:
            out["first_stop_index"] = step
        seq.append(nxt)
    return out


def window_check(model, ids: list[int]) -> float:
    """Max |logit difference| at the last prompt position between windowed and full attention."""
    import torch

    with torch.no_grad():
        windowed = model(torch.tensor([ids]), use_cache=False).logits[0, -1].float()
        saved = model.config.sliding_window
        model.config.sliding_window = 1 << 20
        try:
            full = model(torch.tensor([ids]), use_cache=False).logits[0, -1].float()
        finally:
            model.config.sliding_window = saved
    return float((windowed - full).abs().max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, default=None, help="default: the packaged Gemma 3 270M GGUF")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompts", type=Path, default=None, help="a JSON list of prompt strings (default: the fixture's)")
    args = ap.parse_args()
    if args.prompts is not None and args.out.resolve() == DEFAULT_OUT.resolve():
        raise SystemExit("--prompts writes another reference: give it its own --out")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvserve.model.source import default_model_path

    gguf = (args.gguf or default_model_path()).resolve()
    t0 = time.perf_counter()
    hf_tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent),
        gguf_file=gguf.name,
        dtype=torch.float32,
        attn_implementation="eager",
        local_files_only=True,
    ).eval()
    print(
        f"loaded in {time.perf_counter() - t0:.0f} s: {type(model).__name__}, attn={model.config._attn_implementation}"
    )
    cfg = model.config.get_text_config()
    layer_types = list(getattr(cfg, "layer_types", []) or [])
    print(f"sliding_window={cfg.sliding_window} layer_types={layer_types}")
    if cfg.sliding_window != 512 or "sliding_attention" not in layer_types:
        raise SystemExit("HF's config lost the sliding window; the reference would be wrong")

    records = []
    chosen = (
        prompts(hf_tok)
        if args.prompts is None
        else [{"name": f"prompt_{i}", "text": text} for i, text in enumerate(json.loads(args.prompts.read_text()))]
    )
    for p in chosen:
        ids = encode(hf_tok, p["text"])
        t1 = time.perf_counter()
        gen = greedy(model, ids, args.new_tokens)
        rec = {"name": p["name"], "prompt": p["text"], "prompt_token_ids": ids, "num_prompt_tokens": len(ids)}
        if "messages" in p:
            rec["messages"] = p["messages"]
        rec.update(gen)
        rec["text"] = hf_tok.decode(gen["token_ids"], skip_special_tokens=True)
        if len(ids) > 512:
            rec["window_vs_full_max_abs_logit_diff"] = round(window_check(model, ids), 4)
            if rec["window_vs_full_max_abs_logit_diff"] == 0.0:
                raise SystemExit("the sliding window did not change the logits: it is not being honoured")
        print(f"{p['name']}: {len(ids)} prompt tokens, {time.perf_counter() - t1:.0f} s -> {rec['text']!r}")
        records.append(rec)

    fixture = {
        "model_file": gguf.name,
        "model_file_size": gguf.stat().st_size,
        "reference": "transformers AutoModelForCausalLM from the GGUF, float32, eager attention, no KV cache",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "sliding_window": cfg.sliding_window,
        "layer_types": layer_types,
        "new_tokens": args.new_tokens,
        "top_k": TOP_K,
        "stop_ids_recorded": list(STOP_IDS),
        "prompts": records,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(fixture, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out} ({args.out.stat().st_size // 1024} KB)")


if __name__ == "__main__":
    main()
