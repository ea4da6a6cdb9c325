"""The "triton" backend under the decode-graph path (engine/cuda_graphs.py), in Triton's interpreter on CPU: the
graphs' metadata keeps its Python lists frozen at capture and only its tensors change between replays, as on a
GPU, so equal tokens here mean the Triton decode path reads the step only from tensors (what lets
cuda_graphs.CUDA_GRAPH_BACKENDS name it). A real capture needs a GPU (tests/models/test_cuda_graph_runner.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import torch

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.engine.cuda_graphs import CUDA_GRAPH_BACKENDS, DecodeGraphs, replay_by_call
from kvserve.engine.engine import LLMEngine


def test_triton_decode_under_frozen_graph_metadata_gives_the_eager_tokens(
    tmp_path: Path, interpreted_kernels: ModuleType
) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from tiny_models import build_tiny_hf_model
    from tiny_tokenizer import write_char_tokenizer

    assert "triton" in CUDA_GRAPH_BACKENDS
    build_tiny_hf_model("gemma3_mqa_sliding").save_pretrained(tmp_path)
    write_char_tokenizer(tmp_path)
    prompts = [[2, *range(10, 30)], [2, *range(50, 56)], [2, 7, 9]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 5, 7)]

    def engine() -> LLMEngine:
        return LLMEngine.from_config(
            EngineConfig(
                model=str(tmp_path),
                attention_backend="triton",
                block_size=16,
                num_gpu_blocks_override=16,
                max_num_seqs=4,
            )
        )

    eager = [o.outputs[0].token_ids for o in LLM(engine=engine()).generate(prompts, params, use_tqdm=False)]
    graphed_engine = engine()
    runner = graphed_engine.core.runner
    runner.graphs = DecodeGraphs(
        runner.model,
        runner.kv_caches,
        [1, 2, 4],
        graphed_engine.core.max_model_len,
        16,
        torch.device("cpu"),
        replay_by_call,
    )
    used: list[int] = []
    replay = runner.graphs.replay

    def spy(size: int, *inputs: torch.Tensor) -> torch.Tensor:
        used.append(size)
        return replay(size, *inputs)

    runner.graphs.replay = spy  # type: ignore[method-assign]
    graphed = [o.outputs[0].token_ids for o in LLM(engine=graphed_engine).generate(prompts, params, use_tqdm=False)]
    assert graphed == eager
    assert {4, 2, 1} <= set(used)  # 3 rows padded to 4, then 2, then 1
