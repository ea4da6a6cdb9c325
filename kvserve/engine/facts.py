"""What is fixed about a running engine, as one immutable object, and the one place a request is checked.

Why a frozen snapshot: the server's handlers run on the event loop while the engine thread owns the engine,
so they must never read the engine itself. Everything a handler needs to know (limits, the vocabulary size,
generation defaults, the cache's shape) is fixed once the engine is built, so the engine publishes it once
and the handlers hold this object instead. And why one validation function: the server (to answer 400
before a response starts) and `EngineCore.add_request` (for every other caller) must apply the same rules;
with both calling `validate_request`, those rules live here only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvserve.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """The engine's fixed limits and settings (safe to read from any thread)."""

    max_model_len: int
    vocab_size: int
    max_logprobs: int
    max_num_seqs: int
    block_size: int
    num_blocks: int
    enable_prefix_caching: bool
    kv_cache_dtype: str  # the --kv-cache-dtype name of the cache's storage
    eos_token_ids: tuple[int, ...]
    generation_defaults: Mapping[str, Any]  # the checkpoint's generation_config (read-only view)
    # The model's logits width (its LM head's rows, which may exceed the tokenizer's vocabulary): what a grammar's
    # token masks cover, so a front end can build a grammar compiler of its own (the cluster's ingress does).
    logits_width: int
    served_model_name: str | None = None
    # The KV cache groups (kv/groups.py) as one line, whether sliding windows give their blocks back (False:
    # --disable-hybrid-kv-cache-manager, or a model without them), how many of its layers are windowed, and the
    # start-up line's max concurrency at max-model-len.
    kv_cache_groups: str = ""
    hybrid_kv_cache_manager: bool = False
    sliding_window_layers: int = 0
    max_concurrency: float = 0.0
    # A disk offload tier this process writes, whose records it can retain past eviction and restarts (OpenAI's
    # prompt_cache_retention "24h"; kv/offload/stores.py DiskStore.retain).
    retains_prompts: bool = False

    def __post_init__(self) -> None:
        # A read-only view of a private copy: nobody can change the defaults behind a handler's back.
        object.__setattr__(self, "generation_defaults", MappingProxyType(dict(self.generation_defaults)))


def validate_prompt(facts: EngineFacts, token_ids: Sequence[int]) -> None:
    """ValueError (a 400 in the server) for an empty prompt, out-of-vocabulary ids, or one that leaves no
    room for a generated token."""
    if not token_ids:
        raise ValueError("the prompt is empty: it must contain at least one token")
    vocab = facts.vocab_size
    bad = next((t for t in token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is out of the vocabulary (0..{vocab - 1})")
    if len(token_ids) >= facts.max_model_len:
        raise ValueError(
            f"the prompt has {len(token_ids)} tokens, but this model's maximum context length "
            f"(max-model-len) is {facts.max_model_len} tokens, and at least one token must be generated; "
            f"shorten the prompt to at most {facts.max_model_len - 1} tokens"
        )


def validate_request(facts: EngineFacts, token_ids: Sequence[int], params: SamplingParams) -> None:
    """Every check a request must pass against this engine: its prompt, and its parameters against the
    engine's limits (`--max-logprobs`, the vocabulary). SamplingParams checks its own ranges when built."""
    validate_prompt(facts, token_ids)
    params.validate_against(facts.max_logprobs, facts.vocab_size)
