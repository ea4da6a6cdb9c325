"""The differential fuzzer over every cache layer (docs/RELIABILITY.md): seeded workloads on tiny random checkpoints
of each layer kind, every request checked against the same prompt run alone with every cache off.

`python -m tests.fuzz --minutes N` runs seeds for N minutes; `python -m tests.fuzz --seed S [--only I,J]` replays one
(shrunk to the requests a failure printed). CI runs tests/fuzz/test_fuzz_seeds.py's fixed seeds."""

import sys
from pathlib import Path

# The tiny checkpoints' builders live beside the model tests (tests/models/tiny_models.py, tiny_tokenizer.py).
_MODELS = str(Path(__file__).resolve().parent.parent / "models")
if _MODELS not in sys.path:
    sys.path.insert(0, _MODELS)
