"""The CUDA path's pieces that do not need a GPU: its flags, the graph buckets and padding, the host <-> device
staging, and the sampler's sync-free variants (which a GPU runs) giving the CPU's exact answers."""

from __future__ import annotations

import argparse

import pytest
import torch

from kvserve.attention.metadata import AttentionMetadata
from kvserve.capacity import NULL_BLOCK_ID
from kvserve.config import EngineConfig, resolve_attention_backend
from kvserve.engine import sampler as sampler_module
from kvserve.engine.cuda_graphs import build_decode_graphs, capture_sizes, default_capture_sizes, pad_decode_inputs
from kvserve.engine.host_transfer import HostToDevice, fetch_to_host, to_device
from kvserve.engine.request import Request
from kvserve.engine.sampler import Sampler
from kvserve.engine_args import add_engine_args, engine_config_from_args
from kvserve.kv.groups import make_kv_cache_layout
from kvserve.sampling_params import SamplingParams

CPU = torch.device("cpu")


def parse(*argv: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_config_from_args(parser.parse_args(list(argv)))


def test_graph_flags_reach_the_config() -> None:
    assert parse().enforce_eager is False and parse().cuda_graph_sizes is None
    config = parse("--enforce-eager", "--cuda-graph-sizes", "1", "2", "8")
    assert config.enforce_eager is True and config.cuda_graph_sizes == (1, 2, 8)
    assert (
        parse().attention_backend is None and parse("--attention-backend", "reference").attention_backend == "reference"
    )


def test_the_attention_backend_defaults_by_device_and_keeps_an_explicit_choice() -> None:
    assert resolve_attention_backend(None, "cpu") == "cpu"
    assert resolve_attention_backend(None, "cuda") == "triton"
    assert resolve_attention_backend("reference", "cuda") == "reference"
    assert resolve_attention_backend("reference", "cpu") == "reference"


@pytest.mark.parametrize("quantization", ["q8_0", "gguf"])
def test_cpu_kernel_quantizations_are_refused_on_cuda(quantization: str) -> None:
    with pytest.raises(ValueError, match="--quantization none"):
        EngineConfig(device="cuda:1", quantization=quantization)
    assert EngineConfig(device="cpu", quantization=quantization).quantization == quantization
    assert EngineConfig(device="cuda", quantization="auto").device_type == "cuda"


@pytest.mark.parametrize("kw", [dict(device="tpu"), dict(device="cuda:x"), dict(cuda_graph_sizes=[0, 8])])
def test_bad_device_or_graph_sizes_are_refused(kw) -> None:
    with pytest.raises(ValueError):
        EngineConfig.parse(**kw)


def test_default_capture_sizes_are_vllms_buckets_up_to_max_num_seqs() -> None:
    assert default_capture_sizes(256) == [1, 2, 4, *range(8, 257, 8)]
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16, 24]  # the last size holds the largest batch
    assert default_capture_sizes(3) == [1, 2, 4]
    assert default_capture_sizes(1) == [1]
    assert default_capture_sizes(4096)[-1] == 512  # vLLM's cap: larger batches run eagerly
    assert capture_sizes([8, 2, 2, 64], 256, 32) == [2, 8]  # sorted, unique, none above the token budget
    assert capture_sizes(None, 8, 2048) == [1, 2, 4, 8]


@pytest.mark.parametrize(
    "kw",
    [
        dict(enforce_eager=True, attention_backend="triton"),
        dict(attention_backend="reference"),
        dict(device="cpu", attention_backend="triton"),
    ],
)
def test_graphs_are_off_with_enforce_eager_an_uncapturable_backend_or_on_cpu(kw) -> None:
    """Decided before anything touches a GPU (so this runs without one)."""
    config = EngineConfig(**{"device": "cuda", **kw})
    device = torch.device(config.device)
    layout = make_kv_cache_layout([None])
    assert build_decode_graphs(config, None, [], layout, 64, device) is None  # type: ignore[arg-type]


def test_padding_rows_write_and_read_only_the_null_block() -> None:
    """Each KV cache group's slot mapping and tables are padded alike (here a full group and a sliding one, whose
    first entry is the null block)."""
    ids, pos = torch.tensor([7, 8]), torch.tensor([5, 9])
    full = AttentionMetadata.build([[5, 2], [3, 9, 4]], [6, 10], [1, 1], 4, torch.device("cpu"))
    sliding = AttentionMetadata.build([[0, 6], [0, 11, 12]], [6, 10], [1, 1], 4, torch.device("cpu"))
    padded = pad_decode_inputs(4, 4, ids, pos, [full, sliding])
    assert padded.input_ids.tolist() == [7, 8, 0, 0] and padded.positions.tolist() == [5, 9, 0, 0]
    null_slot = NULL_BLOCK_ID * 4
    assert padded.slot_mapping.tolist() == [[9, 17, null_slot, null_slot], [25, 49, null_slot, null_slot]]
    assert padded.block_tables[0].tolist() == [[5, 2, 0], [3, 9, 4], [NULL_BLOCK_ID] * 3, [NULL_BLOCK_ID] * 3]
    assert padded.block_tables[1].tolist() == [[0, 6, 0], [0, 11, 12], [NULL_BLOCK_ID] * 3, [NULL_BLOCK_ID] * 3]
    assert padded.seq_lens.tolist() == [6, 10, 1, 1]  # one token of context: the slot the padding row just wrote
    with pytest.raises(ValueError, match="does not fit"):
        pad_decode_inputs(1, 4, ids, pos, [full, sliding])


