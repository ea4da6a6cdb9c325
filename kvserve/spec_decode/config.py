"""SpeculativeConfig: vLLM's `--speculative-config` JSON, validated."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.json_flags import config_from_json_flag

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
    """The flag's JSON text, a dict (the offline API) or a config; None (the default) means off. A "method" is
    required (kvserve supports "ngram")."""
    return config_from_json_flag(value, SpeculativeConfig, "speculative_config", required=("method",))
