"""Where a later start's seconds go: the imports, the model package, the model config, the tokenizer and the
weights, each timed alone in order (`kvserve serve` loads the tokenizer in a thread beside the weights, so its
start is shorter than the sum). The breakdown quoted in docs/BENCHMARKS.md; the end-to-end figure is
scripts/measure_start.sh's. Not run by CI.

Usage: python scripts/profile_start.py
"""

from __future__ import annotations

import time

start = last = time.perf_counter()


def lap(what: str) -> None:
    global last
    now = time.perf_counter()
    print(f"{what:>16}: {now - last:5.2f} s")
    last = now


import torch  # noqa: E402

lap("import torch")
import fastapi  # noqa: E402, F401
import uvicorn  # noqa: E402, F401

from kvserve.server.app import build_app  # noqa: E402, F401

lap("import server")
from kvserve.model.loader import load_model, load_model_config  # noqa: E402
from kvserve.model.source import resolve_model  # noqa: E402
from kvserve.model.tokenizer import load_tokenizer  # noqa: E402

source = resolve_model(None)
lap("model package")
config = load_model_config(source)
lap("model config")
load_tokenizer(source)
lap("tokenizer")
load_model(source, torch.float32, torch.device("cpu"), quantization="q8_0", config=config)
lap("weights")
print(f"{'sum':>16}: {time.perf_counter() - start:5.2f} s")
