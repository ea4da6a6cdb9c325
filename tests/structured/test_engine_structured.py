"""Structured output through the whole engine, on a tiny random checkpoint with the character tokenizer: the
output follows the grammar, finishes "stop" when the grammar completes and "length" when max_tokens runs out
first; unconstrained neighbours are untouched; preemption, prefix hits, n > 1, seeds and stop strings keep working;
a bad grammar or a failing matcher fails that request alone; the queue admits a request once its grammar is ready."""

from __future__ import annotations

import json
import re
from concurrent.futures import Future
from pathlib import Path

import jsonschema
import pytest
import torch
from tiny_models import build_tiny_hf_model
from tiny_tokenizer import write_char_tokenizer

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.engine.core_outputs import GRAMMAR_DEAD_END
from kvserve.engine.engine import LLMEngine
from kvserve.outputs import RequestOutput
from kvserve.structured.backend import GrammarCompileError
from kvserve.structured.params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"enum": ["x", "y"]}},
    "required": ["a", "b"],
}
JSON = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
LONG = StructuredOutputsParams(regex="[a-z]{200}")  # never complete within the tests' max_tokens


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("structured-tiny")
    build_tiny_hf_model("llama_gqa", eos_token_id=1, bos_token_id=2).save_pretrained(path)  # the tokenizer's ids
    write_char_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig(model=str(checkpoint), num_gpu_blocks_override=256, block_size=4))


@pytest.fixture
def llm(engine: LLMEngine) -> LLM:
    assert not engine.has_unfinished_requests()
    return LLM(engine=engine)


def greedy(**kw: object) -> SamplingParams:
    kw.setdefault("max_tokens", 40)
    return SamplingParams(temperature=0, **kw)  # type: ignore[arg-type]


def run_all(engine: LLMEngine, limit: int = 500) -> dict[str, RequestOutput]:
    """Step the engine until every request finished; the final output of each."""
    finished: dict[str, RequestOutput] = {}
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert not engine.has_unfinished_requests()
    return finished


def test_json_schema_output_validates_and_stops(llm: LLM) -> None:
    outs = llm.generate(["hello", "a longer prompt"], greedy(structured_outputs=JSON), use_tqdm=False)
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "stop" and out.error is None
        jsonschema.validate(json.loads(c.text), SCHEMA)
        assert c.token_ids[-1] == 1  # the grammar's stop token, kept out of the text
    llm.engine.check_invariants()


def test_regex_and_choice(llm: LLM) -> None:
    regex = StructuredOutputsParams(regex="[a-c]{2,5}x")
    choice = StructuredOutputsParams(choice=["alpha", "beta", "gamma"])
    outs = llm.generate(
        ["p", "q"], [greedy(structured_outputs=regex), greedy(structured_outputs=choice)], use_tqdm=False
    )
    assert re.fullmatch("[a-c]{2,5}x", outs[0].outputs[0].text) and outs[0].outputs[0].finish_reason == "stop"
    assert outs[1].outputs[0].text in {"alpha", "beta", "gamma"} and outs[1].outputs[0].finish_reason == "stop"


