"""Speculative decoding in the whole engine on tiny random checkpoints: greedy output token for token the same
with and without drafts (batching, chunked prefill, preemption, prefix caching), the pool whole after every step,
and the acceptance counters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import build_tiny_hf_model, tiny_engine
from tiny_tokenizer import write_char_tokenizer

from kvserve import SamplingParams
from kvserve.engine.engine import LLMEngine
from kvserve.metrics import EngineStatsCollector

SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 2,
    "disable_by_batch_size": 64,
}
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llama_gqa")
    build_tiny_hf_model("llama_gqa").save_pretrained(path)
    write_char_tokenizer(path)
    return path


def make_engine(path: Path, spec: dict | None, **kw) -> LLMEngine:
    return tiny_engine(path, speculative_config=spec, **kw)


def repetitive_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a phrase, so that n-gram drafts find matches (and random models tend to loop)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        phrase = torch.randint(4, 256, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g).tolist()
        tail = torch.randint(4, 256, (int(torch.randint(0, 5, (1,), generator=g)),), generator=g).tolist()
        out.append([2] + phrase * int(torch.randint(2, 5, (1,), generator=g)) + tail)
    return out


def run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    """Generate, checking the pool after every step; token ids per prompt."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        engine.check_invariants()
    assert engine.core.pool.num_free_blocks == engine.core.pool.num_usable_blocks  # nothing leaked
    return [done[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize(
    "engine_kw",
    [
        {},
        dict(max_num_batched_tokens=7),  # chunked prefill mixed with verification chunks
        dict(num_gpu_blocks_override=24, max_model_len=64),  # preemption with a small pool
        dict(enable_prefix_caching=False),
        dict(block_size=1),
    ],
    ids=["default", "chunked", "preempt", "nocache", "block1"],
)
def test_greedy_output_identical_with_and_without_speculation(checkpoint, engine_kw):
    prompts = repetitive_prompts(10, seed=1)
    prompts[4] = prompts[2][:12] + prompts[4]  # shared prefixes: prefix-cache hits
    # Other kinds of neighbour: sampled (seeded), with penalties, with logprobs.
    params = [GREEDY] * len(prompts)
    params[1] = SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)
    params[3] = SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=24, ignore_eos=True)
    params[6] = SamplingParams(temperature=0, logprobs=2, max_tokens=24, ignore_eos=True)
    off = run(make_engine(checkpoint, None, **engine_kw), prompts, params)
    engine = make_engine(checkpoint, SPEC, **engine_kw)
    on = run(engine, prompts, params)
    assert on == off
    stats = engine.stats()
    assert stats.spec_decode_num_drafts > 0
    assert 0 < stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
    if "num_gpu_blocks_override" in engine_kw:
        assert engine.core.scheduler.num_preemptions > 0


def test_stop_strings_and_max_tokens_end_inside_an_accepted_draft(checkpoint):
    prompts = repetitive_prompts(6, seed=4)
    outs = {}
    for spec in (None, SPEC):
        engine = make_engine(checkpoint, spec)
        greedy = run(engine, prompts, [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)] * 6)
        tokenizer = engine.tokenizer
        stops = [tokenizer.decode(g[10:12]) for g in greedy]  # text that appears mid-output
        params = [
            SamplingParams(temperature=0, max_tokens=7 + i, stop=[s], ignore_eos=True) for i, s in enumerate(stops)
        ]
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(f"s{i}", p, sp)
        texts: dict[str, tuple[str, str | None]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    texts[out.request_id] = (out.outputs[0].text, out.outputs[0].finish_reason)
            engine.check_invariants()
        outs[spec is None] = (greedy, texts)
    assert outs[True] == outs[False]


def test_acceptance_metrics_are_exported(checkpoint):
    engine = make_engine(checkpoint, SPEC)
    run(engine, repetitive_prompts(3, seed=5), [GREEDY] * 3)
    families = {m.name: m.samples[0].value for m in EngineStatsCollector(engine.stats, "m").collect()}
    stats = engine.stats()
    assert families["kvserve:spec_decode_num_drafts"] == stats.spec_decode_num_drafts > 0
    assert families["kvserve:spec_decode_num_draft_tokens"] == stats.spec_decode_num_draft_tokens
    assert families["kvserve:spec_decode_num_accepted_tokens"] == stats.spec_decode_num_accepted_tokens
    per_pos = stats.spec_decode_num_accepted_tokens_per_pos
    assert len(per_pos) == SPEC["num_speculative_tokens"]
    assert sum(per_pos) == stats.spec_decode_num_accepted_tokens
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))  # a draft keeps position i only if it kept i - 1
    assert per_pos[0] <= stats.spec_decode_num_drafts
    family = next(
        m
        for m in EngineStatsCollector(engine.stats, "m").collect()
        if m.name == "kvserve:spec_decode_num_accepted_tokens_per_pos"
    )
    assert [(s.labels, s.value) for s in family.samples] == [
        ({"model_name": "m", "position": str(i)}, v) for i, v in enumerate(per_pos)
    ]
    plain = make_engine(checkpoint, None)
    assert plain.stats().spec_decode_num_accepted_tokens_per_pos == ()
    assert "kvserve:spec_decode_num_accepted_tokens_per_pos" not in {
        m.name for m in EngineStatsCollector(plain.stats, "m").collect()
    }  # speculation off: no per-position family


