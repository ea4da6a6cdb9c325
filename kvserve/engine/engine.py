"""LLMEngine: requests in, outputs out, one scheduler step at a time."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from kvserve.capacity import CachePlan, plan_kv_cache, resolve_quantization
from kvserve.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig, resolve_attention_backend
from kvserve.engine.cuda_graphs import build_decode_graphs
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.facts import EngineFacts, validate_request
from kvserve.engine.inspector import EngineEventRecorder, build_snapshot
from kvserve.engine.memory_profile import CudaMemory, gpu_kv_budget, profile_gpu_memory
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.runner import ModelRunner
from kvserve.engine.sampler import SampledToken, Sampler, prompt_logprobs
from kvserve.engine.scheduler import Scheduler, SchedulerOutput
from kvserve.kv.cache import KVCacheSpec, allocate_kv_cache, resolve_kv_cache_dtype
from kvserve.kv.events import KVEventBuffer
from kvserve.kv.events_config import parse_kv_events_config, start_kv_event_publisher
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.pool import BlockPool
from kvserve.kv.vllm_events import medium_for_device
from kvserve.outputs import CompletionOutput, Logprob, RequestOutput, logprob_entry
from kvserve.sampling_params import RequestOutputKind, SamplerRow, SamplingParams
from kvserve.spec_decode.config import parse_speculative_config
from kvserve.spec_decode.gate import SpecDecoder
from kvserve.spec_decode.verify import drafted_rows, verify_by_sampling, verify_greedy
from kvserve.structured.compiler import GrammarCompiler
from kvserve.structured.matcher import draft_masks
from kvserve.units import MiB

if TYPE_CHECKING:
    from kvserve.model.config import ModelConfig
    from kvserve.model.decoder import DecoderModel
    from kvserve.model.tokenizer import Tokenizer
    from kvserve.structured.backend import CompiledGrammar
    from kvserve.structured.matcher import GrammarMatcher, RowMask

logger = logging.getLogger(__name__)

# How long a step with nothing to run waits for a grammar still compiling (instead of returning at once and being
# called again in a busy loop that would take the GIL from the compile thread).
_GRAMMAR_WAIT_S = 0.02


def plan_cache(
    config: EngineConfig,
    model_config: "ModelConfig",
    spec: KVCacheSpec,
    device: torch.device,
    device_budget: Callable[[], int] | None = None,
) -> CachePlan:
    """Size the pool from the KV budget and check that one request of max-model-len fits. On CUDA without
    --kv-cache-memory-bytes or --num-gpu-blocks-override, `device_budget()` (the profiled budget,
    engine/memory_profile.py) is the budget."""
    budget = config.kv_cache_memory_bytes
    if config.num_gpu_blocks_override is None:
        if budget is None:
            if device.type != "cpu":
                if device_budget is None:
                    raise ValueError(
                        f"on {device} the KV budget comes from a profile of the model: pass "
                        "--kv-cache-memory-bytes or --num-gpu-blocks-override to plan without one"
                    )
                budget = device_budget()
            else:
                budget = DEFAULT_CPU_KV_CACHE_BYTES
        if device.type == "cpu":
            available = _available_memory_bytes()
            if available is not None and budget > available:
                raise ValueError(
                    f"--kv-cache-memory-bytes {budget} exceeds this machine's available memory ({available} bytes); "
                    f"pass a smaller budget, e.g. --kv-cache-memory-bytes {max(available // 4, MiB)}"
                )
    return plan_kv_cache(
        spec.bytes_per_block,
        spec.block_size,
        model_config.max_position_embeddings,
        budget_bytes=budget,
        num_blocks_override=config.num_gpu_blocks_override,
        max_model_len=config.max_model_len,
    )


def _available_memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _check_cache_salt(cache_salt: str | None) -> None:
    """The salt joins the prefix-cache hashes as UTF-8 bytes, so a string that has none (a lone surrogate, from
    a JSON "\\ud800") is bad input here, not a UnicodeEncodeError on the engine thread at the first lookup."""
    if cache_salt is None:
        return
    if not isinstance(cache_salt, str):
        raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
    try:
        cache_salt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"cache_salt must be valid UTF-8 text: it holds an unpaired surrogate at position {e.start}"
        ) from None


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of what the engine is doing, for metrics and diagnosis."""

    num_running: int
    num_waiting: int
    num_blocks: int
    num_free_blocks: int
    block_size: int
    kv_cache_usage: float  # referenced blocks / usable blocks (not the null block; cached-but-free count as free)
    prefix_cache_queries_tokens: int
    prefix_cache_hits_tokens: int
    prefix_cache_hit_rate: float  # over the last 1,000 lookups
    num_preemptions: int
    prompt_tokens_total: int  # prompt tokens computed (cache hits excluded; recomputes included)
    generation_tokens_total: int
    # Speculative decoding (vLLM's names): drafts verified, tokens drafted in them, drafted tokens accepted.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()  # [i]: drafts accepted at draft position i


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """Timestamps (time.monotonic) of one sequence's life, for latency metrics."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_preemptions: int


@dataclass(slots=True)
class _Sequence:
    """Engine-side state of one of a request's n sequences."""

    request: Request
    group_id: str
    index: int
    detokenizer: IncrementalDetokenizer
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    # How much a DELTA output has already handed out (characters, tokens, and whether the finish was).
    sent_chars: int = 0
    sent_tokens: int = 0
    sent_finish: bool = False
    # Its own grammar state (n > 1: one each), made when it first samples; it follows output_token_ids, which
    # preemption keeps (recompute), so it is never rolled back here.
    matcher: GrammarMatcher | None = None