def test_grammar_that_cannot_finish_ends_with_length(llm: LLM) -> None:
    out = llm.generate("p", greedy(max_tokens=7, structured_outputs=LONG), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and re.fullmatch("[a-z]{7}", out.text)


def test_unconstrained_rows_are_bit_identical_next_to_constrained_ones(llm: LLM) -> None:
    """Same batch shapes at every step (the neighbours never finish early), so any difference would be the mask's."""
    prompts = ["one", "two two", "three", "four four four", "five", "six"]
    mine = [
        greedy(max_tokens=12, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, ignore_eos=True, logprobs=3),  # batch draw
        SamplingParams(temperature=1.0, top_k=20, seed=5, max_tokens=12, ignore_eos=True, logprobs=3),
    ]
    plain_neighbours = [
        greedy(max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=1, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.7, max_tokens=12, ignore_eos=True),
    ]
    constrained = [p.clone(structured_outputs=LONG) for p in plain_neighbours]
    runs = []
    for k, neighbours in enumerate((plain_neighbours, constrained)):
        llm.engine.core.sampler._generator.manual_seed(0)  # the unseeded rows' batch draw
        params = [mine[0], neighbours[0], mine[1], neighbours[1], mine[2], neighbours[2]]
        # A salt per run: a prefix-cache hit would change the prefill's shapes, and so the last bits of the logits.
        runs.append(llm.generate(prompts, params, use_tqdm=False, cache_salt=f"run {k}"))
    for i in (0, 2, 4):
        a, b = runs[0][i].outputs[0], runs[1][i].outputs[0]
        assert a.token_ids == b.token_ids and a.text == b.text
        assert a.logprobs == b.logprobs and a.cumulative_logprob == b.cumulative_logprob
    for i in (1, 3, 5):
        assert re.fullmatch("[a-z]{12}", runs[1][i].outputs[0].text)


def test_greedy_is_deterministic_and_seeds_reproduce(llm: LLM) -> None:
    params = [
        greedy(structured_outputs=JSON),
        SamplingParams(temperature=1.0, seed=7, max_tokens=40, structured_outputs=JSON),
    ]
    first = llm.generate(["x", "y"], params, use_tqdm=False)
    second = llm.generate(["x", "y"], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]


def test_n_samples_each_follow_the_grammar(llm: LLM) -> None:
    regex = StructuredOutputsParams(regex="[a-f]{3,8}(!|\\?)")
    out = llm.generate(
        "z", SamplingParams(n=4, temperature=1.5, seed=11, max_tokens=20, structured_outputs=regex), use_tqdm=False
    )[0]
    texts = [c.text for c in out.outputs]
    assert len(texts) == 4 and all(re.fullmatch("[a-f]{3,8}(!|\\?)", t) for t in texts)
    assert all(c.finish_reason == "stop" for c in out.outputs)
    assert len(set(texts)) > 1  # each sample has its own matcher and its own seed


def test_stop_string_inside_constrained_output(llm: LLM) -> None:
    free = llm.generate("s", greedy(max_tokens=10, structured_outputs=LONG), use_tqdm=False)[0].outputs[0].text
    stop = free[3:5]
    out = llm.generate("s", greedy(max_tokens=10, structured_outputs=LONG, stop=[stop]), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop and c.text == free[: free.index(stop)]


def test_prefix_cache_hit_gives_the_same_constrained_output(llm: LLM) -> None:
    prompt = "a prompt long enough to fill several blocks of four tokens"
    first = llm.generate(prompt, greedy(structured_outputs=JSON), use_tqdm=False)[0]
    second = llm.generate(prompt, greedy(structured_outputs=JSON), use_tqdm=False)[0]
    assert second.num_cached_tokens > 0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_preemption_keeps_constrained_outputs(engine: LLMEngine) -> None:
    """A pool too small for the batch preempts (recompute keeps the output tokens, and the matcher with them)."""
    prompts = [f"prompt number {i}" for i in range(6)]
    params = [greedy(max_tokens=40, structured_outputs=JSON if i in (1, 4) else LONG) for i in range(6)]
    roomy = LLM(engine=engine).generate(prompts, params, use_tqdm=False)
    tight = engine.sibling(num_gpu_blocks_override=30)
    small = LLM(engine=tight).generate(prompts, params, use_tqdm=False)
    assert tight.core.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in small] == [o.outputs[0].token_ids for o in roomy]
    assert [o.outputs[0].finish_reason for o in small] == [o.outputs[0].finish_reason for o in roomy]
    tight.check_invariants()


def test_min_tokens_does_not_block_a_complete_grammar(llm: LLM) -> None:
    """The grammar allows only the stop token after "ab"; min_tokens must not block it (the row would keep no
    candidate, and the fallback would pick a token the grammar refuses)."""
    choice = StructuredOutputsParams(choice=["ab"])
    out = llm.generate("m", greedy(min_tokens=6, structured_outputs=choice), use_tqdm=False)[0]
    assert out.error is None and out.outputs[0].text == "ab" and out.outputs[0].finish_reason == "stop"
    # Where the grammar allows more than the stop token, min_tokens still blocks it.
    regex = StructuredOutputsParams(regex="a{1,10}")
    longer = llm.generate("m", greedy(min_tokens=6, structured_outputs=regex), use_tqdm=False)[0].outputs[0]
    assert len(longer.text) >= 6 and re.fullmatch("a{6,10}", longer.text)


def test_bad_grammar_is_a_value_error_offline(llm: LLM) -> None:
    with pytest.raises(GrammarCompileError, match="structured_outputs.regex"):
        llm.generate("p", greedy(structured_outputs=StructuredOutputsParams(regex="(unclosed")), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_failed_compile_ends_that_request_only(engine: LLMEngine) -> None:
    engine.add_request("bad", "p", greedy(structured_outputs=StructuredOutputsParams(regex="[z-a]")))
    engine.add_request("good", "q", greedy(max_tokens=5, structured_outputs=JSON))
    engine.add_request("plain", "r", greedy(max_tokens=5))
    outs = run_all(engine)
    assert outs["bad"].outputs[0].finish_reason == "error" and "structured_outputs.regex" in (outs["bad"].error or "")
    assert outs["good"].error is None and outs["plain"].error is None
    assert len(outs["plain"].outputs[0].token_ids) == 5
    engine.check_invariants()


def test_waiting_grammar_lets_others_pass_then_is_admitted(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    pending: Future = Future()
    monkeypatch.setattr(engine.grammar, "compile_async", lambda params: pending)
    engine.add_request("slow", "p", greedy(max_tokens=40, structured_outputs=JSON))
    engine.add_request("plain", "q", greedy(max_tokens=3))
    seen: dict[str, RequestOutput] = {}
    for _ in range(6):
        seen.update({o.request_id: o for o in engine.step() if o.finished})
    assert "plain" in seen and "slow" not in seen  # admitted past the compiling one, in FCFS order otherwise
    assert engine.core.num_waiting == 1 and engine.core.num_running == 0
    pending.set_result(engine.grammar.compile(JSON))
    outs = run_all(engine)
    jsonschema.validate(json.loads(outs["slow"].outputs[0].text), SCHEMA)


def test_abort_while_compiling(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    pending: Future = Future()
    monkeypatch.setattr(engine.grammar, "compile_async", lambda params: pending)
    engine.add_request("slow", "p", greedy(structured_outputs=JSON))
    assert engine.step() == []
    out = engine.abort_request("slow")
    assert out is not None and out.outputs[0].finish_reason == "abort"
    assert not engine.core.scheduler.pending_grammars and not engine.has_unfinished_requests()
    pending.set_result(engine.grammar.compile(JSON))
    assert engine.step() == []


class _BrokenMatcher:
    """Refuses the first token it is given (a backend bug, as far as the engine can tell)."""

    def __init__(self, inner: object) -> None:
        self._inner = inner

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._inner.fill_bitmask(bitmask, row)  # type: ignore[attr-defined]

    def accept_token(self, token_id: int) -> bool:
        return False

    def is_terminated(self) -> bool:
        return False

    def error(self) -> str | None:
        return None


def test_a_grammar_dead_end_ends_that_request_cleanly(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A grammar that refuses the token its own mask allowed has no way on: the request ends "stop" with
    stop_reason grammar_dead_end and the output it had (here none), never a 500, never the refused token."""
    real = engine.grammar.matcher
    monkeypatch.setattr(engine.grammar, "matcher", lambda compiled: _BrokenMatcher(real(compiled)))
    engine.add_request("broken", "p", greedy(structured_outputs=JSON))
    engine.add_request("plain", "q", greedy(max_tokens=6, ignore_eos=True))
    outs = run_all(engine)
    broken = outs["broken"].outputs[0]
    assert outs["broken"].error is None and broken.finish_reason == "stop"
    assert broken.stop_reason == GRAMMAR_DEAD_END and broken.token_ids == [] and broken.text == ""
    assert outs["plain"].error is None and len(outs["plain"].outputs[0].token_ids) == 6
    engine.check_invariants()


def test_fill_fault_is_isolated_by_the_step_quarantine(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A matcher that raises while filling the step's mask fails the step; the quarantine pins it on its request."""
    real = engine.grammar.matcher

    class Raising(_BrokenMatcher):
        def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
            raise RuntimeError("mask failure")

    monkeypatch.setattr(engine.grammar, "matcher", lambda compiled: Raising(real(compiled)))
    engine.add_request("broken", "p", greedy(structured_outputs=JSON))
    engine.add_request("plain", "q", greedy(max_tokens=6, ignore_eos=True))
    outs = run_all(engine)
    assert outs["broken"].outputs[0].finish_reason == "error" and "mask failure" in (outs["broken"].error or "")
    assert outs["plain"].error is None and len(outs["plain"].outputs[0].token_ids) == 6
    engine.check_invariants()


def test_unconstrained_engine_never_builds_a_grammar_backend(checkpoint: Path) -> None:
    fresh = LLMEngine.from_config(EngineConfig(model=str(checkpoint), num_gpu_blocks_override=64, block_size=4))
    LLM(engine=fresh).generate(["a", "b"], greedy(max_tokens=4), use_tqdm=False)
    assert not fresh.grammar.is_built
    assert fresh.core.grammar is fresh.grammar  # one service, shared by the core and its front end


def test_guidance_backend_through_the_engine(engine: LLMEngine) -> None:
    other = engine.sibling(structured_outputs_backend="guidance", num_gpu_blocks_override=64)
    out = LLM(engine=other).generate("g", greedy(structured_outputs=JSON), use_tqdm=False)[0].outputs[0]
    assert other.grammar.backend.name == "guidance"
    jsonschema.validate(json.loads(out.text), SCHEMA)


def test_structured_outputs_accepts_vllm_dicts_and_rejects_junk() -> None:
    from_dict = SamplingParams(structured_outputs={"choice": ["a"]})  # type: ignore[arg-type]  # vLLM's dict shape
    assert from_dict.structured_outputs == StructuredOutputsParams(choice=["a"])
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs="json")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--structured-outputs-backend"):
        EngineConfig(structured_outputs_backend="outlines")


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]},
        },
    }
]
TOOL_TEMPLATE = (
    "{%- if tools %}[tools:{% for t in tools %} {{ t.function.name }}{% endfor %}]\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_chat_renders_tools_and_a_forced_call_parses(llm: LLM) -> None:
    from kvserve.structured.tool_schemas import parse_forced_tool_calls, tool_choice_params

    forced = tool_choice_params(TOOLS, "required", disable_any_whitespace=True)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    out = llm.chat(
        messages,
        greedy(max_tokens=120, structured_outputs=forced),
        use_tqdm=False,
        chat_template=TOOL_TEMPLATE,
        tools=TOOLS,
    )[0]
    assert out.prompt is not None and out.prompt.startswith("[tools: get_weather]\n<user>Weather in Paris?")
    assert out.outputs[0].finish_reason == "stop"
    calls = parse_forced_tool_calls(out.outputs[0].text, "required")
    assert calls and all(
        c.name == "get_weather" and json.loads(c.arguments)["city"] in ("Paris", "Oslo") for c in calls
    )


def test_chat_takes_a_batch_of_conversations(llm: LLM) -> None:
    conversations = [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "s"}, {"role": "user", "content": "yo"}],
    ]
    outs = llm.chat(conversations, greedy(max_tokens=3), use_tqdm=False, chat_template=TOOL_TEMPLATE)
    assert [o.prompt for o in outs] == ["<user>hi\n<assistant>", "<system>s\n<user>yo\n<assistant>"]
    with pytest.raises(ValueError, match="messages"):
        llm.chat([], use_tqdm=False)