def test_batch_size_gate_turns_drafting_off(checkpoint):
    engine = make_engine(checkpoint, {**SPEC, "disable_by_batch_size": 2})
    run(engine, repetitive_prompts(4, seed=6), [GREEDY] * 4)  # 4 run at once: no drafts until 2 are left
    few = engine.stats().spec_decode_num_drafts
    engine = make_engine(checkpoint, {**SPEC, "disable_by_batch_size": 1})
    run(engine, repetitive_prompts(4, seed=6), [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * 4)
    assert engine.stats().spec_decode_num_drafts <= few


def test_seeded_sampled_output_identical_with_and_without_speculation(checkpoint):
    """Verification samples each position as a one-token step would, with the request's generator, so a seeded
    request gets the same tokens whether drafts ran or not (and whatever its neighbours do). Low temperatures:
    the tiny random model's distributions are flat, and its outputs must loop for drafts to be accepted."""
    prompts = repetitive_prompts(8, seed=7)
    params = [
        SamplingParams(temperature=t, top_p=p, seed=100 + i, max_tokens=24, ignore_eos=True)
        for i, (t, p) in enumerate([(0.02, 1.0), (0.05, 0.9), (0.1, 1.0), (0.2, 0.8)] * 2)
    ]
    off = run(make_engine(checkpoint, None), prompts, params)
    engine = make_engine(checkpoint, SPEC)
    on = run(engine, prompts, params)
    assert on == off
    assert engine.stats().spec_decode_num_accepted_tokens > 0
    greedy = run(make_engine(checkpoint, None), prompts, [GREEDY] * len(prompts))
    assert greedy != on  # really sampled: some request left the greedy path


def test_offline_api_takes_speculative_config_and_n_samples_draft(checkpoint):
    from kvserve import LLM

    prompts = repetitive_prompts(4, seed=1)
    params = SamplingParams(n=2, temperature=0.02, seed=5, max_tokens=20, ignore_eos=True)
    llm = LLM(model=str(checkpoint), speculative_config=SPEC, num_gpu_blocks_override=128, block_size=4)
    outs = llm.generate(prompts, params, use_tqdm=False)
    plain = LLM(model=str(checkpoint), num_gpu_blocks_override=128, block_size=4).generate(
        prompts, params, use_tqdm=False
    )
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in plain]
    assert llm.engine.stats().spec_decode_num_accepted_tokens > 0
    llm.engine.check_invariants()


def _oracle_drafts(engine: LLMEngine, reference: list[list[int]]) -> dict[int, int]:
    """Make `engine` draft, for every decoding request, the next tokens of `reference` (the run without drafts),
    through its real propose (so a grammar still trims them); returns accepted drafts by request index, filled as
    the engine runs, after checking that every (trimmed) draft is accepted in full, as exact verification must."""
    k = SPEC["num_speculative_tokens"]
    accepted: dict[int, int] = {}

    def oracle(request, max_model_len):
        done = len(request.output_token_ids)
        room = request.sampling_params.max_tokens - done - 1
        return reference[int(engine.core.requests.user_request_id(request.request_id))][done : done + min(k, room)]

    real_record = engine.core.spec.record

    def record(request, num_drafted, num_accepted):
        real_record(request, num_drafted, num_accepted)
        index = int(engine.core.requests.user_request_id(request.request_id))
        accepted[index] = accepted.get(index, 0) + num_accepted
        assert num_accepted == num_drafted  # the oracle is always right, if verification is exact

    engine.core.spec._draft = oracle
    engine.core.spec.record = record
    return accepted


