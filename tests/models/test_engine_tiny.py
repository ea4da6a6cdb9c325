"""The whole engine (scheduler, paged cache, runner, sampler, detokenizer) on tiny random checkpoints,
checked against HF transformers and against itself under batching, chunking, preemption and caching."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from tiny_models import build_tiny_hf_model, tiny_engine
from tiny_tokenizer import write_char_tokenizer

from kvserve import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from logprob_check import assert_logprobs_close

TOP = 5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:
    out = {}
    for variant in ("llama_gqa", "qwen3_gqa_tied", "gemma3_mqa_sliding"):
        path = tmp_path_factory.mktemp(variant)
        model = build_tiny_hf_model(variant)
        model.save_pretrained(path)
        write_char_tokenizer(path)
        out[variant] = (path, model)
    return out


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 40, (n,), generator=g).tolist()
    return [[2] + torch.randint(4, 256, (k,), generator=g).tolist() for k in lengths]


def hf_greedy_with_top(model: torch.nn.Module, ids: list[int], n: int) -> tuple[list[int], list[dict]]:
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
    tokens = out.sequences[0, len(ids) :].tolist()
    tops = [dict.fromkeys(torch.topk(s[0], TOP).indices.tolist()) for s in out.scores]
    return tokens, tops


GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=TOP)


def tops_of(completion) -> list[dict]:
    return [dict.fromkeys(sorted(e, key=lambda t: e[t].rank)[: TOP + 1]) for e in completion.logprobs]


@pytest.mark.parametrize("variant", ["llama_gqa", "qwen3_gqa_tied", "gemma3_mqa_sliding"])
def test_greedy_generation_matches_hf(checkpoints, variant):
    path, hf = checkpoints[variant]
    llm = LLM(engine=tiny_engine(path))
    batch = prompts(6, seed=1)
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    for ids, out in zip(batch, outs):
        ref, ref_top = hf_greedy_with_top(hf, ids, 16)
        c = out.outputs[0]
        assert len(c.token_ids) == 16 and c.finish_reason == "length"
        assert_logprobs_close(ref, ref_top, c.token_ids, tops_of(c), name=variant)
    llm.engine.check_invariants()
    assert llm.engine.core.pool.num_free_blocks == llm.engine.core.pool.num_usable_blocks


@pytest.mark.parametrize(
    "engine_kw",
    [
        dict(max_num_batched_tokens=7),  # chunked prefill mixed with decodes
        dict(num_gpu_blocks_override=60, max_model_len=64),  # preemption: 16 requests cannot all fit (a 64-token
        # request holds up to 48 of the sliding variant's one-layer blocks while it prefills)
        dict(enable_prefix_caching=False, max_num_seqs=3),
        dict(attention_backend="reference"),
    ],
    ids=["chunked", "preempt", "nocache-fewseqs", "reference-attn"],
)
def test_batched_output_equals_alone(checkpoints, engine_kw):
    path, _ = checkpoints["gemma3_mqa_sliding"]
    batch = prompts(16, seed=2)
    batch[5] = batch[3][:20] + batch[5]  # shared prefixes exercise prefix-cache hits
    batch[9] = batch[3][:25]
    alone_engine = tiny_engine(path)
    alone = [LLM(engine=alone_engine).generate([p], GREEDY, use_tqdm=False)[0].outputs[0] for p in batch]
    engine = tiny_engine(path, **engine_kw)
    outs = LLM(engine=engine).generate(batch, GREEDY, use_tqdm=False)
    for a, o in zip(alone, outs):
        c = o.outputs[0]
        assert_logprobs_close(a.token_ids, tops_of(a), c.token_ids, tops_of(c), name=str(engine_kw))
    if "num_gpu_blocks_override" in engine_kw:
        assert engine.core.scheduler.num_preemptions > 0
    engine.check_invariants()
    assert engine.core.pool.num_free_blocks == engine.core.pool.num_usable_blocks


def test_prefix_cache_hit_gives_same_output_and_counts_cached_tokens(checkpoints):
    path, _ = checkpoints["llama_gqa"]
    llm = LLM(engine=tiny_engine(path))
    p = prompts(1, seed=3)[0] + list(range(10, 30))
    first = llm.generate([p], GREEDY, use_tqdm=False)[0]
    second = llm.generate([p], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == (len(p) - 1) // 4 * 4
    assert first.outputs[0].token_ids == second.outputs[0].token_ids


def test_seeded_sampling_is_reproducible_in_any_batch(checkpoints):
    path, _ = checkpoints["qwen3_gqa_tied"]
    llm = LLM(engine=tiny_engine(path))
    p = prompts(1, seed=4)[0]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate([p], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = prompts(5, seed=5)
    mixed = llm.generate(
        others[:2] + [p] + others[2:],
        [SamplingParams(temperature=1.0, max_tokens=12)] * 2
        + [seeded]
        + [SamplingParams(temperature=0.7, max_tokens=12)] * 3,
        use_tqdm=False,
    )
    assert mixed[2].outputs[0].token_ids == alone


def test_n_samples_share_the_prompt(checkpoints):
    path, _ = checkpoints["llama_gqa"]
    llm = LLM(engine=tiny_engine(path))
    p = prompts(1, seed=6)[0]
    out = llm.generate(
        [p], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True), use_tqdm=False
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # The siblings were scheduled in the same step as the first sample yet shared its full prompt blocks.
    full_blocks = (len(p) - 1) // 4 * 4
    assert llm.engine.stats().prefix_cache_hits_tokens == 2 * full_blocks
    greedy = llm.generate([p], SamplingParams(n=2, temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids


def test_stop_conditions(checkpoints):
    path, _ = checkpoints["llama_gqa"]
    llm = LLM(engine=tiny_engine(path))
    p = prompts(1, seed=8)[0]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    free = llm.generate([p], greedy, use_tqdm=False)[0].outputs[0]
    stop_tok = free.token_ids[4]
    first = free.token_ids.index(stop_tok)
    by_id = llm.generate([p], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_tok]), use_tqdm=False)[
        0
    ].outputs[0]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == stop_tok
    assert by_id.token_ids == free.token_ids[: first + 1]
    stop_str = free.text[5:7]
    by_str = llm.generate([p], SamplingParams(temperature=0, max_tokens=12, stop=[stop_str]), use_tqdm=False)[
        0
    ].outputs[0]
    cut = free.text.index(stop_str)
    assert by_str.finish_reason == "stop" and by_str.stop_reason == stop_str and by_str.text == free.text[:cut]
    kept = llm.generate(
        [p],
        SamplingParams(temperature=0, max_tokens=12, stop=[stop_str], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == free.text[: cut + len(stop_str)]
    llm.engine.check_invariants()


def test_prompt_logprobs_match_hf(checkpoints):
    path, hf = checkpoints["gemma3_mqa_sliding"]
    engine = tiny_engine(path, max_num_batched_tokens=9)  # prompt logprobs gathered over chunks
    p = prompts(1, seed=9)[0] + list(range(50, 80))
    out = LLM(engine=engine).generate([p], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(p)
    for pos in range(1, len(p)):
        entry = out.prompt_logprobs[pos]
        assert p[pos] in entry
        assert entry[p[pos]].logprob == pytest.approx(ref[pos - 1, p[pos]].item(), abs=1e-4)
        assert len(entry) <= 3


def test_abort_frees_blocks_and_bad_requests_are_rejected(checkpoints):
    path, _ = checkpoints["llama_gqa"]
    engine = tiny_engine(path, max_model_len=64)
    engine.add_request("a", prompts(1)[0], SamplingParams(max_tokens=40, ignore_eos=True))
    engine.add_request("b", prompts(1, seed=1)[0], SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.core.pool.num_free_blocks < engine.core.pool.num_usable_blocks
    aborted = engine.abort_request("a")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert engine.abort_request("a") is None and engine.abort_request("never") is None
    engine.check_invariants()
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.core.pool.num_free_blocks == engine.core.pool.num_usable_blocks
    with pytest.raises(ValueError, match="70 tokens.*64"):
        engine.add_request("long", [2] * 70, SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [], SamplingParams())
    with pytest.raises(ValueError, match="out of the vocabulary"):
        engine.add_request("oov", [2, 999], SamplingParams())
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request("t", [2, 5], SamplingParams(temperature=-1))
    engine.check_invariants()


def test_max_model_len_that_does_not_fit_fails_at_start(checkpoints):
    path, _ = checkpoints["llama_gqa"]
    # 10 blocks less the null block: 9 x 4 tokens
    with pytest.raises(ValueError, match="9 usable blocks .* largest max-model-len that fits is 36"):
        tiny_engine(path, num_gpu_blocks_override=10, max_model_len=100)


def test_token_id_prompt_is_used_verbatim_and_text_prompt_gets_bos(checkpoints):
    path, _ = checkpoints["llama_gqa"]
    llm = LLM(engine=tiny_engine(path))
    by_text, by_ids = llm.generate(["Hi", [45, 78]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert by_text.prompt_token_ids == [2, 45, 78]
    assert by_ids.prompt_token_ids == [45, 78]


@pytest.mark.parametrize("preempt", [False, True], ids=["roomy", "preempt"])
def test_prefix_caching_on_and_off_give_the_same_output(checkpoints, preempt):
    path, _ = checkpoints["gemma3_mqa_sliding"]
    system = prompts(1, seed=10)[0] + list(range(100, 140))  # shared "system prompt", crosses the window
    batch = [system + q[1:] for q in prompts(8, seed=11)]
    kw = dict(num_gpu_blocks_override=120, max_model_len=120) if preempt else {}  # one-layer blocks
    results = {}
    for caching in (True, False):
        engine = tiny_engine(path, enable_prefix_caching=caching, **kw)
        llm = LLM(engine=engine)
        single = llm.generate([batch[0]], GREEDY, use_tqdm=False)[0]
        many = llm.generate(batch, GREEDY, use_tqdm=False)
        results[caching] = [single] + many
        if caching:
            assert many[0].num_cached_tokens > 0 and engine.stats().prefix_cache_hit_rate > 0
        if preempt:
            assert engine.core.scheduler.num_preemptions > 0
        engine.check_invariants()
        assert engine.core.pool.num_free_blocks == engine.core.pool.num_usable_blocks
    for on, off in zip(results[True], results[False]):
        a, b = off.outputs[0], on.outputs[0]
        assert_logprobs_close(a.token_ids, tops_of(a), b.token_ids, tops_of(b), name=f"preempt={preempt}")
