"""EngineConfig: every engine setting in one validated place, under vLLM's flag names.

The dataclass's field list is the one place engine defaults are written: the flags (engine_args.py) take theirs from
it (config_default). Frozen, and every field holds its own type: settings given in a flag's shape (JSON text or a
dict, "4GiB", a list) are parsed by their field's converter in EngineConfig.parse, which the flags and the offline API
(LLM(...)) build through, never fixed up after construction. What only loading the model can decide
(`--quantization auto`, the attention backend, the served name) is resolved once by engine/build.py's resolve_config
into a new config, so the caller's own object keeps what the caller asked for."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, field
from typing import Any

from kvserve.kv.events_config import KVEventsConfig, parse_kv_events_config
from kvserve.kv.offload.config import KVOffloadConfig, make_offload_config
from kvserve.spec_decode.config import SpeculativeConfig, parse_speculative_config
from kvserve.structured.config import StructuredOutputsConfig, parse_structured_outputs_config
from kvserve.units import GiB, parse_size
from kvserve.vocab import (
    ACTIVATION_QUANTIZATIONS,
    ATTENTION_BACKENDS,
    COMPUTE_DTYPES,
    HASH_ALGOS,
    KERNEL_ISAS,
    KV_DTYPES,
    LM_HEAD_QUANTIZATIONS,
    QUANTIZATION_METHODS,
    STRUCTURED_OUTPUTS_BACKENDS,
)

DEFAULT_CPU_KV_CACHE_BYTES = 4 * GiB
# --long-prefill-token-threshold on CPU: a long prompt's chunk a step, sized so that the step a short request arrives
# during ends soon, yet long enough that a step's fixed cost stays a small part of it (docs/KV_CACHE.md, "Long prompts
# beside short requests", gives the measured step costs).
DEFAULT_CPU_LONG_PREFILL_TOKENS = 256
# Weight quantizations that exist only as kvserve's CPU kernels (int8 / GGUF blocks read by AVX2 code): all but none.
CPU_ONLY_QUANTIZATIONS: tuple[str, ...] = tuple(m for m in QUANTIZATION_METHODS if m != "none")
_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def _parse_size(value: int | str | None) -> int | None:
    """--kv-cache-memory-bytes: a count of bytes, or text with a unit ("4GiB")."""
    return parse_size(value) if isinstance(value, str) else value


def _parse_sizes(value: Sequence[int] | None) -> tuple[int, ...] | None:
    """--cuda-graph-sizes: argparse's nargs (and JSON) give a list; the frozen config holds a tuple."""
    return value if value is None or isinstance(value, tuple) else tuple(value)


# The settings the flags and the offline API give in a flag's shape, each with the converter that parses it into its
# field's type: EngineConfig.parse applies them once; a converter returns a value already of its type unchanged.
SETTING_PARSERS: dict[str, Callable[[Any], Any]] = {
    "speculative_config": parse_speculative_config,
    "kv_events_config": parse_kv_events_config,
    "structured_outputs_config": parse_structured_outputs_config,
    "kv_cache_memory_bytes": _parse_size,
    "cuda_graph_sizes": _parse_sizes,
}


def _parsed(settings: dict[str, Any]) -> dict[str, Any]:
    """`settings` with each flag-shaped value parsed by its field's converter (SETTING_PARSERS)."""
    return {k: SETTING_PARSERS[k](v) if k in SETTING_PARSERS else v for k, v in settings.items()}


