"""Engine fault isolation on a tiny checkpoint (issue 14, "one request kills the engine for everyone"): a request
whose step fails is failed alone, its blocks freed, and the others complete exactly as without it; hostile
sampling parameters never yield a token outside the vocabulary; cache_salt and request ids are checked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import build_tiny_hf_model, tiny_engine
from tiny_tokenizer import write_char_tokenizer

from kvserve.engine.engine import LLMEngine
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams

POISON = 200  # a token id the injected fault reacts to; the healthy prompts never hold it
VOCAB = 256
MAX_STEPS = 2000  # every loop here is bounded


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llama_gqa_faults")
    build_tiny_hf_model("llama_gqa").save_pretrained(path)
    write_char_tokenizer(path)
    return path


def make_engine(path: Path, **kw: Any) -> LLMEngine:
    return tiny_engine(path, **{"num_gpu_blocks_override": 128, **kw})


class PoisonedModel:
    """The real model, except that a forward pass whose batch holds `poison` raises: a fault triggered by one
    request's data (a kernel bug, an out-of-range id) that takes the whole batch's step down with it."""

    def __init__(self, inner: torch.nn.Module, poison: int) -> None:
        self.inner = inner
        self.poison = poison
        self.num_failures = 0

    def __call__(self, input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if bool((input_ids == self.poison).any()):
            self.num_failures += 1
            raise RuntimeError("injected fault: poison token in the batch")
        return self.inner(input_ids, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def poison(engine: LLMEngine) -> PoisonedModel:
    model = PoisonedModel(engine.core.runner.model, POISON)
    engine.core.runner.model = model
    return model


def healthy_prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 30, (n,), generator=g).tolist()
    return [[2] + torch.randint(4, POISON, (k,), generator=g).tolist() for k in lengths]


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, RequestOutput]:
    """Add the requests, step until all finish (bounded), return each one's final output."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    finished: dict[str, RequestOutput] = {}
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert not engine.has_unfinished_requests(), "the engine did not drain"
    return finished


def assert_whole(engine: LLMEngine) -> None:
    engine.check_invariants()
    assert engine.core.pool.num_free_blocks == engine.core.pool.num_usable_blocks
    assert not engine.core.kv_manager.requests and not engine.core.scheduler.suspects


GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.mark.parametrize("poisoned_at", [0, 2, 5])
def test_a_request_whose_step_fails_fails_alone_and_the_others_are_unchanged(model_dir, poisoned_at):
    prompts = healthy_prompts(6, seed=1)
    clean = run(make_engine(model_dir), {f"r{i}": (p, GREEDY) for i, p in enumerate(prompts)})
    engine = make_engine(model_dir)
    model = poison(engine)
    bad_prompt = prompts[poisoned_at][:3] + [POISON] + prompts[poisoned_at][3:]
    requests = {f"r{i}": (p, GREEDY) for i, p in enumerate(prompts)}
    requests["bad"] = (bad_prompt, GREEDY)
    got = run(engine, requests)
    bad = got.pop("bad")
    assert bad.finished and bad.error and "injected fault" in bad.error
    assert bad.outputs[0].finish_reason == "error" and bad.outputs[0].token_ids == []
    assert {rid: o.outputs[0].token_ids for rid, o in got.items()} == {
        rid: o.outputs[0].token_ids for rid, o in clean.items()
    }
    assert all(o.error is None and o.outputs[0].finish_reason == "length" for o in got.values())
    assert model.num_failures == 2  # once in the batch, once alone
    assert engine.stats().num_preemptions == 0  # quarantine is not KV pressure
    assert_whole(engine)
    after = run(engine, {"after": (prompts[0], GREEDY)})  # the engine serves on, prefix cache and all
    assert after["after"].outputs[0].token_ids == clean["r0"].outputs[0].token_ids
    assert_whole(engine)


