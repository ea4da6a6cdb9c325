"""SpeculativeConfig: vLLM's `--speculative-config` JSON, validated."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

# Methods vLLM has that kvserve does not (a second model or extra heads): named so the error can say so.
_UNSUPPORTED_METHODS = ("draft_model", "eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "suffix")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """vLLM's keys (method, num_speculative_tokens, prompt_lookup_max/min) plus the adaptive gate's settings.

    disable_by_batch_size: no request drafts while more than this many run. Verification of k drafts costs
    about one weight read at batch 1, but at larger batches the step is no longer bandwidth-bound and the
    extra query tokens cost real compute (llama.cpp's lookup decoding loses at 4-8 slots); see
    docs/SPECULATIVE.md. min_acceptance_rate / acceptance_window: a request whose accepted share of the
    drafted tokens stays below the rate over its first `acceptance_window` drafted tokens stops drafting."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    disable_by_batch_size: int = 2
    min_acceptance_rate: float = 0.2
    acceptance_window: int = 16

    def __post_init__(self) -> None:
        if self.method in _UNSUPPORTED_METHODS:
            raise ValueError(f"speculative method {self.method!r} is not supported by kvserve; use \"ngram\" "
                             "(prompt lookup, no draft model)")
        if self.method != "ngram":
            raise ValueError(f"unknown speculative method {self.method!r}; kvserve supports \"ngram\"")
        checks = [
            (self.num_speculative_tokens >= 1, "num_speculative_tokens", ">= 1"),
            (self.prompt_lookup_min >= 1, "prompt_lookup_min", ">= 1"),
            (self.prompt_lookup_max >= self.prompt_lookup_min, "prompt_lookup_max", ">= prompt_lookup_min"),
            (self.disable_by_batch_size >= 1, "disable_by_batch_size", ">= 1"),
            (0.0 <= self.min_acceptance_rate <= 1.0, "min_acceptance_rate", "in [0, 1]"),
            (self.acceptance_window >= 1, "acceptance_window", ">= 1"),
        ]
        for ok, name, expected in checks:
            if not ok:
                raise ValueError(f"speculative_config {name} must be {expected}, got {getattr(self, name)!r}")


def parse_speculative_config(value: str | dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """The flag's JSON text, a dict (the offline API) or a config; None (the default) means off."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--speculative-config must be a JSON object, got {type(value).__name__}")
    known = {f.name for f in fields(SpeculativeConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"unknown speculative_config keys {unknown}; known: {sorted(known)}")
    if "method" not in value:
        raise ValueError("speculative_config needs a \"method\" (kvserve supports \"ngram\")")
    return SpeculativeConfig(**value)