def _one_of(value: str, name: str, choices: tuple[str, ...]) -> tuple[bool, str, str]:
    """A check row of EngineConfig: `value` must be one of the registry's `choices` (kvserve/vocab.py)."""
    return value in choices, name, f"one of {', '.join(choices)}"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = None  # None: the default model (Gemma 3 270M GGUF)
    dtype: str = "auto"
    # Weights: "none" (the checkpoint's, in --dtype), "q8_0" (8-bit, a scale per 32), "gguf" (a GGUF file's own
    # blocks as stored), or "auto": gguf for a GGUF checkpoint on CPU, else none (capacity.resolve_quantization).
    quantization: str = "auto"
    # The LM head's own weights (kvserve/model/lm_head.py): None (as the rest) or "q4_0" (opt-in, lossy; needs gguf)
    lm_head_quantization: str | None = None
    # Activations of the GGUF matmuls: "none" (float32, exact) or "int8" (opt-in, lossy: integer dot products)
    activation_quantization: str = "none"
    kernel_isa: str = "auto"  # the CPU kernels' instruction set (kvserve.vocab.KERNEL_ISAS): A/B runs and tests
    device: str = "cpu"
    max_model_len: int | None = None  # None: the model's context length, capped by what the cache holds
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    kv_cache_memory_bytes: int | None = None  # None: 4 GiB on CPU; on CUDA a share of free memory ("4GiB": parse)
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    # vLLM's --disable-hybrid-kv-cache-manager: every layer keeps every token (one KV cache group of all layers), as
    # before sliding-window groups (kv/groups.py); for A/B runs.
    disable_hybrid_kv_cache_manager: bool = False
    prefix_caching_hash_algo: str = "sha256"  # or "xxhash" (faster; hits still compare block contents)
    max_pinned_kv_fraction: float = 0.5  # the pool's share that pinned prefixes may hold (kv/pins.py)
    max_pinned_kv_fraction_per_tenant: float | None = None  # one cache salt's share (None: the whole pin budget)
    # The share of the offload tier one tenant's prompt_cache_retention may hold (kv/offload/retention.py)
    max_retained_kv_fraction_per_tenant: float = 0.25
    enable_chunked_prefill: bool = True
    # vLLM's --max-num-partial-prefills: at most this many requests whose prompts are not done after a step (None: no
    # limit). 1 finishes bursts of prompts one after another: on a CPU, where batching prompts saves little, the median
    # first token comes about twice as soon (docs/MODELS.md).
    max_num_partial_prefills: int | None = None
    # vLLM's --long-prefill-token-threshold: a prompt with more tokens than this left to compute is long; it takes at
    # most this many tokens a step and yields to the other requests (engine/scheduler.py). 0: no long prompts. None:
    # DEFAULT_CPU_LONG_PREFILL_TOKENS on CPU, 0 on CUDA (vLLM's default with one partial prefill); see
    # long_prefill_threshold and docs/KV_CACHE.md.
    long_prefill_token_threshold: int | None = None
    # vLLM's --max-long-partial-prefills: long prompts prefilled at once (the others wait; shorter ones pass them).
    max_long_partial_prefills: int = 1
    # Emulate a contiguous cache: each request reserves blocks for max-model-len at admission (bench memory).
    reserve_max_model_len: bool = False
    seed: int = 0
    cpu_threads: int | None = None  # None: all cores
    # "cpu" (fast on CPU), "reference" (plain torch), "triton" (CUDA) or None: resolve_attention_backend's choice
    attention_backend: str | None = None
    # Decode batch sizes captured as CUDA graphs (vLLM's --cuda-graph-sizes); None: engine/cuda_graphs.py's default.
    cuda_graph_sizes: tuple[int, ...] | None = None
    enforce_eager: bool = False  # vLLM's flag: no CUDA graphs (graphs are never used on CPU)
    max_logprobs: int = 20
    served_model_name: str | None = None
    chat_template: str | None = None
    # Grammar library for structured output (vLLM's flag): auto, xgrammar or guidance (llguidance).
    structured_outputs_backend: str = "auto"
    # vLLM's --structured-outputs-config: kvserve's compile budgets (structured/config.py). JSON text, a dict or None
    # (the defaults) are parsed by EngineConfig.parse, once.
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    # Speculative decoding (vLLM's --speculative-config); None (the default): off. The flag's JSON text or a dict (the
    # offline API) is parsed by EngineConfig.parse, once, so that every reader sees a SpeculativeConfig.
    speculative_config: SpeculativeConfig | None = None
    # KV events on ZMQ in vLLM's schema (vLLM's --kv-events-config); None (the default): off (docs/KV_EVENTS.md).
    # JSON text or a dict is parsed by EngineConfig.parse, as for speculative_config.
    kv_events_config: KVEventsConfig | None = None
    # This engine's index among --data-parallel-size replicas (set by the cluster launcher, as vLLM's): its KV
    # events go to the configured endpoint offset by it, so replicas on one host never share an address.
    data_parallel_rank: int = 0
    # The KV offload tier (vLLM's --kv-offloading-size / --kv-offloading-backend; kvserve's --kv-offloading-path):
    # None (the default): no tier. A bare number is GiB, as in vLLM (LLM(kv_offloading_size=16)); text may carry a
    # unit ("512MiB"). A path puts the tier on disk (docs/KV_OFFLOAD.md).
    kv_offloading_size: float | str | None = None
    kv_offloading_backend: str | None = None
    kv_offloading_path: str | None = None
    kv_offloading_dtype: str = "auto"  # "int8": the tier stores 8 bits a value with scales (kv/offload/config.py)
    # Use a tier directory other users can write, or another user's (refused by default: kv/offload/safedir.py).
    kv_offloading_allow_other_writers: bool = False

    @classmethod
    def parse(cls, **settings: Any) -> EngineConfig:
        """A config from settings as the flags and the offline API give them (LLM(speculative_config={...}),
        kv_cache_memory_bytes="4GiB", cuda_graph_sizes=[1, 8]): each flag-shaped value is parsed by its field's
        converter (SETTING_PARSERS), once, before the frozen config is built."""
        return cls(**_parsed(settings))

    def updated(self, **settings: Any) -> EngineConfig:
        """A copy with `settings` changed, given in the shapes parse takes (LLMEngine.sibling's changes)."""
        return dataclasses.replace(self, **_parsed(settings))

    def __post_init__(self) -> None:
        self._check_parsed()
        _ = self.kv_offload  # parsed and checked here, so that a bad value fails at once
        checks = [
            (self.block_size in (1, 2, 4, 8, 16, 32, 64, 128, 256), "block_size", "a power of two from 1 to 256"),
            (self.max_num_seqs >= 1, "max_num_seqs", ">= 1"),
            (self.max_num_batched_tokens >= 1, "max_num_batched_tokens", ">= 1"),
            (
                self.max_num_partial_prefills is None or self.max_num_partial_prefills >= 1,
                "max_num_partial_prefills",
                ">= 1",
            ),
            (
                self.long_prefill_token_threshold is None or self.long_prefill_token_threshold >= 0,
                "long_prefill_token_threshold",
                ">= 0",
            ),
            (
                self.max_long_partial_prefills >= 1
                and self.max_long_partial_prefills <= (self.max_num_partial_prefills or self.max_long_partial_prefills),
                "max_long_partial_prefills",
                ">= 1 and at most --max-num-partial-prefills",
            ),
            (self.max_model_len is None or self.max_model_len >= 1, "max_model_len", ">= 1"),
            (0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", "in (0, 1]"),
            (0 <= self.max_pinned_kv_fraction <= 1, "max_pinned_kv_fraction", "in [0, 1]"),
            (
                0 <= self.max_retained_kv_fraction_per_tenant <= 1,
                "max_retained_kv_fraction_per_tenant",
                "in [0, 1]",
            ),
            (
                self.max_pinned_kv_fraction_per_tenant is None or 0 <= self.max_pinned_kv_fraction_per_tenant <= 1,
                "max_pinned_kv_fraction_per_tenant",
                "in [0, 1]",
            ),
            (
                self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 1,
                "num_gpu_blocks_override",
                ">= 1",
            ),
            (self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0, "kv_cache_memory_bytes", "> 0"),
            _one_of(self.dtype, "dtype", ("auto", *COMPUTE_DTYPES)),
            _one_of(self.quantization, "quantization", ("auto", *QUANTIZATION_METHODS)),
            _one_of(self.lm_head_quantization or "none", "lm_head_quantization", ("none", *LM_HEAD_QUANTIZATIONS)),
            _one_of(self.activation_quantization, "activation_quantization", ACTIVATION_QUANTIZATIONS),
            _one_of(self.kernel_isa, "kernel_isa", KERNEL_ISAS),
            _one_of(self.kv_cache_dtype, "kv_cache_dtype", ("auto", *KV_DTYPES)),
            _one_of(self.attention_backend or "auto", "attention_backend", ("auto", *ATTENTION_BACKENDS)),
            (_DEVICE.fullmatch(self.device) is not None, "device", "cpu or cuda[:N]"),
            (all(n >= 1 for n in self.cuda_graph_sizes or ()), "cuda_graph_sizes", "sizes >= 1"),
            _one_of(self.prefix_caching_hash_algo, "prefix_caching_hash_algo", HASH_ALGOS),
            (self.cpu_threads is None or self.cpu_threads >= 1, "cpu_threads", ">= 1"),
            (self.max_logprobs >= 0, "max_logprobs", ">= 0"),
            (self.data_parallel_rank >= 0, "data_parallel_rank", ">= 0"),
            _one_of(self.structured_outputs_backend, "structured_outputs_backend", STRUCTURED_OUTPUTS_BACKENDS),
        ]
        for ok, name, expected in checks:
            if not ok:
                raise ValueError(f"--{name.replace('_', '-')} must be {expected}, got {getattr(self, name)!r}")
        if self.device_type == "cuda" and self.quantization in CPU_ONLY_QUANTIZATIONS:
            raise ValueError(
                f"--quantization {self.quantization} runs kvserve's CPU kernels and cannot run on "
                f"--device {self.device}; use --quantization none (what auto means on CUDA): a GGUF "
                "file is then dequantized once to --dtype"
            )

    def _check_parsed(self) -> None:
        """TypeError for a flag-shaped value given to the constructor itself (a dict for speculative_config, "4GiB"):
        the field would hold another type than it says; EngineConfig.parse (or LLM(...)) parses it."""
        for name, parse in SETTING_PARSERS.items():
            value = getattr(self, name)
            try:
                parsed = parse(value) is value
            except ValueError:
                parsed = False
            if not parsed:
                raise TypeError(
                    f"EngineConfig({name}={value!r}): not a parsed value; build with EngineConfig.parse(...) (as "
                    "LLM(...) and the flags do), which parses JSON text, dicts, sizes with units and lists"
                )

    @property
    def kv_offload(self) -> KVOffloadConfig | None:
        """The offload tier's settings, or None without one."""
        return make_offload_config(
            self.kv_offloading_size,
            self.kv_offloading_path,
            self.kv_offloading_backend,
            self.kv_offloading_dtype,
            self.kv_offloading_allow_other_writers,
        )

    @property
    def long_prefill_threshold(self) -> int:
        """--long-prefill-token-threshold as the scheduler takes it (0: no long prompts): unset, CPU's default on CPU
        (a step's time grows with its tokens there, so short requests wait behind long prompts' chunks) and none on
        CUDA; never without chunked prefill."""
        if not self.enable_chunked_prefill:
            return 0
        if self.long_prefill_token_threshold is not None:
            return self.long_prefill_token_threshold
        return DEFAULT_CPU_LONG_PREFILL_TOKENS if self.device_type == "cpu" else 0

    @property
    def device_type(self) -> str:
        """ "cpu" or "cuda" (torch.device(self.device).type, without importing torch)."""
        return self.device.partition(":")[0]


def resolve_attention_backend(name: str | None, device_type: str) -> str:
    """`--attention-backend` unset: "cpu" on CPU, "triton" on CUDA. An explicit choice is kept."""
    if name is not None and name != "auto":
        return name
    return "cpu" if device_type == "cpu" else "triton"


def config_default(name: str) -> Any:
    """The default of EngineConfig's field `name`: engine defaults are written once, in the field list, and the flags
    (engine_args.py) take theirs from here."""
    spec = next(f for f in dataclasses.fields(EngineConfig) if f.name == name)
    if spec.default_factory is not MISSING:
        return spec.default_factory()
    return spec.default