def test_a_fault_while_decoding_spares_the_others_and_their_progress(model_dir):
    """The poison arrives as a sampled token (forced here by a stop-free greedy request whose output we learn
    first), so the fault hits a decode step in which the others are mid-generation."""
    prompts = healthy_prompts(4, seed=2)
    clean = run(make_engine(model_dir), {f"r{i}": (p, GREEDY) for i, p in enumerate(prompts)})
    # Poison the token the model emits for r0 at decode position 3 (any id the model really produces).
    target = clean["r0"].outputs[0].token_ids[3]
    engine = make_engine(model_dir)
    model = PoisonedModel(engine.core.runner.model, target)
    engine.core.runner.model = model
    # Whoever feeds `target` to the model fails too: a prompt holding it, or an output holding it before its
    # last token (the last one is sampled, never computed).
    holders = [
        rid for rid, o in clean.items() if target in o.outputs[0].token_ids[:-1] or target in prompts[int(rid[1:])]
    ]
    got = run(engine, {f"r{i}": (p, GREEDY) for i, p in enumerate(prompts)})
    for rid, output in got.items():
        if rid in holders:
            assert output.outputs[0].finish_reason == "error" and output.error
        else:
            assert output.outputs[0].token_ids == clean[rid].outputs[0].token_ids and output.error is None
    assert "r0" in holders and got["r0"].outputs[0].finish_reason == "error"
    assert_whole(engine)


def test_n_samples_fail_together_and_their_blocks_are_freed(model_dir):
    prompts = healthy_prompts(2, seed=3)
    engine = make_engine(model_dir)
    poison(engine)
    n3 = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    got = run(engine, {"good": (prompts[0], GREEDY), "bad": ([2, POISON] + prompts[1], n3)})
    assert [c.finish_reason for c in got["bad"].outputs].count("error") == 1
    assert {c.finish_reason for c in got["bad"].outputs} <= {"error", "abort"} and got["bad"].error
    assert got["good"].outputs[0].finish_reason == "length"
    assert_whole(engine)


class BrokenDetokenizer:
    """A sequence's detokenizer that raises on its `fail_at`-th token (as a tokenizer bug would)."""

    def __init__(self, inner: Any, fail_at: int) -> None:
        self.inner = inner
        self.fail_at = fail_at
        self.seen = 0

    def append(self, token_id: int) -> Any:
        self.seen += 1
        if self.seen == self.fail_at:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer fault")
        return self.inner.append(token_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_fault_in_post_processing_fails_that_request_alone(model_dir):
    """The detokenizer (or a stop check) raising for one sequence must not abandon the step's other tokens."""
    prompts = healthy_prompts(3, seed=4)
    clean = run(make_engine(model_dir), {f"r{i}": (p, GREEDY) for i, p in enumerate(prompts)})
    engine = make_engine(model_dir)
    for rid, (p, params) in {f"r{i}": (p, GREEDY) for i, p in enumerate(prompts)}.items():
        engine.add_request(rid, p, params)
    sample = engine.output_processor.states["r1"].samples[0]  # detokenizing is the front end's
    sample.detokenizer = BrokenDetokenizer(sample.detokenizer, fail_at=3)
    got = run(engine, {})
    assert got["r1"].outputs[0].finish_reason == "error" and "injected detokenizer fault" in got["r1"].error
    for rid in ("r0", "r2"):
        assert got[rid].outputs[0].token_ids == clean[rid].outputs[0].token_ids
    assert_whole(engine)


def test_a_sampler_fault_is_isolated_like_a_model_fault(model_dir):
    prompts = healthy_prompts(3, seed=5)
    clean = run(make_engine(model_dir), {f"r{i}": (p, GREEDY) for i, p in enumerate(prompts)})
    engine = make_engine(model_dir)
    inner = engine.core.sampler
    doomed = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, seed=1234)

    def sampler(logits: torch.Tensor, requests: list) -> list:
        if any(r.sampling_params.seed == 1234 for r in requests):
            raise RuntimeError("injected sampler fault")
        return inner(logits, requests)

    engine.core.sampler = sampler  # type: ignore[assignment]
    requests = {f"r{i}": (p, GREEDY) for i, p in enumerate(prompts)} | {"doomed": (prompts[0], doomed)}
    got = run(engine, requests)
    assert got["doomed"].outputs[0].finish_reason == "error"
    assert {rid: got[rid].outputs[0].token_ids for rid in clean} == {
        rid: o.outputs[0].token_ids for rid, o in clean.items()
    }
    assert_whole(engine)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=3.0e38, min_tokens=2, max_tokens=6),  # huge but finite in float32
        SamplingParams(temperature=0.8, repetition_penalty=1e-45, max_tokens=6),
        SamplingParams(temperature=0.8, repetition_penalty=1e-45, max_tokens=1),
        SamplingParams(temperature=0, repetition_penalty=1e-45, max_tokens=6),
    ],
    ids=[
        "huge-temperature-min-tokens",
        "tiny-repetition-penalty",
        "tiny-repetition-penalty-max-tokens-1",
        "tiny-repetition-penalty-greedy",
    ],
)
def test_hostile_sampling_stays_in_the_vocabulary_and_the_engine_serves_on(model_dir, params):
    prompts = healthy_prompts(3, seed=6)
    engine = make_engine(model_dir)
    got = run(engine, {"hostile": (prompts[0], params)} | {f"r{i}": (p, GREEDY) for i, p in enumerate(prompts)})
    hostile = got.pop("hostile")
    tokens = hostile.outputs[0].token_ids
    assert tokens and all(0 <= t < VOCAB for t in tokens) and hostile.error is None
    assert hostile.outputs[0].finish_reason in ("stop", "length")
    assert all(o.outputs[0].finish_reason == "length" for o in got.values())
    assert_whole(engine)


