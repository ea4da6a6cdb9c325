"""Sampling parameters of one request, with vLLM's field names, defaults and validation.

Users carry their vLLM habits over, so names, defaults and accepted ranges follow vLLM's
`SamplingParams`; a bad value raises `ValueError` naming the field and the value, which the server
turns into a 400.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from kvserve.structured.params import StructuredOutputsParams as StructuredOutputsParams

# Below this temperature a request is greedy (dividing by ~0 would only produce inf/nan).
GREEDY_TEMPERATURE = 1e-5
_SEED_MIN, _SEED_MAX = -(1 << 63), (1 << 64) - 1  # what torch.Generator.manual_seed accepts
# Stop-list bounds: generous next to OpenAI's 4 strings, and they cap the per-sequence stop-string automaton
# (engine/stop_strings.py) at 64 x 256 = 16,384 characters, built once per sequence.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256


def _bad(field: str, value: object, expected: str) -> ValueError:
    return ValueError(f"{field} must be {expected}, got {value!r}")


def _as_float32(field: str, value: object) -> float:
    """`value` as the sampler will see it (a float32 tensor element), or ValueError naming the field.

    Why float32: the sampler builds float32 tensors from these fields, so a Python float that is finite
    (1e39) can still become inf there and turn a whole row of logits into NaN. A value that is not finite
    once cast is rejected here, where it becomes a 400, instead of failing later on the engine thread."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise _bad(field, value, "a number")
    try:
        cast = struct.unpack("f", struct.pack("f", float(value)))[0]
    except OverflowError:  # rounds to +-inf in float32 (or does not even fit a Python float)
        cast = math.inf
    if not math.isfinite(cast):
        raise _bad(field, value, "a finite number (in float32 range, |x| < 3.4e38)")
    return cast


def _structured_outputs(value: object) -> StructuredOutputsParams | None:
    """The constraint as StructuredOutputsParams; a dict in vLLM's shape ({"json": schema}) is taken too.

    Imported here, not at the top: kvserve.structured pulls in torch, and a request without a constraint
    (or a tool that only reads these parameters) should not pay for it."""
    if value is None:
        return None
    from kvserve.structured.params import StructuredOutputsParams

    if isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, Mapping):
        return StructuredOutputsParams.from_dict(value)
    raise _bad("structured_outputs", value, "a StructuredOutputsParams, a dict of its fields, or None")


