"""SpeculativeConfig: vLLM's `--speculative-config` JSON, validated."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvserve.json_flags import check_field_types, config_from_json_flag

# Methods vLLM has that kvserve does not (a second model or extra heads): named so the error can say so.
_UNSUPPORTED_METHODS = ("draft_model", "eagle", "eagle3", "medusa", "mlp_speculator", "mtp")
_METHODS = ("ngram", "suffix")
# num_speculative_tokens when the flag leaves it out, by method. Suffix drafts stop by themselves where the counts
# say a guess is unlikely, so a longer cap costs little when it is not used and pays on long copies; vLLM's 32 is
# a GPU's, where verifying 32 rows costs about what one does; on a CPU each verified row is real arithmetic
# (docs/SPECULATIVE_SUFFIX.md has the measurement).
_DEFAULT_NUM_SPECULATIVE_TOKENS = {"ngram": 4, "suffix": 8}


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """vLLM's keys (method, num_speculative_tokens, prompt_lookup_max/min, suffix_decoding_*) plus the adaptive
    gate's settings.

    disable_by_batch_size: no request drafts while more than this many run. Verification of k drafts costs
    about one weight read at batch 1, but at larger batches the step is no longer bandwidth-bound and the
    extra query tokens cost real compute (llama.cpp's lookup decoding loses at 4-8 slots); see
    docs/SPECULATIVE.md. min_acceptance_rate / acceptance_window: a request whose accepted share of the
    drafted tokens stays below the rate over its first `acceptance_window` drafted tokens stops drafting.

    suffix_decoding_*: the `suffix` method (spec_decode/suffix.py): the tries' depth (longest match + draft), how
    many finished requests' outputs the global trie holds (0: none), the cap of a draft's length per matched token,
    and the lowest estimated probability of reaching a drafted token. num_speculative_tokens left out of the
    flag's JSON defaults per method (_DEFAULT_NUM_SPECULATIVE_TOKENS)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    disable_by_batch_size: int = 2
    min_acceptance_rate: float = 0.2
    acceptance_window: int = 16
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    def __post_init__(self) -> None:
        check_field_types(self, "speculative_config")
        if self.method in _UNSUPPORTED_METHODS:
            raise ValueError(
                f'speculative method {self.method!r} is not supported by kvserve; use "ngram" '
                '(prompt lookup) or "suffix" (suffix trees), which need no draft model'
            )
        if self.method not in _METHODS:
            raise ValueError(f'unknown speculative method {self.method!r}; kvserve supports "ngram" and "suffix"')
        checks = [
            (self.num_speculative_tokens >= 1, "num_speculative_tokens", ">= 1"),
            (self.prompt_lookup_min >= 1, "prompt_lookup_min", ">= 1"),
            (self.prompt_lookup_max >= self.prompt_lookup_min, "prompt_lookup_max", ">= prompt_lookup_min"),
            (self.disable_by_batch_size >= 1, "disable_by_batch_size", ">= 1"),
            (0.0 <= self.min_acceptance_rate <= 1.0, "min_acceptance_rate", "in [0, 1]"),
            (self.acceptance_window >= 1, "acceptance_window", ">= 1"),
            (
                self.suffix_decoding_max_tree_depth >= 2,
                "suffix_decoding_max_tree_depth",
                ">= 2 (one token to match, one to draft)",
            ),
            (self.suffix_decoding_max_cached_requests >= 0, "suffix_decoding_max_cached_requests", ">= 0"),
            (self.suffix_decoding_max_spec_factor > 0, "suffix_decoding_max_spec_factor", "> 0"),
            (0.0 <= self.suffix_decoding_min_token_prob <= 1.0, "suffix_decoding_min_token_prob", "in [0, 1]"),
        ]
        for ok, name, expected in checks:
            if not ok:
                raise ValueError(f"speculative_config {name} must be {expected}, got {getattr(self, name)!r}")


def parse_speculative_config(value: str | dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """The flag's JSON text, a dict (the offline API) or a config; None (the default) means off. A "method" is
    required (kvserve supports "ngram" and "suffix"); num_speculative_tokens defaults by method."""
    return config_from_json_flag(
        _with_method_default(value), SpeculativeConfig, "speculative_config", required=("method",)
    )


def _with_method_default(
    value: str | dict[str, Any] | SpeculativeConfig | None,
) -> str | dict[str, Any] | SpeculativeConfig | None:
    """A JSON object (text or dict) with its method's num_speculative_tokens filled in when left out; anything
    else as it is (config_from_json_flag reports what is wrong with it)."""
    obj = value
    if isinstance(value, str):
        try:
            obj = json.loads(value)
        except json.JSONDecodeError:
            return value
    if isinstance(obj, dict) and obj.get("method") in _DEFAULT_NUM_SPECULATIVE_TOKENS:
        return {"num_speculative_tokens": _DEFAULT_NUM_SPECULATIVE_TOKENS[obj["method"]], **obj}
    return value