@pytest.mark.parametrize("pattern", ["[a-f]{12}", "(ab|cd|ef){6}"])
def test_constrained_requests_draft_and_keep_their_output(checkpoint, pattern):
    """A grammar's request drafts only what its grammar allows (trimmed before the grammar would complete), and
    each verified position is masked by the grammar's state after the drafts before it. n-gram drafts: the same
    output; oracle drafts (the run without drafts): every one accepted, which fails if a row is masked with the
    wrong state."""
    from kvserve.structured.params import StructuredOutputsParams

    prompts = repetitive_prompts(4, seed=1)
    regex = SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex=pattern))
    sampled = SamplingParams(
        temperature=0.5, seed=3, max_tokens=12, structured_outputs=StructuredOutputsParams(regex=pattern)
    )
    params = [GREEDY, regex, sampled, regex]
    off = run(make_engine(checkpoint, None), prompts, params)
    assert run(make_engine(checkpoint, SPEC), prompts, params) == off
    engine = make_engine(checkpoint, SPEC)
    accepted = _oracle_drafts(engine, off)
    assert run(engine, prompts, params) == off
    assert all(accepted.get(i, 0) >= 4 for i in (1, 2, 3)), accepted  # the constrained ones verified drafts


def test_requests_with_logprobs_draft_and_report_each_positions_logprobs(checkpoint):
    """A drafting request that asks for logprobs gets, for every token (accepted drafts and the token after them),
    the same logprobs, rank and top-n as without drafts: each verified row's raw logprobs. Tolerance 1e-5: a
    verification chunk's logits come from a several-row forward pass, a one-token step's from a single row."""
    prompts = repetitive_prompts(6, seed=1)
    params = [
        SamplingParams(temperature=0, logprobs=3, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.05, seed=9, logprobs=1, max_tokens=24, ignore_eos=True),
    ] * 3

    def generate(engine: LLMEngine) -> list:
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(str(i), p, sp)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0]
        return [done[str(i)] for i in range(len(prompts))]

    off = generate(make_engine(checkpoint, None))
    engine = make_engine(checkpoint, SPEC)
    on = generate(engine)
    assert engine.stats().spec_decode_num_accepted_tokens > 0  # drafts were accepted, so rows were verified
    for a, b in zip(on, off):
        assert a.token_ids == b.token_ids
        assert a.logprobs is not None and b.logprobs is not None and len(a.logprobs) == len(a.token_ids)
        for pos_a, pos_b in zip(a.logprobs, b.logprobs):
            assert pos_a.keys() == pos_b.keys()
            for tid in pos_a:
                assert pos_a[tid].rank == pos_b[tid].rank
                assert pos_a[tid].logprob == pytest.approx(pos_b[tid].logprob, abs=1e-5)
        assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-4)


@pytest.mark.parametrize(
    "engine_kw", [{}, dict(num_gpu_blocks_override=24, max_model_len=64)], ids=["default", "preempt"]
)
def test_penalties_and_min_tokens_verify_exactly(checkpoint, engine_kw):
    """Each verified position's sampler row sees the drafts before it as output (verify.DraftedRow), so repetition,
    presence and frequency penalties and min_tokens blocking judge it as a one-token step would. An oracle drafter
    proposes the tokens the run without drafts produced: exact verification accepts them all and reproduces the
    output; a row that judged with the wrong history would pick another token there, and the output would differ.
    (A tiny random model does not loop under penalties, so n-gram drafts alone would hardly be accepted.)"""
    prompts = repetitive_prompts(8, seed=1)
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.5, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0, presence_penalty=1.0, frequency_penalty=0.5, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.5, seed=4, frequency_penalty=1.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0, stop_token_ids=[5, 9], min_tokens=10, max_tokens=24),
    ] * 2
    off = run(make_engine(checkpoint, None, **engine_kw), prompts, params)
    engine = make_engine(checkpoint, SPEC, **engine_kw)
    by_request = _oracle_drafts(engine, off)
    assert run(engine, prompts, params) == off
    by_kind = [by_request.get(i, 0) + by_request.get(i + 4, 0) for i in range(4)]
    assert all(n >= 10 for n in by_kind), by_kind  # every kind verified many positions
