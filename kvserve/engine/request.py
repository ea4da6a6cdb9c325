"""A request inside the engine: its tokens, sampling parameters, blocks and progress."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvserve.kv.misses import PrefixMiss
    from kvserve.kv.pins import PinOutcome
    from kvserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # its step failed even when run alone: failed by itself, the engine serves on

    @property
    def is_finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
            RequestStatus.FINISHED_ERROR,
        )


@dataclass(slots=True, eq=False)
class Request:
    """One sequence being generated. `n > 1` is expanded by the engine into several Requests."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: "SamplingParams"
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    # Tokens whose K/V are in the cache (prompt and output tokens alike); reset to 0 by preemption.
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    ends_on_stop_token: bool = False  # it finished on a stop token (EOS, a stop id, a complete grammar's), its last
    cache_salt: str | None = None  # joins the prefix-cache hash so tenants cannot share blocks
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    # Of num_cached_tokens, those restored from the KV offload tier (the rest were in the block pool).
    num_restored_tokens: int = 0
    prefix_miss: PrefixMiss | None = None  # why its prefix hit stopped where it did, at first admission (kv/misses.py)
    pin_outcomes: tuple[PinOutcome, ...] = ()  # what became of the pins it asked for, as it finished (kv/pins.py)
    generator: torch.Generator | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # Speculative decoding: this step's drafted tokens (never part of num_tokens or the prefix-cache hashes),
    # and the request's drafted / accepted totals behind the adaptive gate (kvserve/spec_decode/gate.py).
    spec_token_ids: list[int] = field(default_factory=list)
    spec_num_drafted: int = 0
    spec_num_accepted: int = 0

    def __post_init__(self) -> None:
        if self.sampling_params.seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(self.sampling_params.seed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output (0 <= start <= end), copying only those: concatenating the
        whole sequence per block made prefix-cache keying quadratic in the prompt's length."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def cache_marks(self) -> tuple[int, ...]:
        """Where the request's cache_control marks end (prompt tokens): its pins' prefixes."""
        return tuple(pin.num_tokens for pin in self.sampling_params.kv_pins)

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """Prompt logprobs need every prompt position's logits, so such a request computes its whole prompt."""
        return self.sampling_params.prompt_logprobs is not None

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
