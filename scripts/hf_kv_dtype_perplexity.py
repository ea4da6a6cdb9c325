"""What each --kv-cache-dtype does to HF transformers itself: HF's model on the same GGUF file, with its attention's K
and V (after rope, as kvserve caches them) rounded to each KV dtype the way kvserve stores them (bfloat16 / float16 by
a cast; the 8-bit formats by kvserve/kv/quant.py's per-token-head scales), and the perplexity of `kvserve bench
kv-dtype`'s text. Where kvserve's perplexity at a dtype equals HF's here, kvserve computes what the stored values
imply and the change against float32 KV is the format's own (docs/KV_QUANT.md). Not run by CI (HF loads the
dequantized model: a minute or two).

Usage: python scripts/hf_kv_dtype_perplexity.py [--model qwen2.5-coder-0.5b-instruct] [--tokens 2000]
"""

from __future__ import annotations

import argparse
import importlib
import math
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from kvserve.bench.kv_dtype import GPL3, perplexity_ids
from kvserve.config import EngineConfig
from kvserve.dtypes import torch_dtype
from kvserve.engine.engine import LLMEngine
from kvserve.kv.quant import fake_quantize, quant_format
from kvserve.model.source import resolve_model

DTYPES = ("float32", "bfloat16", "float16", "int8", "fp8_e4m3", "fp8_e5m2")


def rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [batch, kv_heads, seq, head_dim] as kvserve would store and read it back at `dtype`."""
    fmt = quant_format(dtype)
    return x.to(dtype).float() if fmt is None else fake_quantize(x, fmt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a packaged model's name or a GGUF path (default: the default)")
    parser.add_argument("--tokens", type=int, default=2000, help="tokens of the perplexity text (bench kv-dtype's)")
    args = parser.parse_args()
    source = resolve_model(args.model)
    engine = LLMEngine.from_config(EngineConfig(model=args.model, kv_cache_memory_bytes=1 << 28))
    ids = perplexity_ids(engine, GPL3.read_text(encoding="utf-8"), args.tokens)
    family = engine.core.model_config.family
    del engine
    model = AutoModelForCausalLM.from_pretrained(
        str(source.path.parent), gguf_file=source.path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    original = modeling.eager_attention_forward
    chosen: list[torch.dtype | None] = [None]

    def attention(
        module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *rest: Any, **kwargs: Any
    ) -> Any:
        if chosen[0] is not None:
            key, value = rounded(key, chosen[0]), rounded(value, chosen[0])
        return original(module, query, key, value, *rest, **kwargs)

    modeling.eager_attention_forward = attention
    x = torch.tensor([ids])
    print(f"HF transformers on {source.path.name}, {len(ids) - 1} tokens of {GPL3.name}, KV as kvserve stores it")
    for name in DTYPES:
        chosen[0] = None if name == "float32" else torch_dtype(name)
        with torch.no_grad():
            logits = model(x).logits[0, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits, x[0, 1:]).item()
        print(f"{name:9} perplexity {math.exp(nll):.3f}", flush=True)


if __name__ == "__main__":
    main()
