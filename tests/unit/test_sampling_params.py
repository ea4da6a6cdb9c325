"""SamplingParams: vLLM defaults, normalization and validation messages."""

from __future__ import annotations

import pytest

from kvserve.sampling_params import SamplingParams


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.seed, p.logprobs, p.prompt_logprobs) == (16, 0, None, None, None)
    assert p.stop == [] and p.stop_token_ids == []
    assert p.skip_special_tokens and p.spaces_between_special_tokens
    assert not p.ignore_eos and not p.include_stop_str_in_output
    assert not p.is_greedy and not p.has_penalties


def test_stop_is_normalized_to_a_list():
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


def test_greedy_threshold():
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=1e-4).is_greedy


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0),
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.5),
        ("frequency_penalty", 3.0),
        ("repetition_penalty", 0.0),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("logprobs", -1),
        ("prompt_logprobs", -3),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
        ("seed", 1.5),
    ],
)
def test_bad_field_names_field_and_value(field, value):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    assert field in str(err.value) and repr(value) in str(err.value)


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)
    SamplingParams(min_tokens=5, max_tokens=None)  # the engine decides the cap


def test_edge_values_are_accepted():
    SamplingParams(top_k=-1, top_p=1.0, min_p=1.0, presence_penalty=-2.0, frequency_penalty=2.0)
    SamplingParams(max_tokens=None, logprobs=0, prompt_logprobs=0, seed=-5)


def test_validate_against_engine_limits():
    p = SamplingParams(logprobs=20, prompt_logprobs=5, stop_token_ids=[99])
    p.validate_against(max_logprobs=20, vocab_size=100)
    with pytest.raises(ValueError, match="logprobs must be <= max_logprobs=10, got 20"):
        p.validate_against(max_logprobs=10, vocab_size=100)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=30).validate_against(max_logprobs=20, vocab_size=100)
    with pytest.raises(ValueError, match="stop_token_ids must be < vocab_size=99"):
        p.validate_against(max_logprobs=20, vocab_size=99)


def test_clone_copies_lists_and_revalidates():
    p = SamplingParams(stop=["a"], stop_token_ids=[1])
    q = p.clone(temperature=0.5)
    assert q.temperature == 0.5 and q.stop == ["a"] and q.stop is not p.stop
    with pytest.raises(ValueError, match="temperature"):
        p.clone(temperature=-1.0)


def test_child_for_n_expansion():
    p = SamplingParams(n=3, seed=10)
    assert [(c.n, c.seed) for c in (p.child(i) for i in range(3))] == [(1, 10), (1, 11), (1, 12)]
    assert SamplingParams(n=2).child(1).seed is None


def test_structured_outputs_params_imports_where_vllm_users_look():
    """vLLM users write `from vllm.sampling_params import StructuredOutputsParams`: the same import works from
    kvserve.sampling_params and from kvserve, lazily (importing either module loads neither torch nor a grammar
    library), and the class it gives is the one SamplingParams takes."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import kvserve, kvserve.sampling_params\n"
        "heavy = lambda: sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'xgrammar', 'llguidance'})\n"
        "print(heavy())\n"
        "from kvserve.sampling_params import StructuredOutputsParams, SamplingParams\n"
        "from kvserve import StructuredOutputsParams as Top\n"
        "from kvserve.structured.params import StructuredOutputsParams as Home\n"
        "assert StructuredOutputsParams is Top is Home\n"
        "p = SamplingParams(structured_outputs=StructuredOutputsParams(json={'type': 'object'}))\n"
        "assert isinstance(p.structured_outputs, Home)\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'xgrammar', 'llguidance'}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["[]", "[]"]
    with pytest.raises(AttributeError, match="Nope"):
        import kvserve.sampling_params as module

        module.Nope  # noqa: B018