def test_staged_transfer_packs_one_copy_and_keeps_each_steps_tensors() -> None:
    mover = HostToDevice(CPU, staged=True)
    a, b = torch.arange(5), torch.arange(6).reshape(2, 3)
    first = mover.move([a, b])
    assert [t.shape for t in first] == [a.shape, b.shape]
    assert first[0].tolist() == a.tolist() and first[1].tolist() == b.tolist()
    assert first[0].untyped_storage().data_ptr() == first[1].untyped_storage().data_ptr()  # one copy, split
    a.fill_(-1)
    second = mover.move([torch.full((40,), 3)])  # reuses (and grows) the staging buffer
    assert first[0].tolist() == list(range(5)) and second[0].tolist() == [3] * 40
    with pytest.raises(TypeError, match="int64"):
        mover.move([torch.zeros(2, dtype=torch.int32)])


def test_on_the_cpu_nothing_is_copied() -> None:
    t = torch.arange(4)
    assert HostToDevice(CPU).move([t])[0] is t
    assert fetch_to_host([t, None]) == [t, None]
    assert to_device([1.5, 2], torch.float32, CPU).tolist() == [1.5, 2.0]


def rows_of_every_kind(vocab: int = 50) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, vocab, generator=g) * 3
    logits[1, 7] = float("nan")  # argmax prefers NaN
    logits[2, 11] = float("inf")
    logits[3] = float("-inf")  # nothing left
    logits[4] = float("nan")
    logits[5, :] = float("-inf")
    logits[5, 3] = float("nan")
    logits[6, :] = float("-inf")  # one finite candidate, which min_tokens blocks: the raw logits' choice is 9
    logits[6, 9] = 1.0
    return logits


def sampled(logits: torch.Tensor, params: list[SamplingParams]) -> list[tuple]:
    requests = [Request(f"r{i}", [1, 2], p) for i, p in enumerate(params)]
    out = Sampler([0], seed=7)(logits.clone(), requests)
    return [(t.token_id, t.logprob, t.rank, t.top_logprobs) for t in out]


@pytest.mark.parametrize("kind", ["greedy", "sampled", "mixed"])
def test_the_sync_free_sampler_gives_the_cpu_samplers_tokens_and_logprobs(monkeypatch, kind: str) -> None:
    """What a GPU runs (no host sync to find bad rows: fix-ups computed for every row) equals the CPU path exactly,
    on rows with NaN, +inf and no finite candidate, with logprobs, seeds, top-k/top-p and mixed batches."""
    greedy = SamplingParams(temperature=0, logprobs=3)
    rand = [
        SamplingParams(temperature=0.8, seed=3, logprobs=2),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.3, top_k=5, top_p=0.9, min_p=0.05),
    ]
    params = {"greedy": [greedy] * 8, "sampled": (rand * 3)[:8], "mixed": ([greedy] + rand) * 2}[kind]
    params[6] = params[6].clone(min_tokens=1, stop_token_ids=[9])
    logits = rows_of_every_kind()
    expected = sampled(logits, params)
    monkeypatch.setattr(sampler_module, "_sync_free", lambda device: True)
    got = sampled(logits, params)
    assert [g[0] for g in got] == [e[0] for e in expected] and got[6][0] == 9
    assert repr(got) == repr(expected)  # repr: NaN logprobs (rows of NaN) compare equal


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2", "int8"])
def test_8bit_kv_writes_and_reads_on_cuda_as_on_the_cpu(kv_dtype: str) -> None:
    """The cache write path (scales, saturating cast, byte-view index_copy_) and the read (index, dequantize) have
    CUDA kernels and give the CPU's bytes."""
    from kvserve.dtypes import torch_dtype
    from kvserve.kv.quant import load, store

    x = torch.randn(6, 2, 32, generator=torch.Generator().manual_seed(0)) * 5
    slots = torch.tensor([3, 17, 4, 30, 0, 9])
    results = []
    for device in (CPU, torch.device("cuda")):
        cache = torch.zeros(8, 4, 2, 32, dtype=torch_dtype(kv_dtype), device=device)
        scales = torch.ones(8, 4, 2, device=device)
        store(cache, scales, x.to(device), slots.to(device))
        results.append(load(cache, scales, slots.to(device), torch.float32).cpu())
    assert torch.equal(results[0], results[1])
