"""HF transformers as a peer: `generate` on the same weights, used the way a transformers user would
(static batches, left padding, the library's own KV cache), with each forward pass timed."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, GenerationMixin, LogitsProcessor, LogitsProcessorList

from kvserve.bench.systems import ThroughputRun, Timeline
from kvserve.bench.workload import TokenRequest
from kvserve.model.source import ModelFormat, ModelSource


class _StepTimer(LogitsProcessor):
    """Called once per generation step, right after that step's forward pass: a timestamp per step."""

    def __init__(self, timeline: Timeline) -> None:
        self.timeline = timeline

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.timeline.stamps.append(time.perf_counter())
        return scores


@dataclass(frozen=True, slots=True)
class BatchProbe:
    batch_size: int
    projected_tokens_per_s: float


class HFPeer:
    name = "hf"

    def __init__(self, model: GenerationMixin, pad_token_id: int, batch_size: int = 16) -> None:
        self.model = model
        self.pad_token_id = pad_token_id
        self.batch_size = batch_size  # for run_requests; see choose_batch_size

    @classmethod
    def load(cls, source: ModelSource, dtype: torch.dtype = torch.float32) -> HFPeer:
        """The same file kvserve loads: a GGUF through transformers' GGUF loader, or the HF directory."""
        kwargs = {"dtype": dtype, "local_files_only": True}
        if source.format == ModelFormat.GGUF:
            model = AutoModelForCausalLM.from_pretrained(str(source.path.parent), gguf_file=source.path.name, **kwargs)
        else:
            model = AutoModelForCausalLM.from_pretrained(str(source.path), **kwargs)
        model.eval()
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        pad = config.pad_token_id if config.pad_token_id is not None else 0
        return cls(model, int(pad))

    def _left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
        return ids, mask

    def _generate(self, prompts: list[list[int]], new_tokens: int, timeline: Timeline | None = None) -> None:
        ids, mask = self._left_pad(prompts)
        processors = LogitsProcessorList([_StepTimer(timeline)]) if timeline is not None else None
        with torch.inference_mode():
            self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=self.pad_token_id,
                logits_processor=processors,
            )

    def timed_generate(self, prompts: list[list[int]], output_len: int) -> Timeline:
        timeline = Timeline(start=time.perf_counter())
        self._generate(prompts, output_len, timeline)
        return timeline

    def run_requests(self, requests: list[TokenRequest]) -> ThroughputRun:
        """Static batches of `batch_size`, grouped by output length (the least padding waste a transformers
        user can get); a batch runs until its longest output is done."""
        order = sorted(requests, key=lambda r: r.output_len, reverse=True)
        generated = 0
        start = time.perf_counter()
        for i in range(0, len(order), self.batch_size):
            batch = order[i : i + self.batch_size]
            longest = max(r.output_len for r in batch)
            self._generate([list(r.prompt_token_ids) for r in batch], longest)
            generated += longest * len(batch)
        elapsed = time.perf_counter() - start
        return ThroughputRun(
            elapsed, sum(len(r.prompt_token_ids) for r in requests), sum(r.output_len for r in requests), generated
        )

    def choose_batch_size(
        self, requests: list[TokenRequest], candidates: list[int], probe_tokens: int = 8
    ) -> list[BatchProbe]:
        """Give HF its best batch size: for each candidate, time a short generate on the workload's own
        prompts and project its throughput at the workload's mean output length. Every candidate is
        probed: on a shared machine one noisy probe must not end the search early."""
        mean_out = sum(r.output_len for r in requests) / len(requests)
        probes: list[BatchProbe] = []
        for size in candidates:
            batch = [list(r.prompt_token_ids) for r in requests[:size]]
            timeline = self.timed_generate(batch, probe_tokens)
            step = timeline.decode_step_s or 0.0
            projected = timeline.ttft_s + (mean_out - 1) * step
            probes.append(BatchProbe(len(batch), len(batch) * mean_out / projected))
        self.batch_size = max(probes, key=lambda p: p.projected_tokens_per_s).batch_size
        return probes
