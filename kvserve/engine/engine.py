"""LLMEngine: the synchronous front end (vLLM v1's LLMEngine): text or token ids in, RequestOutputs with text out.

It is the engine core (engine/core.py: token ids in and out, one step at a time) plus the text work around it: a
string prompt is encoded here, and each step's core outputs go through the output processor (detokenizing, stop
strings, logprob text), whose stop-string hits are handed back to the core. `LLM.generate`, the benchmarks and the
tests drive it; the server's AsyncLLMEngine takes over its core (on the engine thread) and its tokenizer (on the
event loop), so that the engine thread never touches text. Single-threaded, like the core.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kvserve.engine.core import EngineCore
from kvserve.engine.output_processor import OutputProcessor

if TYPE_CHECKING:
    from kvserve.config import EngineConfig
    from kvserve.engine.facts import EngineFacts
    from kvserve.engine.stats import EngineStats
    from kvserve.model.tokenizer import Tokenizer
    from kvserve.outputs import RequestOutput
    from kvserve.sampling_params import SamplingParams
    from kvserve.structured.compiler import GrammarCompiler


class LLMEngine:
    """An EngineCore and the tokenizer of its front end. Build with `from_config` (engine/build.py)."""

    def __init__(self, core: EngineCore, tokenizer: Tokenizer, compute_dtype: torch.dtype = torch.float32) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.compute_dtype = compute_dtype  # the loaded model's (a sibling's core is built for the same)
        self.output_processor = OutputProcessor(tokenizer)

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        """Load the model and tokenizer named by the config and build an engine around them (engine/build.py)."""
        from kvserve.engine.build import load_engine

        return load_engine(config)

    def sibling(self, **changes: Any) -> LLMEngine:
        """A new engine sharing this one's loaded model and tokenizer, with `changes` applied to the config: for
        comparing settings without loading the model twice (engine/build.py)."""
        from kvserve.engine.build import sibling

        return sibling(self, **changes)

    @property
    def config(self) -> EngineConfig:
        """The resolved, frozen config the core runs with."""
        return self.core.config

    @property
    def facts(self) -> EngineFacts:
        return self.core.facts

    @property
    def grammar(self) -> GrammarCompiler:
        """The structured-output service, shared with the core: compile a request's constraint here to fail fast."""
        return self.core.grammar

    def close(self) -> None:
        self.core.close()

    # ---- requests -------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
    ) -> None:
        """Validate and queue a request; raises ValueError with a clear message for bad input. A string prompt is
        encoded here (with the tokenizer's BOS), a token-id prompt used verbatim."""
        if request_id in self.output_processor.states:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            text: str | None = prompt
            token_ids = self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
        self.core.add_request(request_id, token_ids, params, cache_salt)
        self.output_processor.add_request(request_id, text, token_ids, params)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request and free its blocks at once; returns its last output. An unknown or finished id does
        nothing."""
        return self.output_processor.abort(request_id, self.core.abort_request(request_id))

    def step(self) -> list[RequestOutput]:
        """One core step; the requests that advanced or finished, as text. A stop string found in a sample's text
        ends it in the core at once (its blocks are freed before the next step)."""
        outputs, stops, failed = self.output_processor.process(self.core.step())
        for request_id, index in stops:
            self.core.stop_sequence(request_id, index)
        for request_id in failed:  # its text failed in the front end: the core lets it go too
            self.core.abort_request(request_id)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.states) or self.core.has_unfinished_requests()

    def stats(self) -> EngineStats:
        return self.core.stats()

    def kv_snapshot(self, include_tokens: bool = True, tenant: bool | None = None) -> dict[str, Any]:
        return self.core.kv_snapshot(include_tokens, tenant)

    def check_invariants(self) -> None:
        """The core's pool invariants (EngineCore.check_invariants), checked between steps."""
        self.core.check_invariants()
