"""The GPU KV budget (engine/memory_profile.py) with the device facts injected: vLLM's arithmetic, its errors, and
which setting wins in the engine's plan_cache. No GPU: a torch.device("cuda") object is only a name here."""

from __future__ import annotations

import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.engine.build import plan_cache
from kvserve.engine.memory_profile import GpuMemoryFacts, gpu_kv_budget
from kvserve.kv.cache import KVCacheConfig
from kvserve.model.config import ModelConfig
from kvserve.units import GiB

CUDA = torch.device("cuda")
SPEC = KVCacheConfig(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)  # 8B-shaped


def facts(total: int = 80 * GiB, weights: int = 16 * GiB, peak: int = 2 * GiB, non_torch: int = GiB) -> GpuMemoryFacts:
    return GpuMemoryFacts(total=total, weights=weights, peak_activations=peak, non_torch=non_torch)


def test_the_budget_is_the_utilized_share_of_total_memory_less_weights_activations_and_non_torch() -> None:
    plan = gpu_kv_budget(facts(), 0.9, SPEC.bytes_per_block)
    assert plan.kv_bytes == int(80 * GiB * 0.9) - 16 * GiB - 2 * GiB - GiB
    text = plan.describe()
    assert "0.9 (--gpu-memory-utilization)" in text and "80.00 GiB total" in text
    assert "16.00 GiB weights" in text and "2.00 GiB peak activations" in text and "1.00 GiB non-torch" in text


def test_a_larger_profiled_peak_leaves_less_for_the_cache() -> None:
    small = gpu_kv_budget(facts(peak=GiB), 0.9, SPEC.bytes_per_block)
    large = gpu_kv_budget(facts(peak=5 * GiB), 0.9, SPEC.bytes_per_block)
    assert small.kv_bytes - large.kv_bytes == 4 * GiB


@pytest.mark.parametrize("kw", [dict(weights=75 * GiB), dict(peak=70 * GiB), dict(non_torch=80 * GiB)])
def test_not_enough_memory_is_an_error_naming_the_flags_to_change(kw) -> None:
    with pytest.raises(ValueError) as e:
        gpu_kv_budget(facts(**kw), 0.9, SPEC.bytes_per_block)
    message = str(e.value)
    assert "not enough GPU memory for the KV cache" in message
    for flag in (
        "--gpu-memory-utilization",
        "--max-num-batched-tokens",
        "--max-num-seqs",
        "--kv-cache-memory-bytes",
        "--num-gpu-blocks-override",
    ):
        assert flag in message


def test_room_for_fewer_than_two_blocks_is_an_error() -> None:
    one_block_left = 16 * GiB + 2 * GiB + GiB + SPEC.bytes_per_block  # with utilization 1.0
    with pytest.raises(ValueError, match="at least 2 blocks"):
        gpu_kv_budget(facts(total=one_block_left), 1.0, SPEC.bytes_per_block)
    assert (
        gpu_kv_budget(facts(total=one_block_left + SPEC.bytes_per_block), 1.0, SPEC.bytes_per_block).kv_bytes
        == 2 * SPEC.bytes_per_block
    )


def model_config() -> ModelConfig:
    return ModelConfig(
        family="llama",
        vocab_size=1000,
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        rms_norm_eps=1e-5,
        rope_theta=5e5,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_ids=[2],
    )


class Profile:
    def __init__(self, budget: int) -> None:
        self.budget, self.calls = budget, 0

    def __call__(self) -> int:
        self.calls += 1
        return self.budget


def test_on_cuda_the_engine_plans_from_the_profiled_budget() -> None:
    profile = Profile(10 * GiB)
    plan = plan_cache(EngineConfig(device="cuda"), model_config(), SPEC, CUDA, profile)
    assert profile.calls == 1 and plan.num_blocks == 10 * GiB // SPEC.bytes_per_block
    assert plan.max_model_len == (plan.num_blocks - 1) * 16 < 131072  # 10 GiB of 8B KV: the context is capped


@pytest.mark.parametrize(
    "kw, blocks",
    [(dict(kv_cache_memory_bytes=GiB), GiB // SPEC.bytes_per_block), (dict(num_gpu_blocks_override=100), 100)],
)
def test_an_explicit_budget_or_block_count_wins_over_the_profile(kw, blocks) -> None:
    profile = Profile(10 * GiB)
    plan = plan_cache(EngineConfig(device="cuda", max_model_len=1024, **kw), model_config(), SPEC, CUDA, profile)
    assert profile.calls == 0 and plan.num_blocks == blocks


def test_cuda_without_a_profile_or_a_budget_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="--kv-cache-memory-bytes or --num-gpu-blocks-override"):
        plan_cache(EngineConfig(device="cuda"), model_config(), SPEC, CUDA)
