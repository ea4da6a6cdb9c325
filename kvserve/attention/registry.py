"""The attention backends by their `--attention-backend` name (the names are kvserve/vocab.py's)."""

from __future__ import annotations

from kvserve.attention.backend import AttentionBackend
from kvserve.attention.cpu import cpu_attention
from kvserve.attention.reference import reference_attention
from kvserve.attention.triton import triton_attention
from kvserve.vocab import ATTENTION_BACKENDS, check_choice

# One implementation per name of ATTENTION_BACKENDS (tests/unit/test_vocab.py checks they agree).
BACKENDS: dict[str, AttentionBackend] = {
    "cpu": cpu_attention,
    "reference": reference_attention,
    "triton": triton_attention,
}


def get_attention_backend(name: str) -> AttentionBackend:
    """The attention implementation every layer calls: "cpu" (the fast CPU path), "reference" (the truth) or
    "triton" (paged Triton kernels, CUDA)."""
    return BACKENDS[check_choice("--attention-backend", name, ATTENTION_BACKENDS)]
