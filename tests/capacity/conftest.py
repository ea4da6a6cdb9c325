"""The capacity tests reuse the tiny-checkpoint helpers of tests/models."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "models"))
