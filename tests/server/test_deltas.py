"""Engine outputs as deltas (RequestOutputKind), their coalescing in RequestStream, and the server's tracker.

Why these tests: the server used to diff cumulative outputs in two handlers; now the engine hands out only
what is new, so any piece lost on the way (a coalescing stream that keeps only the newest output, a sample
left out of a delta, prompt logprobs sent twice) would silently corrupt text, usage or logprob offsets.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from server_support import make_engine

from kvserve.engine.async_engine import RequestStream
from kvserve.engine.core_outputs import EngineCoreOutput, SequenceDelta
from kvserve.engine.llm import LLM
from kvserve.engine.output_processor import RequestState
from kvserve.engine.stats import RequestMetrics
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import RequestOutputKind, SamplingParams
from kvserve.server.tracker import DeltaTracker

PROMPT = [2, 40, 41, 42, 43, 44, 45]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return make_engine(tiny_model_dir)


def _params(kind: RequestOutputKind, **kw: Any) -> SamplingParams:
    base: dict[str, Any] = {
        "n": 2,
        "max_tokens": 12,
        "temperature": 0.8,
        "seed": 7,
        "logprobs": 2,
        "prompt_logprobs": 1,
        "ignore_eos": True,
    }
    base.update(kw)
    return SamplingParams(output_kind=kind, **base)


def _run(engine, rid: str, params: SamplingParams) -> list[RequestOutput]:
    engine.add_request(rid, PROMPT, params)
    outputs: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        outputs.extend(o for o in engine.step() if o.request_id == rid)
    return outputs


def _accumulate(outputs: list[RequestOutput]) -> RequestOutput:
    tracker = DeltaTracker(list(PROMPT))
    for output in outputs:
        tracker.add(output)
    return tracker.result()


def _same(a: CompletionOutput, b: CompletionOutput) -> None:
    assert (a.index, a.text, list(a.token_ids), a.finish_reason, a.stop_reason) == (
        b.index,
        b.text,
        list(b.token_ids),
        b.finish_reason,
        b.stop_reason,
    )
    assert [{t: lp.logprob for t, lp in e.items()} for e in a.logprobs or []] == [
        {t: lp.logprob for t, lp in e.items()} for e in b.logprobs or []
    ]
    assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob)


@pytest.mark.parametrize("extra", [{}, {"stop": ["e", "xy"], "include_stop_str_in_output": True}])
def test_deltas_add_up_to_the_cumulative_output(engine, extra):
    cumulative = _run(engine, "c", _params(RequestOutputKind.CUMULATIVE, **extra))
    deltas = _run(engine, "d", _params(RequestOutputKind.DELTA, **extra))
    assert len(deltas) == len(cumulative) and deltas[-1].finished
    whole = _accumulate(deltas)
    for a, b in zip(whole.outputs, cumulative[-1].outputs, strict=True):
        _same(a, b)
    # each token arrives exactly once, and the prompt's logprobs once, in the first output
    assert sum(len(c.token_ids) for o in deltas for c in o.outputs) == sum(len(c.token_ids) for c in whole.outputs)
    assert deltas[0].prompt_logprobs is not None and all(o.prompt_logprobs is None for o in deltas[1:])
    assert whole.prompt_logprobs == cumulative[-1].prompt_logprobs
    # a sample that finished is not repeated in later deltas
    for index in (0, 1):
        finishes = [c for o in deltas for c in o.outputs if c.index == index and c.finish_reason is not None]
        assert len(finishes) == 1


def test_final_only_gives_one_output(engine):
    cumulative = _run(engine, "c", _params(RequestOutputKind.CUMULATIVE))
    final = _run(engine, "f", _params(RequestOutputKind.FINAL_ONLY))
    assert len(final) == 1 and final[0].finished
    for a, b in zip(final[0].outputs, cumulative[-1].outputs, strict=True):
        _same(a, b)


def test_llm_generate_asks_for_final_outputs_only(engine):
    seen: list[RequestOutputKind] = []
    original = engine.add_request

    def spy(rid: str, prompt: Any, params: SamplingParams, **kw: Any) -> None:
        seen.append(params.output_kind)
        original(rid, prompt, params, **kw)

    engine.add_request = spy
    try:
        params = SamplingParams(max_tokens=3, temperature=0)
        (out,) = LLM(engine=engine).generate([PROMPT], params, use_tqdm=False)
    finally:
        del engine.add_request
    assert seen == [RequestOutputKind.FINAL_ONLY] and params.output_kind is RequestOutputKind.CUMULATIVE
    assert out.finished and len(out.outputs[0].token_ids) == 3


def test_abort_hands_out_the_rest_as_a_delta(engine):
    params = _params(RequestOutputKind.DELTA, max_tokens=50)
    engine.add_request("a", PROMPT, params)
    first = [o for o in engine.step() if o.request_id == "a"]
    aborted = engine.abort_request("a")
    assert aborted is not None and aborted.finished
    assert [c.finish_reason for c in aborted.outputs] == ["abort", "abort"]
    assert all(not c.token_ids for c in aborted.outputs)  # nothing handed out twice
    whole = _accumulate(first + [aborted])
    assert all(len(c.token_ids) == len(first[0].outputs[0].token_ids) for c in whole.outputs)


def _delta(text: str, ids: list[int], finished: bool = False, index: int = 0, prompt_lp: Any = None) -> RequestOutput:
    c = CompletionOutput(index, text, ids, None, None, "length" if finished else None)
    return RequestOutput("r", None, [2], prompt_lp, [c], finished)


def _core(ids: list[int], finished: bool = False, prompt_lp: Any = None) -> EngineCoreOutput:
    """A core output of request "r": sample 0's new token ids (its finish when `finished`)."""
    delta = SequenceDelta(0, ids, None, "length" if finished else None, None)
    return EngineCoreOutput("r", [delta], finished, 0, RequestMetrics(0.0, None, None, None, 0), prompt_lp)


