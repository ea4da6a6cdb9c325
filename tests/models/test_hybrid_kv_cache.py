"""The hybrid KV cache manager (kv/groups.py) through the whole engine, on tiny random checkpoints with sliding
windows of 8 tokens and blocks of 4: prompts 2-8x the window give out-of-window blocks back as they advance, and the
greedy output is the same as the uniform layout's (--disable-hybrid-kv-cache-manager) token for token, and HF
transformers' within vLLM's near-tie rule, under chunked prefill, preemption, prefix hits past the window, n > 1,
speculative decoding's rollback and 8-bit KV caches. Blocks given back are poisoned with NaN (and the null block
too), so a kernel that read one would show; the pool is whole after every step."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import build_tiny_hf_model, tiny_engine
from tiny_tokenizer import write_char_tokenizer

from kvserve import LLM, SamplingParams
from kvserve.capacity import NULL_BLOCK_ID
from kvserve.engine.engine import LLMEngine
from kvserve.kernels.ops import TORCH_KERNELS
from kvserve.kv.manager import KVCacheManager

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from logprob_check import assert_logprobs_close

TOP = 5
WINDOW = 8
VARIANTS = ["gemma3_mqa_sliding", "qwen2_sliding"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=TOP)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:
    out = {}
    for variant in VARIANTS:
        path = tmp_path_factory.mktemp(variant)
        model = build_tiny_hf_model(variant)
        model.save_pretrained(path)
        write_char_tokenizer(path)
        out[variant] = (path, model)
    return out


def long_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts of 2-8 windows (16-64 tokens), two of them sharing a 30-token start (a prefix hit past the window)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2 * WINDOW, 8 * WINDOW + 1, (n,), generator=g).tolist()
    batch = [[2] + torch.randint(4, 256, (k - 1,), generator=g).tolist() for k in lengths]
    if n > 1:
        batch[1] = batch[0][:30] + batch[1][1:]
    return batch


def tops_of(completion) -> list[dict]:
    return [dict.fromkeys(sorted(e, key=lambda t: e[t].rank)[: TOP + 1]) for e in completion.logprobs]


def hf_greedy(model: torch.nn.Module, ids: list[int], n: int) -> tuple[list[int], list[dict]]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    return out.sequences[0, len(ids) :].tolist(), [
        dict.fromkeys(torch.topk(s[0], TOP).indices.tolist()) for s in out.scores
    ]


class Poisoner:
    """After every step: the blocks the engine gave back because they fell out of a sliding window, and the null
    block, are filled with NaN in every cache tensor (their hashes dropped first, so that no prefix hit revives a
    poisoned block: the hit would be legitimate, the poison not). Any read of such a block turns outputs into NaN."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.freed: list[Any] = []
        self.poisoned = 0
        coordinator = engine.core.kv_manager.coordinator
        original = coordinator.free_skipped

        def recording(request_id: str, num_computed_tokens: int) -> None:
            tables = coordinator.tables(request_id)
            before = {id(b): b for table in tables for b in table}
            original(request_id, num_computed_tokens)
            after = {id(b) for table in tables for b in table}
            self.freed += [b for key, b in before.items() if key not in after]

        coordinator.free_skipped = recording  # type: ignore[method-assign]
        self._poison([engine.core.pool.null_block])

    def _poison(self, blocks: list[Any]) -> None:
        pool = self.engine.core.pool
        for cache in self.engine.core.runner.kv_caches:
            for block in blocks:
                if block.block_id != NULL_BLOCK_ID and block.block_hash is not None:
                    pool._evict(block)  # its hash gone: never revived by a hit
                    if block.spent:  # a free block holding no prefix waits at the free queue's head
                        pool.spent_queue.remove(block)
                        block.spent = False
                        pool.free_queue.appendleft(block)
                if cache.key.is_floating_point():  # an int8 cache is poisoned through its scales
                    cache.key[block.block_id] = float("nan")
                    cache.value[block.block_id] = float("nan")
                if cache.key_scale is not None and cache.value_scale is not None:
                    cache.key_scale[block.block_id] = float("nan")
                    cache.value_scale[block.block_id] = float("nan")

    def after_step(self) -> None:
        free = [b for b in self.freed if b.ref_cnt == 0]
        self.freed = [b for b in self.freed if b.ref_cnt > 0]
        self._poison(free)
        self.poisoned += len(free)


def run(engine: LLMEngine, batch: list[list[int]], params: SamplingParams, poisoner: Poisoner | None = None) -> list:
    """Every prompt's completions, the pool checked whole after every step."""
    for i, ids in enumerate(batch):
        engine.add_request(str(i), ids, params)
    finished: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        engine.check_invariants()
        if poisoner is not None:
            poisoner.after_step()
    engine.check_invariants()
    assert engine.core.pool.num_free_blocks == engine.core.pool.num_usable_blocks
    return [finished[str(i)] for i in range(len(batch))]


