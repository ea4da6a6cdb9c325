"""ModelRunner: turns a scheduler decision into one flat forward pass and returns the logits needed."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING

import torch

from kvserve.attention.metadata import AttentionMetadata
from kvserve.engine.cuda_graphs import DecodeGraphs, pad_decode_inputs
from kvserve.engine.host_transfer import HostToDevice
from kvserve.engine.request import Request
from kvserve.engine.scheduler import SchedulerOutput
from kvserve.kv.cache import LayerKVCache
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.state_cache import LayerStateCache, StateMetadata, StepState

if TYPE_CHECKING:
    from kvserve.model.protocol import Model


@dataclass(slots=True)
class RunnerOutput:
    sample_requests: list[Request]  # rows of `logits`, in order
    logits: torch.Tensor  # [len(sample_requests), vocab] float32
    # Per request asking for prompt logprobs: (first position judged, logits of the chunk's positions).
    prompt_logits: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)
    # Per request with drafted tokens: the logits of every verified position ([1 + drafts, vocab] float32), its
    # rows not in `logits` (speculative decoding verifies them, see spec_decode/verify.py). Views into the
    # same step buffer as `logits`: consumed before the next step.
    spec_logits: dict[str, torch.Tensor] = field(default_factory=dict)


class ModelRunner:
    """Builds input ids, positions and attention metadata for the flat batch, runs the model, and computes
    logits only for the rows that are sampled (plus prompt rows when prompt logprobs are asked).

    The step's index tensors are built on the host and sent in one copy (engine/host_transfer.py: pinned and
    non_blocking on CUDA, the tensors themselves on CPU). A decode-only step that fits a captured size runs as a
    CUDA graph (`graphs`, engine/cuda_graphs.py), padded to that size; the rest run eagerly."""

    def __init__(
        self,
        model: Model,
        kv_caches: list[LayerKVCache],
        kv_manager: KVCacheManager,
        block_size: int,
        device: torch.device,
        graphs: DecodeGraphs | None = None,
        state_caches: list[LayerStateCache] | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.kv = kv_manager
        self.block_size = block_size
        self.device = device
        self.graphs = graphs
        self.state_caches = state_caches  # a hybrid model's state layers (kv/state_cache.py), in layer order
        self.transfer = HostToDevice(device)
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
        # Per group, per request: the table's entries after its leading null entries, and how many those are.
        block_tables: list[list[list[int]]] = [[] for _ in range(self.kv.num_groups)]
        leading_nulls: list[list[int]] = [[] for _ in range(self.kv.num_groups)]
        seq_lens, query_lens = [], []
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
            for g in range(self.kv.num_groups):
                lead, tail = self.kv.table_tail(request, g)
                leading_nulls[g].append(lead)
                block_tables[g].append(tail)
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
        # Sampled rows and every drafted request's verified rows go through the LM head in one call: the head
        # (the largest matrix of a small model) is then read once per step, not once per drafted request
        # (each row's logits are the same either way: the kernels compute rows independently).
        head_rows = sample_rows + [r for a, b in spec_rows.values() for r in range(a, b)]
        state = None
        saves: list[tuple[int, int]] = []
        if self.state_caches is not None:
            restores, saves = self.kv.take_state_copies()
            self._copy_states(restores)  # prefix hits start from their snapshots
            slots = [self.kv.state_slot(s.request) for s in out.scheduled]
            starts = [s.start for s in out.scheduled]
            state = StepState(self.state_caches, StateMetadata.build(slots, query_lens, starts, self.device))
        hidden, rows = self._forward(
            input_ids, positions, block_tables, leading_nulls, seq_lens, query_lens, head_rows, state
        )
        if self.state_caches is not None:
            self._copy_states(saves)  # steps that ended on a block boundary leave snapshots
            self.kv.state_saves_done()
        all_logits = self.model.compute_logits(
            hidden.index_select(0, rows), out=self._logits_buffer(len(head_rows))
        ).float()
        logits = all_logits[: len(sample_rows)]
        spans = [b - a for a, b in spec_rows.values()]
        spec_rows_logits: tuple[torch.Tensor, ...] = all_logits[len(sample_rows) :].split(spans)  # type: ignore[no-untyped-call]
        spec_logits = dict(zip(spec_rows, spec_rows_logits, strict=True))
        prompt_logits = {
            rid: (first, self.model.compute_logits(hidden[a:b]).float()) for rid, (first, a, b) in prompt_rows.items()
        }
        return RunnerOutput(sample_requests, logits, prompt_logits, spec_logits)

    def _copy_states(self, copies: list[tuple[int, int]]) -> None:
        """Copy state slots (from, to) in every state layer (kv/state.py: restores and snapshots)."""
        if not copies or self.state_caches is None:
            return
        for cache in self.state_caches:
            for t in cache.tensors():
                for src, dst in copies:  # one pass over the bytes (Qwen3.5-0.8B: 19.3 MiB a copy)
                    t[dst].copy_(t[src])

    def _forward(
        self,
        input_ids: list[int],
        positions: list[int],
        block_tables: list[list[list[int]]],
        leading_nulls: list[list[int]],
        seq_lens: list[int],
        query_lens: list[int],
        head_rows: list[int],
        state: StepState | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's hidden states of the step's rows, and `head_rows` as a device index tensor: each KV cache
        group's metadata is built on the host, sent with the ids in one copy, and run as a graph when one fits,
        else eagerly; every layer gets its group's."""
        host = torch.device("cpu")
        metas = [
            AttentionMetadata.build(t, seq_lens, query_lens, self.block_size, host, leads)
            for t, leads in zip(block_tables, leading_nulls, strict=True)
        ]
        as_tensor = partial(torch.tensor, dtype=torch.int64)
        ids, pos, rows = as_tensor(input_ids), as_tensor(positions), as_tensor(head_rows)
        size = self._graph_size(metas)
        if self.graphs is not None and size is not None:
            padded = pad_decode_inputs(size, self.block_size, ids, pos, metas)
            *inputs, rows = self.transfer.move([*padded.tensors(), rows])
            return self.graphs.replay(size, padded.from_tensors(inputs))[: len(input_ids)], rows
        if self.transfer.staged:
            moved = iter(self.transfer.move([ids, pos, rows, *(t for m in metas for t in _index_tensors(m))]))
            ids, pos, rows = next(moved), next(moved), next(moved)
            metas = [
                replace(m, slot_mapping=next(moved), block_tables=next(moved), seq_lens=next(moved),
                        query_start_loc=next(moved))
                for m in metas
            ]  # fmt: skip
        if len(metas) == 1:  # one KV cache group: every layer reads the same metadata
            return self.model(ids, pos, self.kv_caches, metas[0], state), rows
        return self.model(ids, pos, self.kv_caches, [metas[g] for g in self.kv.layout.layer_group], state), rows

    def _graph_size(self, metas: list[AttentionMetadata]) -> int | None:
        """The captured size a decode-only step runs at, or None: eager (a prefill or mixed step, a batch larger
        than every graph, or a table wider than the graphs' buffers)."""
        if self.graphs is None or not metas[0].is_decode_only:
            return None
        if metas[0].block_tables.shape[1] > self.graphs.buffers.block_tables.shape[2]:
            return None
        return self.graphs.size_for(len(metas[0].seq_lens_cpu))


def _index_tensors(meta: AttentionMetadata) -> list[torch.Tensor]:
    """The metadata's tensors a device needs, in `replace`'s order above."""
    return [meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc]