@dataclass(slots=True)
class _Group:
    """One user request: a prompt, its parameters and its n sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[_Sequence] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    error: str | None = None  # set when one of its sequences failed (finish_reason "error")
    sent_prompt_logprobs: bool = False  # DELTA outputs carry the prompt's logprobs once, in the first
    grammar: Future[CompiledGrammar] | None = None  # its constraint compiling (or compiled), shared by its sequences

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.sequences)


class LLMEngine:
    """Owns the model, the KV cache, the scheduler and the per-request state. Single-threaded: the
    caller (LLM.generate or the server's loop) drives it with add_request / abort_request / step."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: "ModelConfig",
        model: "DecoderModel",
        tokenizer: "Tokenizer",
        device: torch.device | None = None,
        compute_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.compute_dtype = compute_dtype
        self.device = device or torch.device(config.device)
        kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, compute_dtype)
        self.kv_spec = KVCacheSpec(
            model_config.num_layers, model_config.num_kv_heads, model_config.head_dim, config.block_size, kv_dtype
        )
        self.cache_plan = plan_cache(
            config, model_config, self.kv_spec, self.device, partial(self._profiled_kv_budget, model)
        )
        self.max_model_len = self.cache_plan.max_model_len
        self.kv_events = KVEventBuffer()  # bounded: drained between steps by the async engine (the inspector)
        self.pool = BlockPool(
            self.cache_plan.num_blocks, enable_caching=config.enable_prefix_caching, events=self.kv_events
        )
        self.event_recorder = EngineEventRecorder(self.kv_events, self._user_request_id)
        # vLLM's --kv-events-config: None (the default) imports no zmq; see kv/events_config.py.
        self.kv_event_publisher = start_kv_event_publisher(
            parse_kv_events_config(config.kv_events_config),
            self.kv_events,
            config.block_size,
            medium_for_device(self.device.type),
            config.enable_prefix_caching,
            config.data_parallel_rank,
        )
        reserve = self.max_model_len if config.reserve_max_model_len else 0
        self.kv_manager = KVCacheManager(self.pool, config.block_size, config.prefix_caching_hash_algo, reserve)
        self.scheduler = Scheduler(
            self.kv_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
        )
        kv_caches = allocate_kv_cache(self.kv_spec, self.cache_plan.num_blocks, self.device)
        self._use_static_kv_scales(kv_caches, getattr(model, "static_kv_scales", None))
        graphs = build_decode_graphs(config, model, kv_caches, self.max_model_len, self.device)
        self.runner = ModelRunner(model, kv_caches, self.kv_manager, config.block_size, self.device, graphs)
        self.eos_token_ids = list(model_config.eos_token_ids)
        self.sampler = Sampler(self.eos_token_ids, seed=config.seed)
        spec_config = parse_speculative_config(config.speculative_config)  # already parsed: typed for mypy
        self.spec = None if spec_config is None else SpecDecoder(spec_config)
        # Structured output: built now, its grammar backend only on the first constrained request.
        self.grammar = GrammarCompiler(
            tokenizer,
            getattr(model, "num_logits", model_config.vocab_size),
            self.eos_token_ids,
            backend=config.structured_outputs_backend,
        )
        self.groups: dict[str, _Group] = {}
        self.sequences: dict[str, _Sequence] = {}  # by the engine-internal request id of each sequence
        self._constrained: set[str] = set()  # ids of live sequences with a grammar (none: the sampler masks nothing)
        self._num_sequences_added = 0  # numbers the internal ids, so that they never collide
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        self.facts = self._facts()
        logger.info(self.cache_plan.describe())

    def _profiled_kv_budget(self, model: "DecoderModel") -> int:
        """vLLM's GPU sizing: --gpu-memory-utilization of the device's memory less the weights, the peak of one
        profiled step and non-torch memory (engine/memory_profile.py); logged like the CPU plan."""
        facts = profile_gpu_memory(
            model,
            self.kv_spec,
            self.config.max_num_batched_tokens,
            self.config.max_num_seqs,
            self.device,
            CudaMemory(self.device),
        )
        plan = gpu_kv_budget(facts, self.config.gpu_memory_utilization, self.kv_spec.bytes_per_block)
        logger.info(plan.describe())
        return plan.kv_bytes

    def _facts(self) -> EngineFacts:
        """The engine's fixed facts, published once for code that must not touch the engine (handlers)."""
        return EngineFacts(
            max_model_len=self.max_model_len,
            vocab_size=self.model_config.vocab_size,
            max_logprobs=self.config.max_logprobs,
            max_num_seqs=self.config.max_num_seqs,
            block_size=self.config.block_size,
            num_blocks=self.pool.num_blocks,
            enable_prefix_caching=self.config.enable_prefix_caching,
            kv_cache_dtype=self.kv_spec.dtype_name,
            eos_token_ids=tuple(self.eos_token_ids),
            generation_defaults=self.model_config.generation_defaults,
            served_model_name=self.config.served_model_name,
            grammar=self.grammar,
        )

    def _use_static_kv_scales(self, kv_caches: list, scales: list[tuple[float, float]] | None) -> None:
        """A checkpoint's calibrated per-tensor KV scales are for fp8_e4m3 (how vLLM and llm-compressor make
        them); with that KV dtype every layer quantizes with them, otherwise they are ignored (logged)."""
        if scales is None:
            return
        if self.kv_spec.dtype_name != "fp8_e4m3":
            logger.info(
                "the checkpoint's static fp8 KV scales are unused with --kv-cache-dtype %s", self.kv_spec.dtype_name
            )
            return
        for cache, (k_scale, v_scale) in zip(kv_caches, scales):
            cache.static_key_scale, cache.static_value_scale = k_scale, v_scale
        logger.info("fp8 KV cache uses the checkpoint's per-tensor scales for all %d layers", len(scales))

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLMEngine":
        """Load the model and tokenizer named by the config and build an engine around them."""
        from kvserve.model.loader import load_model, load_model_config, resolve_dtype
        from kvserve.model.source import resolve_model
        from kvserve.model.tokenizer import load_tokenizer

        if config.cpu_threads is not None:
            torch.set_num_threads(config.cpu_threads)
        device = torch.device(config.device)
        source = resolve_model(config.model)
        # The tokenizer loads in a thread while the weights load: reading a cached tokenizer.json is Rust code
        # that releases the GIL (about 1 s of a later start for Gemma's 262k vocabulary).
        with ThreadPoolExecutor(1, thread_name_prefix="kvserve-tokenizer") as pool:
            tokenizer_future = pool.submit(load_tokenizer, source, chat_template=config.chat_template)
            model_config = load_model_config(source)
            dtype = resolve_dtype(config.dtype, device, model_config)
            config.attention_backend = resolve_attention_backend(config.attention_backend, device.type)
            config.quantization = resolve_quantization(config.quantization, device.type, source.format.value)
            loaded = load_model(
                source,
                dtype,
                device,
                attention_backend=config.attention_backend,
                quantization=config.quantization,
                config=model_config,
                lm_head_quantization=config.lm_head_quantization,
            )
            tokenizer = tokenizer_future.result()
        if config.served_model_name is None:
            config.served_model_name = source.name
        return cls(config, loaded.config, loaded.model, tokenizer, device=device, compute_dtype=dtype)

    def sibling(self, **changes: Any) -> "LLMEngine":
        """A new engine (own KV cache, scheduler and requests) sharing this one's loaded model and tokenizer,
        with `changes` applied to the config: for comparing settings without loading the model twice."""
        fixed = {"model", "dtype", "quantization", "device", "attention_backend"} & changes.keys()
        if fixed:
            raise ValueError(
                f"a sibling engine shares the loaded model, so it cannot change {', '.join(sorted(fixed))}"
            )
        changes.setdefault("kv_events_config", None)  # one publisher per address: the sibling publishes none
        config = dataclasses.replace(self.config, **changes)
        return LLMEngine(config, self.model_config, self.runner.model, self.tokenizer, self.device, self.compute_dtype)

    def close(self) -> None:
        """Release what outlives a step: the KV event publisher's thread and sockets (flushing what is queued)."""
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.close()

    # ---- requests -------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
    ) -> None:
        """Validate and queue a request; raises ValueError with a clear message for bad input."""
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        _check_cache_salt(cache_salt)
        if isinstance(prompt, str):
            text: str | None = prompt
            token_ids = self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
        validate_request(self.facts, token_ids, params)
        max_new = self.max_model_len - len(token_ids)
        if params.max_tokens is None or params.max_tokens > max_new:
            params = params.clone(max_tokens=max_new)
        group = _Group(request_id, text, token_ids, params)
        for index in range(params.n):
            child = params if params.n == 1 else params.child(index)
            request = Request(
                request_id=self._new_sequence_id(request_id, index),
                prompt_token_ids=token_ids,
                sampling_params=child,
                cache_salt=cache_salt,
            )
            detok = IncrementalDetokenizer(self.tokenizer, token_ids, child)
            seq = _Sequence(request, request_id, index, detok)
            if child.logprobs is not None:
                seq.logprobs, seq.cumulative_logprob = [], 0.0
            group.sequences.append(seq)
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]
        self._check_unique(group)
        if params.structured_outputs is not None:  # compiled off this thread; the scheduler admits it when done
            group.grammar = self.grammar.compile_async(params.structured_outputs)
        self.groups[request_id] = group
        for seq in group.sequences:  # registered only once all were built: a failure leaves no trace
            self.sequences[seq.request.request_id] = seq
            if group.grammar is not None:
                self._constrained.add(seq.request.request_id)
            self.scheduler.add(seq.request, group.grammar)

    def _new_sequence_id(self, request_id: str, index: int) -> str:
        """The engine-internal id of sample `index` of `request_id`, the key of the scheduler's and the KV
        manager's maps. Why not the user's id (or "id#index"): user ids are arbitrary strings, so request "x"
        with n=2 and a request named "x#0" collided. A serial number leads, ended by the first ":", so two
        sequences never share an id whatever the user ids hold; the user's id follows only for the logs."""
        self._num_sequences_added += 1
        return f"{self._num_sequences_added}:{request_id}#{index}"

    def _check_unique(self, group: _Group) -> None:
        """Every sequence's internal id is new: a clash would make two sequences share blocks and outputs."""
        ids = [seq.request.request_id for seq in group.sequences]
        if len(set(ids)) != len(ids) or any(i in self.sequences for i in ids):
            raise RuntimeError(f"internal sequence ids {ids} of request {group.request_id!r} are not unique")

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request and free its blocks at once; an unknown or finished id does nothing."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return None
        self.event_recorder.record_abort(
            request_id, sum(self.kv_manager.num_blocks_held(s.request) for s in group.sequences)
        )
        for seq in group.sequences:
            if not seq.request.is_finished:
                self.scheduler.finish(seq.request, RequestStatus.FINISHED_ABORTED)
                seq.text += seq.detokenizer.finish().delta_text
            self._forget(seq)
        return self._make_output(group)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            num_blocks=self.pool.num_blocks,
            num_free_blocks=self.pool.num_free_blocks,
            block_size=self.config.block_size,
            kv_cache_usage=self.pool.usage,
            prefix_cache_queries_tokens=self.kv_manager.prefix_stats.queries_total,
            prefix_cache_hits_tokens=self.kv_manager.prefix_stats.hits_total,
            prefix_cache_hit_rate=self.kv_manager.prefix_stats.hit_rate,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens_total=self.num_prompt_tokens_total,
            generation_tokens_total=self.num_generation_tokens_total,
            **self._spec_stats(),
        )

    # ---- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass, sample, and return the requests that advanced or finished. A fault in
        the forward pass, the sampler or one request's post-processing fails one request, never the step's
        caller (see _on_step_failed); only a fault outside any request (the scheduler's) raises."""
        if self.spec is not None:
            running = self.scheduler.running
            grammars = {rid: self.sequences[rid].matcher for rid in self._constrained}
            self.spec.propose(running, grammars, self.max_model_len, len(running))
        out = self._schedule()
        failed = self._grammar_failures(out)
        if out.is_empty:
            return failed
        try:
            result = self.runner.execute(out)
            sampled = self._sample(result.logits, result.sample_requests) if result.sample_requests else []
            verified = self._verify_drafts(out, result.spec_logits) if result.spec_logits else {}
        except Exception as exc:  # noqa: BLE001 -- pinned on one request, not the engine (see _on_step_failed)
            return self._on_step_failed(out, exc)
        except BaseException:
            self.pool.reset_prefix_cache()  # blocks published for this step may hold partial K/V
            raise
        self.scheduler.on_step_done(out)
        self.num_prompt_tokens_total += sum(
            max(0, min(s.start + s.num_tokens, s.request.num_prompt_tokens) - s.start) for s in out.scheduled
        )
        touched: dict[str, _Group] = {}
        for rid, (first, logits) in result.prompt_logits.items():
            seq = self.sequences[rid]
            try:
                self._add_prompt_logprobs(self.groups[seq.group_id], first, logits)
            except Exception as exc:  # noqa: BLE001 -- this request's own fault: it fails alone
                touched[seq.group_id] = self._fail(seq, exc)
        now = time.monotonic()
        for rid, (tokens, num_drafted) in verified.items():
            self._apply_verified(self.sequences[rid], tokens, num_drafted, now, touched)
        for request, token in zip(result.sample_requests, sampled):
            seq = self.sequences[request.request_id]
            touched[seq.group_id] = self.groups[seq.group_id]
            if request.is_finished:  # its request failed earlier in this step
                continue
            try:
                self._append_token(seq, token, now)
            except Exception as exc:  # noqa: BLE001 -- e.g. the detokenizer or a stop check: it fails alone
                self._fail(seq, exc)
        outputs = [self._make_output(g) for g in touched.values() if self._emits(g)]
        for group in touched.values():
            if group.finished:
                self._drop(group)
        return failed + outputs

    def _spec_stats(self) -> dict[str, Any]:
        """The speculative-decoding totals for EngineStats (zeros when it is off)."""
        if self.spec is None:
            return {}
        totals = self.spec.stats
        return {
            "spec_decode_num_drafts": totals.num_drafts,
            "spec_decode_num_draft_tokens": totals.num_draft_tokens,
            "spec_decode_num_accepted_tokens": totals.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": tuple(totals.num_accepted_tokens_per_pos),
        }

    def _verify_drafts(
        self, out: SchedulerOutput, spec_logits: dict[str, torch.Tensor]
    ) -> dict[str, tuple[list[SampledToken], int]]:
        """The tokens each drafted request gains: the sampler's own choice at each verified position, the drafts
        accepted up to the first mismatch and the sampler's token there (speculative sampling for a point-mass
        draft, spec_decode/verify.py). Each position's row sees the drafts before it as output tokens (penalties,
        min_tokens: verify.DraftedRow) and is masked by its grammar's state after them (matcher.draft_masks), so
        it is what a one-token step there would have chosen. Greedy rows in one
        call; sampled rows one at a time, so a seeded request draws once per token it gains. Each token comes with
        its row's logprobs when the request asked for them (raw logprobs of that position, as a one-token step
        would report). Per request: (the tokens, how many were drafted)."""
        assert self.spec is not None
        verified: dict[str, tuple[list[SampledToken], int]] = {}
        for s in out.scheduled:
            request = s.request
            logits = spec_logits.get(request.request_id)
            if logits is None:
                continue
            rows = drafted_rows(request, s.draft_token_ids)  # each position sees the drafts before it
            matcher = self.sequences[request.request_id].matcher  # and is masked by the grammar's state there
            masks = None if matcher is None else draft_masks(matcher, s.draft_token_ids, logits.shape[1])
            if request.sampling_params.is_greedy:
                targets = self.sampler(logits, rows, masks)
                gained = targets[: len(verify_greedy(s.draft_token_ids, [t.token_id for t in targets]))]
            else:
                gained = []

                def sample_at(
                    i: int,
                    logits: torch.Tensor = logits,
                    rows: list[SamplerRow] = rows,
                    masks: list[RowMask] | None = masks,
                    gained: list[SampledToken] = gained,
                ) -> int:
                    token = self.sampler(
                        logits[i : i + 1],
                        rows[i : i + 1],  # one draw from its generator
                        None if masks is None else masks[i : i + 1],
                    )[0]
                    gained.append(token)
                    return token.token_id

                verify_by_sampling(s.draft_token_ids, sample_at)
            verified[request.request_id] = (gained, len(s.draft_token_ids))
        return verified

    def _apply_verified(
        self, seq: _Sequence, tokens: list[SampledToken], num_drafted: int, now: float, touched: dict[str, _Group]
    ) -> None:
        """Count the verified draft (metrics, adaptive gate), append its tokens one by one (stop strings, EOS and
        max_tokens end it where a one-token step would have), count the accepted drafts' K/V as computed, and roll
        back the rest."""
        request = seq.request
        touched[seq.group_id] = self.groups[seq.group_id]
        if request.is_finished:  # its request failed earlier in this step
            return
        assert self.spec is not None
        self.spec.record(request, num_drafted, len(tokens) - 1)
        try:
            for token in tokens:
                self._append_token(seq, token, now)
                if request.is_finished:
                    return
        except Exception as exc:  # noqa: BLE001 -- e.g. the detokenizer or a stop check: it fails alone
            self._fail(seq, exc)
            return
        request.num_computed_tokens += len(tokens) - 1  # the accepted drafts; the last token is computed next
        self.kv_manager.rollback(request)

    def _schedule(self) -> SchedulerOutput:
        """The scheduler's step; when nothing can run only because grammars are still compiling, wait a moment
        for one (the caller would otherwise call again at once, in a busy loop)."""
        before = self.event_recorder.before_schedule(self.scheduler, self.kv_manager)
        out = self.scheduler.schedule()
        if out.is_empty and not out.grammar_failed and self.scheduler.pending_grammars:
            wait(self.scheduler.pending_grammar_futures(), timeout=_GRAMMAR_WAIT_S, return_when=FIRST_COMPLETED)
            out = self.scheduler.schedule()
        self.event_recorder.after_schedule(out, before, self.scheduler, self.kv_manager)
        return out

    def _user_request_id(self, sequence_id: str) -> str:
        seq = self.sequences.get(sequence_id)
        return seq.group_id if seq is not None else sequence_id

    def kv_snapshot(self, include_tokens: bool = True) -> dict[str, Any]:
        """The KV inspector's view of the pool, requests and prefix cache: fresh plain values sharing nothing with
        the engine (call it on the engine thread; see engine/inspector.py for the schema)."""
        return build_snapshot(self, include_tokens)

    def _grammar_failures(self, out: SchedulerOutput) -> list[RequestOutput]:
        """Outputs of the requests whose grammar failed to compile (the scheduler has finished them)."""
        outputs = []
        for request, error in out.grammar_failed:
            seq = self.sequences.get(request.request_id)
            if seq is None:  # a sibling of a sequence reported before it in this list
                continue
            group = self.groups[seq.group_id]
            group.error = f"the request's grammar failed to compile: {error}"
            logger.info("request %r: %s", group.request_id, group.error)
            for sibling in group.sequences:
                if not sibling.request.is_finished:
                    self.scheduler.finish(sibling.request, RequestStatus.FINISHED_ABORTED)
            outputs.append(self._make_output(group))
            self._drop(group)
        return outputs

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> list[SampledToken]:
        """The sampler, given the rows' grammar matchers only when some live sequence has a grammar."""
        if not self._constrained:
            return self.sampler(logits, requests)
        return self.sampler(logits, requests, self._matchers(requests))

    def _matchers(self, requests: list[Request]) -> list[GrammarMatcher | None]:
        """The grammar matcher of each sampled row (None: unconstrained). A sequence gets its matcher when it first
        samples: its grammar is compiled by then (the scheduler admitted it). One whose matcher cannot be made
        fails alone (its row is then sampled unconstrained and dropped)."""
        matchers: list[GrammarMatcher | None] = []
        for request in requests:
            seq = self.sequences[request.request_id]
            if seq.matcher is None and request.request_id in self._constrained and not request.is_finished:
                try:
                    seq.matcher = self._new_matcher(seq)
                except Exception as exc:  # noqa: BLE001 -- this request's own fault: it fails alone
                    self._fail(seq, exc)
            matchers.append(seq.matcher)
        return matchers

    def _new_matcher(self, seq: _Sequence) -> GrammarMatcher:
        """A matcher in the state of `seq`'s output so far (empty, unless it had tokens before it got one)."""
        grammar = self.groups[seq.group_id].grammar
        if grammar is None or not grammar.done():
            raise RuntimeError("a constrained sequence was scheduled before its grammar compiled")
        matcher = self.grammar.matcher(grammar.result())
        for tid in seq.request.output_token_ids:
            self._advance_grammar(matcher, tid)
        return matcher

    def _advance_grammar(self, matcher: GrammarMatcher, token_id: int) -> None:
        """Feed one sampled token to the sequence's grammar. The mask allowed it, so a refusal (or a matcher that
        hit its own limit) is a fault of this request: raised, it fails the request alone."""
        if not matcher.accept_token(token_id):
            raise RuntimeError(f"the grammar refused token {token_id}, which its mask allowed")
        error = matcher.error()
        if error is not None:
            raise RuntimeError(f"the grammar matcher failed: {error}")

    def _on_step_failed(self, out: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        """One request's fault must not end everyone's requests, nor the engine. The step's requests go back to
        waiting (recomputed, as after a preemption: the step may have written partial K/V) as suspects that
        the scheduler runs alone; a suspect that fails alone is the culprit and fails by itself, with an
        error output. Requests the failed step did not touch keep their progress."""
        self.pool.reset_prefix_cache()  # blocks published for this step may hold partial K/V
        culprits = self.scheduler.quarantine(out)
        if not culprits:
            logger.warning(
                "a step of %d requests failed (%s: %s); running each alone to find the culprit",
                len(out.scheduled),
                type(exc).__name__,
                exc,
                exc_info=exc,
            )
            return []
        outputs = []
        for request in culprits:
            group = self._fail(self.sequences[request.request_id], exc)
            outputs.append(self._make_output(group))
            self._drop(group)
        return outputs

    def _fail(self, culprit: _Sequence, exc: Exception) -> _Group:
        """Finish `culprit` with an error and its unfinished siblings as aborted (the request cannot complete
        without it), freeing their blocks at once. Returns the group, now finished, for its output."""
        group = self.groups[culprit.group_id]
        logger.error(
            "request %r failed and is ended alone: %s: %s", group.request_id, type(exc).__name__, exc, exc_info=exc
        )
        group.error = f"the engine failed while running this request: {type(exc).__name__}: {exc}"
        self.scheduler.finish(culprit.request, RequestStatus.FINISHED_ERROR)
        for seq in group.sequences:
            if not seq.request.is_finished:
                self.scheduler.finish(seq.request, RequestStatus.FINISHED_ABORTED)
        return group

    def _append_token(self, seq: _Sequence, token: SampledToken, now: float) -> None:
        """Record a sampled token, stream its text, and finish the sequence if a stop condition holds."""
        request = seq.request
        params = request.sampling_params
        tid = token.token_id
        if seq.matcher is not None:
            self._advance_grammar(seq.matcher, tid)  # first: a refused token is not recorded
        request.output_token_ids.append(tid)
        self.num_generation_tokens_total += 1
        if request.first_token_time is None:
            request.first_token_time = now
        if (
            seq.logprobs is not None
            and token.top_logprobs is not None
            and token.logprob is not None
            and token.rank is not None
        ):  # all three are set together, when logprobs were asked
            seq.logprobs.append(logprob_entry(tid, token.logprob, token.rank, token.top_logprobs, self._token_text))
            seq.cumulative_logprob = (seq.cumulative_logprob or 0.0) + token.logprob
        num_out = len(request.output_token_ids)
        status: RequestStatus | None = None
        reason: int | str | None = None
        if seq.matcher is not None and seq.matcher.is_terminated():
            # The grammar is complete (it took a stop token): "stop", whatever min_tokens or ignore_eos say, as
            # the mask would allow nothing but stop tokens from here on. The stop token stays out of the text.
            status = RequestStatus.FINISHED_STOPPED
        elif num_out >= params.min_tokens and not (params.ignore_eos and tid in self.eos_token_ids):
            if tid in self.eos_token_ids:
                status = RequestStatus.FINISHED_STOPPED
            elif tid in (params.stop_token_ids or ()):  # a list since SamplingParams.__post_init__
                status, reason = RequestStatus.FINISHED_STOPPED, tid
        if status is None or params.include_stop_str_in_output:
            result = seq.detokenizer.append(tid)  # the stop token itself stays out of the text
            seq.text += result.delta_text
            if status is None and result.stopped_on is not None:
                status, reason = RequestStatus.FINISHED_STOPPED, result.stopped_on
        if status is None and (
            (params.max_tokens is not None and num_out >= params.max_tokens) or request.num_tokens >= self.max_model_len
        ):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            request.stop_reason = reason
            if seq.detokenizer.stopped_on is None:
                seq.text += seq.detokenizer.finish().delta_text  # release text held back as a possible stop
            self.scheduler.finish(request, status)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.id_to_token(token_id) or ""

    def _add_prompt_logprobs(self, group: _Group, first: int, logits: torch.Tensor) -> None:
        assert group.prompt_logprobs is not None
        ids = group.prompt_token_ids
        judged = ids[first + 1 : first + 1 + logits.shape[0]]
        entries = prompt_logprobs(logits, judged, group.params.prompt_logprobs or 0)
        for offset, entry in enumerate(entries):
            position = first + 1 + offset
            if position == len(group.prompt_logprobs):  # a recompute after preemption adds nothing twice
                group.prompt_logprobs.append(
                    {tid: Logprob(lp.logprob, lp.rank, self._token_text(tid)) for tid, lp in entry.items()}
                )

    @staticmethod
    def _emits(group: _Group) -> bool:
        """Whether a step that advanced `group` produces an output for it (FINAL_ONLY: only at the end)."""
        return group.finished or group.params.output_kind is not RequestOutputKind.FINAL_ONLY

    def _make_output(self, group: _Group) -> RequestOutput:
        """The group's output in the kind its parameters ask for. DELTA: only the sequences that advanced or
        finished since the previous output, each with only its new text, tokens and logprobs (so a consumer
        does O(new) work per output, not O(everything so far)); the prompt's logprobs once, in the first."""
        delta = group.params.output_kind is RequestOutputKind.DELTA
        if delta:
            completions = [self._delta_output(seq) for seq in group.sequences if self._has_news(seq)]
            prompt_logprobs = None if group.sent_prompt_logprobs else group.prompt_logprobs
            group.sent_prompt_logprobs = True
        else:
            completions = [self._cumulative_output(seq) for seq in group.sequences]
            prompt_logprobs = group.prompt_logprobs
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=completions,
            finished=group.finished,
            num_cached_tokens=min(s.request.num_cached_tokens for s in group.sequences),
            metrics=self._metrics(group.sequences[0].request),
            error=group.error,
        )

    @staticmethod
    def _finish_reason(seq: _Sequence) -> str | None:
        return seq.request.status.value if seq.request.is_finished else None

    def _cumulative_output(self, seq: _Sequence) -> CompletionOutput:
        request = seq.request
        return CompletionOutput(
            index=seq.index,
            text=seq.text,
            token_ids=list(request.output_token_ids),
            cumulative_logprob=seq.cumulative_logprob,
            logprobs=None if seq.logprobs is None else list(seq.logprobs),
            finish_reason=self._finish_reason(seq),
            stop_reason=request.stop_reason,
        )

    @staticmethod
    def _has_news(seq: _Sequence) -> bool:
        """Whether a DELTA output has something new for `seq`: tokens, text, or its finish."""
        return (
            len(seq.request.output_token_ids) > seq.sent_tokens
            or len(seq.text) > seq.sent_chars
            or (seq.request.is_finished and not seq.sent_finish)
        )

    def _delta_output(self, seq: _Sequence) -> CompletionOutput:
        """What `seq` gained since its previous DELTA output, and the marks of how much is now handed out."""
        request = seq.request
        tokens, chars = len(request.output_token_ids), len(seq.text)
        logprobs = None if seq.logprobs is None else seq.logprobs[seq.sent_tokens : tokens]
        out = CompletionOutput(
            index=seq.index,
            text=seq.text[seq.sent_chars :],
            token_ids=request.output_token_ids[seq.sent_tokens : tokens],
            cumulative_logprob=seq.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=self._finish_reason(seq),
            stop_reason=request.stop_reason,
        )
        seq.sent_tokens, seq.sent_chars, seq.sent_finish = tokens, chars, request.is_finished
        return out

    @staticmethod
    def _metrics(request: Request) -> RequestMetrics:
        return RequestMetrics(
            request.arrival_time,
            request.first_scheduled_time,
            request.first_token_time,
            request.finished_time,
            request.num_preemptions,
        )

    def _drop(self, group: _Group) -> None:
        self.groups.pop(group.request_id, None)
        for seq in group.sequences:
            self._forget(seq)

    def _forget(self, seq: _Sequence) -> None:
        """Let go of a finished sequence, once (and the drafter of its per-request state)."""
        known = self.sequences.pop(seq.request.request_id, None) is not None
        self._constrained.discard(seq.request.request_id)
        if known and self.spec is not None:
            self.spec.on_finished(seq.request)

    def check_invariants(self) -> None:
        """The pool is whole: every block free or referenced, and references match requests' holdings.

        A public debug API, kept in the package on purpose (the tests call it after every step, and a user chasing
        a leak can too): raises AssertionError naming the first broken block. O(blocks); call it between steps on
        the thread that steps the engine (behind a server: `async_engine.call(LLMEngine.check_invariants)`)."""
        self.pool.check_invariants()
        counts: dict[int, int] = {}
        for blocks in self.kv_manager.req_blocks.values():
            for b in blocks:
                counts[b.block_id] = counts.get(b.block_id, 0) + 1
        for block in self.pool.blocks:
            if block.ref_cnt != counts.get(block.block_id, 0):
                raise AssertionError(f"{block} has ref_cnt {block.ref_cnt} but {counts.get(block.block_id, 0)} holders")