def _fill(stream: RequestStream, items: list[Any]) -> None:
    for item in items:
        stream._queue.put_nowait(item)


def _drain(engine: Any, kind: RequestOutputKind, items: list[Any]) -> tuple[list[RequestOutput], BaseException | None]:
    async def go() -> tuple[list[RequestOutput], BaseException | None]:
        state = RequestState(engine.tokenizer, "r", None, [2], SamplingParams(output_kind=kind, max_tokens=9))
        stream = RequestStream(state, asyncio.get_running_loop(), lambda rid: None, lambda rid, index: None)
        _fill(stream, items)  # everything is queued before the consumer looks: it has fallen behind
        got: list[RequestOutput] = []
        try:
            async for output in stream:
                got.append(output)
        except RuntimeError as e:
            return got, e
        return got, None

    return asyncio.run(go())


def test_a_stream_that_falls_behind_merges_deltas_instead_of_dropping_them(engine):
    items = [_core([40, 41], prompt_lp=[None]), _core([42]), _core([43]), _core([44], True)]
    got, error = _drain(engine, RequestOutputKind.DELTA, items)
    assert error is None and len(got) == 1 and got[0].finished
    (c,) = got[0].outputs
    text = engine.tokenizer.decode([40, 41, 42, 43, 44])
    assert (c.text, c.token_ids, c.finish_reason) == (text, [40, 41, 42, 43, 44], "length") and text
    assert got[0].prompt_logprobs == [None]


def test_a_cumulative_stream_that_falls_behind_keeps_the_newest(engine):
    got, _ = _drain(engine, RequestOutputKind.CUMULATIVE, [_core([40]), _core([41], True)])
    assert len(got) == 1 and got[0].outputs[0].text == engine.tokenizer.decode([40, 41])


def test_an_error_behind_queued_deltas_comes_after_them(engine):
    got, error = _drain(engine, RequestOutputKind.DELTA, [_core([40]), _core([41]), RuntimeError("engine fault")])
    texts = [c.text for o in got for c in o.outputs]
    assert texts == [engine.tokenizer.decode([40, 41])] and str(error) == "engine fault"


def test_tracker_reports_where_each_piece_starts():
    tracker = DeltaTracker([2, 3])
    first = tracker.add(_delta("ab", [1, 2]))
    second = tracker.add(_delta("c", [3], True))
    assert [(d.first_token, d.first_char, d.is_first) for d in first + second] == [(0, 0, True), (2, 2, False)]
    assert tracker.finished and tracker.num_generated_tokens == 3 and tracker.generated(0) == [1, 2, 3]
    assert tracker.result().outputs[0].text == "abc"


def test_streamed_logprobs_equal_non_streamed(http):
    """The tracker's offsets: a stream's logprob pieces, put together, are the non-streamed logprobs."""
    body = {
        "prompt": "hello there",
        "max_tokens": 10,
        "temperature": 0,
        "logprobs": 2,
        "echo": True,
        "n": 2,
        "ignore_eos": True,
        "seed": 1,
    }
    whole = http.post("/v1/completions", json=body).json()["choices"]
    pieces: dict[int, dict[str, list]] = {}
    texts: dict[int, str] = {}
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data: ") :])["choices"]:
                texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
                into = pieces.setdefault(choice["index"], {"tokens": [], "text_offset": [], "token_logprobs": []})
                for key in into:
                    into[key] += choice["logprobs"][key]
    for choice in whole:
        i = choice["index"]
        assert texts[i] == choice["text"]
        for key in ("tokens", "text_offset"):
            assert pieces[i][key] == choice["logprobs"][key]
        streamed, expected = pieces[i]["token_logprobs"], choice["logprobs"]["token_logprobs"]
        assert [v is None for v in streamed] == [v is None for v in expected]
        assert [v for v in streamed if v is not None] == pytest.approx([v for v in expected if v is not None], abs=1e-4)