def test_infinite_temperature_bypassing_validation_still_yields_real_tokens(model_dir):
    """Validation rejects inf (a 400); the sampler must not depend on it: forced in, it still samples ids < V."""
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=float("inf"))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=1e39)
    engine = make_engine(model_dir)
    params = SamplingParams(temperature=1.0, min_tokens=1, max_tokens=1)
    engine.add_request("inf", healthy_prompts(1, seed=7)[0], params)
    engine.core.requests.groups["inf"].sequences[0].request.sampling_params.temperature = float("inf")
    got = run(engine, {"next": (healthy_prompts(1, seed=8)[0], GREEDY)})
    assert 0 <= got["inf"].outputs[0].token_ids[0] < VOCAB and got["next"].outputs[0].finish_reason == "length"
    assert_whole(engine)


def test_cache_salt_that_is_not_utf8_is_a_value_error(model_dir):
    engine = make_engine(model_dir)
    with pytest.raises(ValueError, match="cache_salt.*UTF-8"):
        engine.add_request("s", [2, 5, 6], GREEDY, cache_salt="tenant-\ud800")
    with pytest.raises(ValueError, match="cache_salt must be a string"):
        engine.add_request("s", [2, 5, 6], GREEDY, cache_salt=b"bytes")  # type: ignore[arg-type]
    assert not engine.has_unfinished_requests()
    got = run(engine, {"s": ([2, 5, 6], GREEDY)})  # the id was never taken
    assert got["s"].outputs[0].finish_reason == "length"
    engine.add_request("ok", [2, 5, 6, 7, 8, 9], GREEDY, cache_salt="tenant-é")  # any encodable text is fine
    assert run(engine, {})["ok"].outputs[0].finish_reason == "length"
    assert_whole(engine)


def test_request_ids_that_look_like_child_ids_do_not_collide(model_dir):
    """add_request("x", n=2) then add_request("x#0") used to share one slot in the engine's and the KV
    manager's maps."""
    prompts = healthy_prompts(2, seed=9)
    two = SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True)
    alone = {
        rid: run(make_engine(model_dir), {rid: req})[rid]
        for rid, req in {"x": (prompts[0], two), "x#0": (prompts[1], GREEDY)}.items()
    }
    engine = make_engine(model_dir)
    engine.add_request("x", prompts[0], two)
    engine.add_request("x#0", prompts[1], GREEDY)
    engine.add_request("x#1", prompts[1], GREEDY)
    internal = [s.request.request_id for g in engine.core.requests.groups.values() for s in g.sequences]
    assert len(set(internal)) == 4 and len(engine.core.requests.sequences) == 4
    engine.step()
    assert len(engine.core.kv_manager.requests) == 4
    got = run(engine, {})
    assert [c.token_ids for c in got["x"].outputs] == [c.token_ids for c in alone["x"].outputs]
    assert got["x#0"].outputs[0].token_ids == alone["x#0"].outputs[0].token_ids
    assert got["x#1"].outputs[0].token_ids == alone["x#0"].outputs[0].token_ids
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("y", prompts[0], GREEDY)
        engine.add_request("y", prompts[0], GREEDY)
    engine.abort_request("y")
    assert_whole(engine)