SETTINGS = {
    "plain": {},
    "chunked": dict(max_num_batched_tokens=7),
    # 3 groups of one layer (gemma) or 2 of two (qwen2): an 80-token request holds up to 36 blocks while it prefills
    "preempt": dict(num_gpu_blocks_override=40, max_model_len=80, max_num_batched_tokens=20),
    "n2": {},
    "ngram": dict(
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
            "disable_by_batch_size": 64,
        }
    ),
    "int8": dict(kv_cache_dtype="int8"),
    "fp8": dict(kv_cache_dtype="fp8"),
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_hybrid_and_uniform_layouts_give_the_same_greedy_output(models, variant, setting):
    path, hf = models[variant]
    kw = SETTINGS[setting]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=TOP, n=2 if setting == "n2" else 1)
    batch = long_prompts(6, seed=1)
    if setting == "ngram":  # a phrase repeated past the window: the drafter proposes (and random models loop)
        batch = [[2] + p[1:6] * (4 + i) for i, p in enumerate(batch)]
    hybrid = tiny_engine(path, **kw)
    uniform = tiny_engine(path, disable_hybrid_kv_cache_manager=True, **kw)
    assert hybrid.core.layout.is_hybrid and not uniform.core.layout.is_hybrid
    got = run(hybrid, batch, params, Poisoner(hybrid))
    want = run(uniform, batch, params)
    for g, w in zip(got, want):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
    if setting == "preempt":
        assert hybrid.core.scheduler.num_preemptions > 0
    if setting == "ngram":
        assert hybrid.core.stats().spec_decode_num_draft_tokens > 0
    if kw.get("kv_cache_dtype") is None:
        for ids, g in zip(batch[:3], got[:3]):
            ref, ref_top = hf_greedy(hf, ids, len(g.outputs[0].token_ids))  # max-model-len may cut it short
            assert_logprobs_close(ref, ref_top, g.outputs[0].token_ids, tops_of(g.outputs[0]), name=variant)


@pytest.mark.parametrize("path_kind", ["native", "torch-kernels", "reference"])
def test_blocks_given_back_are_never_read_again(models, path_kind):
    """Whichever kernels run attention, a block outside every window (and the null block) holding NaN changes no
    output: nothing reads it."""
    path, _ = models["gemma3_mqa_sliding"]
    kw = dict(attention_backend="reference") if path_kind == "reference" else {}
    engine = tiny_engine(path, max_num_batched_tokens=10, **kw)
    if path_kind == "torch-kernels":
        engine.core.runner.model.use_kernels(TORCH_KERNELS)
    poisoner = Poisoner(engine)
    batch = long_prompts(4, seed=2)
    got = run(engine, batch, GREEDY, poisoner)
    clean = run(tiny_engine(path, max_num_batched_tokens=10, **kw), batch, GREEDY)
    assert poisoner.poisoned > 20
    for g, c in zip(got, clean):
        assert g.outputs[0].token_ids == c.outputs[0].token_ids
        assert all(lp == lp for e in g.outputs[0].logprobs for lp in (x.logprob for x in e.values()))  # no NaN


def test_a_chat_turn_hits_past_the_window(models):
    """The next turn of a chat (the last prompt, its reply, a new message) hits the whole earlier conversation,
    though its blocks older than the window were given back mid-request: they stayed in the pool's LRU, hashed."""
    path, _ = models["gemma3_mqa_sliding"]
    engine = tiny_engine(path)
    llm = LLM(engine=engine)
    first_prompt = long_prompts(1, seed=3)[0]
    first = llm.generate([first_prompt], GREEDY, use_tqdm=False)[0]
    turn = first_prompt + list(first.outputs[0].token_ids) + [7, 8, 9, 10, 11]
    second = llm.generate([turn], GREEDY, use_tqdm=False)[0]
    computed = len(first_prompt) + len(first.outputs[0].token_ids) - 1  # the last output token is never computed
    assert second.num_cached_tokens == computed // 4 * 4 > 2 * WINDOW
    cold = LLM(engine=tiny_engine(path)).generate([turn], GREEDY, use_tqdm=False)[0]
    assert second.outputs[0].token_ids == cold.outputs[0].token_ids
    engine.check_invariants()


def test_a_long_request_holds_its_window_not_its_length(models):
    """Gemma's layout on the tiny model: one full-attention group and two sliding groups (one layer each); while a
    64-token prompt decodes, each sliding group holds only the blocks its window reaches."""
    path, _ = models["gemma3_mqa_sliding"]
    engine = tiny_engine(path, max_num_batched_tokens=16)
    layout = engine.core.layout
    assert [g.spec.window for g in layout.groups] == [None, WINDOW, WINDOW] and layout.tensors_per_block == 1
    engine.add_request("r", (long_prompts(1, seed=4)[0] * 4)[:64], GREEDY)
    kv: KVCacheManager = engine.core.kv_manager
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        state = next(iter(kv.requests.values()), None)  # the request's one sequence
        if state is not None:
            held.append([sum(1 for b in t if b is not kv.null_block) for t in state.tables])
    decoding = held[-5:]
    assert len(held) > 10
    assert all(h[0] >= 16 for h in decoding)  # the full group: every block
    assert all(h[1] == h[2] <= 3 for h in decoding)  # a sliding group: the 8-token window over at most 3 blocks
    assert max(h[1] for h in held) <= -(-(WINDOW - 1 + 16) // 4) + 1  # the window plus a 16-token chunk