def __getattr__(name: str) -> Any:
    """`from kvserve.sampling_params import StructuredOutputsParams`, as vLLM users write it
    (`vllm.sampling_params`), resolved lazily: the class lives in kvserve.structured.params, and importing the
    kvserve.structured package at the top would pull torch into every torch-free reader of this module."""
    if name == "StructuredOutputsParams":
        from kvserve.structured.params import StructuredOutputsParams

        return StructuredOutputsParams
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class RequestOutputKind(enum.Enum):
    """What each engine output of a request carries (vLLM's names): everything so far, only what is new
    since the previous output (the server streams these without re-diffing), or one output at the end."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(frozen=True, slots=True)
class KVPin:
    """Keep the KV blocks of the prompt's first `num_tokens` tokens (whole blocks) out of eviction for `ttl_s` seconds
    after the request, refreshed by every reuse: Anthropic's `cache_control` (kv/pins.py)."""

    num_tokens: int
    ttl_s: float


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request. `stop` and `stop_token_ids` are normalized to lists."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max-model-len, decided by the engine
    min_tokens: int = 0
    logprobs: int | None = None  # top-n logprobs of each generated token (plus the sampled one)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # A grammar the output must follow (JSON schema, regex, choice, grammar, json_object): vLLM's field.
    structured_outputs: StructuredOutputsParams | None = None
    # Not sampling, but per request like the grammar above: prompt prefixes to pin in the KV cache (the Messages API's
    # cache_control marks).
    kv_pins: tuple[KVPin, ...] = ()
    # OpenAI's prompt_cache_key: requests with the same key go to the same replica while it has room (cluster/router.py)
    # and are grouped by it in the KV inspector.
    prompt_cache_key: str | None = None
    # OpenAI's prompt_cache_retention ("24h": 86,400 s): the prompt's blocks are kept in the disk offload tier that long
    # (kv/offload/stores.py DiskStore.retain); 0: as any other block.
    prompt_cache_retention_s: float = 0.0

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        self.structured_outputs = _structured_outputs(self.structured_outputs)
        self._validate()

    def _validate(self) -> None:
        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.n) or self.n < 1:
            raise _bad("n", self.n, "an integer >= 1")
        for pin in self.kv_pins:
            if not isinstance(pin, KVPin) or pin.num_tokens < 1 or not pin.ttl_s > 0:
                raise _bad("kv_pins", self.kv_pins, "KVPin(num_tokens >= 1, ttl_s > 0) entries")
        presence, frequency, repetition, temperature, top_p, min_p = (
            _as_float32(name, getattr(self, name))
            for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p")
        )
        if not -2.0 <= presence <= 2.0:
            raise _bad("presence_penalty", self.presence_penalty, "in [-2, 2]")
        if not -2.0 <= frequency <= 2.0:
            raise _bad("frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        if not repetition > 0.0:  # vLLM's range; a tiny penalty can still overflow logits: the sampler copes
            raise _bad("repetition_penalty", self.repetition_penalty, "> 0 (in float32)")
        if not temperature >= 0.0:
            raise _bad("temperature", self.temperature, ">= 0")
        if not 0.0 < top_p <= 1.0:
            raise _bad("top_p", self.top_p, "in (0, 1] (in float32)")
        if not is_int(self.top_k) or self.top_k < -1:
            raise _bad("top_k", self.top_k, "an integer >= -1 (0 or -1 disables it)")
        if not 0.0 <= min_p <= 1.0:
            raise _bad("min_p", self.min_p, "in [0, 1]")
        if self.seed is not None and not is_int(self.seed):
            raise _bad("seed", self.seed, "an integer or None")
        if self.seed is not None and not _SEED_MIN <= self.seed <= _SEED_MAX - (self.n - 1):
            # torch.Generator takes 64 bits; sample i of n uses seed + i
            raise _bad("seed", self.seed, f"in [{_SEED_MIN}, {_SEED_MAX - (self.n - 1)}] for n={self.n}")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise _bad("max_tokens", self.max_tokens, "an integer >= 1 or None")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise _bad("min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 0):
                raise _bad(name, value, "an integer >= 0 or None")
        stops = self.stop or []  # a list since __post_init__; `or` narrows the declared type for the checker
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"stop must hold at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
        for s in stops:
            if not isinstance(s, str) or not s:
                raise _bad("stop", self.stop, "non-empty strings")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(
                    f"stop must hold strings of at most {MAX_STOP_STRING_CHARS} characters, got one of {len(s)}"
                )
        for t in self.stop_token_ids or []:  # a list since __post_init__, as `stop` above
            if not is_int(t) or t < 0:
                raise _bad("stop_token_ids", self.stop_token_ids, "non-negative token ids")

    def validate_against(self, max_logprobs: int, vocab_size: int) -> None:
        """Checks that need the engine's limits (`--max-logprobs`, the model's vocabulary)."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > max_logprobs:
                raise ValueError(f"{name} must be <= max_logprobs={max_logprobs}, got {value}")
        bad = [t for t in self.stop_token_ids or [] if t >= vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids must be < vocab_size={vocab_size}, got {bad}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def clone(self, **changes: Any) -> SamplingParams:
        """A validated copy with `changes` applied (lists are copied, never shared)."""
        return dataclasses.replace(self, **changes)

    def child(self, index: int) -> SamplingParams:
        """Parameters of sample `index` of an `n > 1` request: n=1 and, as in vLLM, seed + index
        so that the samples differ yet stay reproducible."""
        seed = None if self.seed is None else self.seed + index
        return self.clone(n=1, seed=seed)


class SamplerRow(Protocol):
    """What the sampler reads of the request behind one logits row: its parameters, the tokens so far (penalties
    and min_tokens read them) and its generator. The engine's Request is one; a verified draft position's view of
    a request is another (spec_decode/verify.py DraftedRow: the tokens as they would be at that position)."""

    @property
    def sampling_params(self) -> SamplingParams: ...
    @property
    def prompt_token_ids(self) -> list[int]: ...
    @property
    def output_token_ids(self) -> list[int]: ...
    @property
    def generator(self) -> torch.Generator | None: ...
