"""ModelRunner: turns a scheduler decision into one flat forward pass and returns the logits needed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvserve.attention.metadata import AttentionMetadata
from kvserve.engine.request import Request
from kvserve.engine.scheduler import SchedulerOutput
from kvserve.kv.cache import LayerKVCache
from kvserve.kv.manager import KVCacheManager

if TYPE_CHECKING:
    from kvserve.model.decoder import DecoderModel


@dataclass(slots=True)
class RunnerOutput:
    sample_requests: list[Request]  # rows of `logits`, in order
    logits: torch.Tensor  # [len(sample_requests), vocab] float32
    # Per request asking for prompt logprobs: (first position judged, logits of the chunk's positions).
    prompt_logits: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)
    # Per request with drafted tokens: the logits of every verified position ([1 + drafts, vocab] float32), its
    # rows not in `logits` (speculative decoding verifies them, see LLMEngine._verify_drafts). Views into the
    # same step buffer as `logits`: consumed before the next step.
    spec_logits: dict[str, torch.Tensor] = field(default_factory=dict)


class ModelRunner:
    """Builds input ids, positions and attention metadata for the flat batch, runs the model, and computes
    logits only for the rows that are sampled (plus prompt rows when prompt logprobs are asked)."""

    def __init__(
        self,
        model: DecoderModel,
        kv_caches: list[LayerKVCache],
        kv_manager: KVCacheManager,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.kv = kv_manager
        self.block_size = block_size
        self.device = device
        self._logits: torch.Tensor | None = None  # reused by every step's sampled rows (see compute_logits)

    def _logits_buffer(self, rows: int) -> torch.Tensor:
        """[rows, vocab] float32 out of one buffer kept between steps; it grows to the largest batch seen. The
        logits of a step are consumed (sampled) before the next step writes the buffer again."""
        if self._logits is None or self._logits.shape[0] < rows:
            self._logits = torch.empty(rows, self.model.num_logits, dtype=torch.float32, device=self.device)
        return self._logits[:rows]

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        input_ids: list[int] = []
        positions: list[int] = []
        block_tables, seq_lens, query_lens = [], [], []
        sample_rows: list[int] = []
        sample_requests: list[Request] = []
        prompt_rows: dict[str, tuple[int, int, int]] = {}
        spec_rows: dict[str, tuple[int, int]] = {}
        for s in out.scheduled:
            request, start, end = s.request, s.start, s.start + s.num_tokens
            row0 = len(input_ids)
            input_ids.extend(request.token_slice(start, end - len(s.draft_token_ids)))
            input_ids.extend(s.draft_token_ids)
            positions.extend(range(start, end))
            block_tables.append(self.kv.block_ids(request))
            seq_lens.append(end)
            query_lens.append(s.num_tokens)
            if request.sampling_params.prompt_logprobs is not None and start < request.num_prompt_tokens - 1:
                last = min(end, request.num_prompt_tokens - 1)  # positions start..last-1 judge tokens start+1..last
                prompt_rows[request.request_id] = (start, row0, row0 + last - start)
            if s.draft_token_ids:
                spec_rows[request.request_id] = (row0, len(input_ids))
            elif s.completes_sequence:
                sample_rows.append(len(input_ids) - 1)
                sample_requests.append(request)
        meta = AttentionMetadata.build(block_tables, seq_lens, query_lens, self.block_size, self.device)
        ids = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        hidden = self.model(ids, pos, self.kv_caches, meta)
        # Sampled rows and every drafted request's verified rows go through the LM head in one call: the head
        # (the largest matrix of a small model) is then read once per step, not once per drafted request
        # (each row's logits are the same either way: the kernels compute rows independently).
        rows = torch.tensor(sample_rows + [r for a, b in spec_rows.values() for r in range(a, b)],
                            dtype=torch.int64, device=self.device)
        all_logits = self.model.compute_logits(hidden.index_select(0, rows),
                                               out=self._logits_buffer(len(rows))).float()
        logits = all_logits[:len(sample_rows)]
        spans = [b - a for a, b in spec_rows.values()]
        spec_logits = dict(zip(spec_rows, all_logits[len(sample_rows):].split(spans), strict=True))
        prompt_logits = {
            rid: (first, self.model.compute_logits(hidden[a:b]).float()) for rid, (first, a, b) in prompt_rows.items()
        }
        return RunnerOutput(sample_requests, logits, prompt_logits, spec_logits)
