"""The real `openai` SDK (sync and async, streaming and not) against a real uvicorn server on a tiny model."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
import torch
from server_support import API_KEY, MODEL

GREEDY = {"ignore_eos": True}  # extra_body: random tiny models would otherwise stop at random


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=30)


@pytest.fixture
def aclient(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=30)


def test_models_lists_served_names(client, server):
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert ids == [MODEL, "tiny-alias"]
    card = models.data[0].model_dump()
    assert card["object"] == "model" and card["owned_by"] == "kvserve" and card["root"]
    assert card["max_model_len"] == server.engine.core.max_model_len


def test_completion_basic_usage_and_model_alias(client):
    r = client.completions.create(
        model="tiny-alias", prompt="Hello there", max_tokens=5, temperature=0, extra_body=GREEDY
    )
    assert r.object == "text_completion" and r.model == "tiny-alias"
    (choice,) = r.choices
    assert choice.finish_reason == "length" and choice.text
    assert r.usage.prompt_tokens == len("Hello there") + 1  # char tokenizer + BOS
    assert r.usage.completion_tokens == 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_model_field_may_be_omitted(server, http):
    r = http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == MODEL


def test_default_max_tokens_is_16(client):
    r = client.completions.create(model=MODEL, prompt="abc", extra_body=GREEDY)
    assert r.usage.completion_tokens == 16


def test_greedy_stream_equals_non_stream(client):
    kw = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0, "extra_body": GREEDY}
    full = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-1].choices[0].finish_reason == "length"


def test_prompt_list_and_n_give_indexed_choices(client):
    r = client.completions.create(
        model=MODEL, prompt=["ab", "cd"], n=2, max_tokens=3, temperature=1.0, seed=7, extra_body=GREEDY
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.prompt_tokens == 3 + 3 and r.usage.completion_tokens == 4 * 3


def test_token_id_prompts(client):
    r = client.completions.create(
        model=MODEL, prompt=[[2, 40, 41, 42], [2, 50]], max_tokens=2, temperature=0, extra_body=GREEDY
    )
    assert len(r.choices) == 2 and r.usage.prompt_tokens == 6
    single = client.completions.create(
        model=MODEL, prompt=[2, 40, 41, 42], max_tokens=2, temperature=0, extra_body=GREEDY
    )
    assert single.choices[0].text == r.choices[0].text


def test_streaming_prompts_and_n_with_usage(client):
    stream = client.completions.create(
        model=MODEL,
        prompt=["ab", "cd"],
        n=2,
        max_tokens=4,
        stream=True,
        seed=1,
        stream_options={"include_usage": True},
        extra_body=GREEDY,
    )
    texts: dict[int, str] = {}
    finished: set[int] = set()
    chunks = list(stream)
    for chunk in chunks[:-1]:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1, 2, 3} and all(texts[i] for i in range(4))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16


def _hf_prompt_logprobs(model_dir, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).float().eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_lm_eval_loglikelihood_request(client, tiny_model_dir, max_tokens):
    """lm-evaluation-harness local-completions: token-id prompts, echo, logprobs=1, max_tokens 0 or 1."""
    ids = [2, 60, 70, 80, 90, 61, 71]
    r = client.completions.create(
        model=MODEL, prompt=[ids], echo=True, max_tokens=max_tokens, logprobs=1, temperature=0, seed=1234
    )
    (choice,) = r.choices
    lp = choice.logprobs
    n = len(ids) + max_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert r.usage.completion_tokens == max_tokens
    ref = _hf_prompt_logprobs(tiny_model_dir, ids)
    for pos in range(1, len(ids)):
        assert lp.token_logprobs[pos] == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=1e-3)
        # the argmax is always among top_logprobs, so lm-eval's is_greedy check works
        assert max(lp.top_logprobs[pos].values()) == pytest.approx(ref[pos - 1].max().item(), abs=1e-3)
        assert lp.token_logprobs[pos] <= max(lp.top_logprobs[pos].values())
    if max_tokens == 0:
        assert choice.text == "".join(lp.tokens[1:]) and choice.finish_reason == "length"
    else:  # greedy: the generated token is the argmax (lm-eval's `is_greedy` on the last position)
        assert lp.token_logprobs[-1] == max(lp.top_logprobs[-1].values())
    assert lp.text_offset == sorted(lp.text_offset)


def test_string_prompt_echo_text_offsets(client):
    r = client.completions.create(
        model=MODEL, prompt="abc", echo=True, max_tokens=3, logprobs=2, temperature=0, extra_body=GREEDY
    )
    (choice,) = r.choices
    lp = choice.logprobs
    assert choice.text.startswith("abc")
    # BOS (special, skipped in the text) takes no characters; then one character per token
    assert lp.tokens[:4] == ["<bos>", "a", "b", "c"]
    assert lp.text_offset == [0, 0, 1, 2, 3, 4, 5]
    assert all(len(top) >= 2 for top in lp.top_logprobs[1:])


def test_chat_non_streaming(client):
    r = client.chat.completions.create(
        model=MODEL,
        max_completion_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]},
        ],
        extra_body=GREEDY,
    )
    assert r.object == "chat.completion"
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert len(choice.logprobs.content) == 6
    first = choice.logprobs.content[0]
    assert len(first.top_logprobs) == 3 and first.bytes == list(first.token.encode())
    assert first.logprob == max(t.logprob for t in first.top_logprobs)  # greedy picks the argmax
    prompt = "<system>be brief\n<user>hi\nthere\n<assistant>"
    assert r.usage.prompt_tokens == len(prompt) + 1 and r.usage.completion_tokens == 6


def test_chat_streaming_order_raw_frames(http):
    """Role chunk first (after prefill), content deltas, finish, usage chunk with empty choices, [DONE];
    plain `data:` frames only."""
    body = {
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0,
    }
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    frames = raw.split("\n\n")
    assert frames[-1] == "" and frames[-2] == "data: [DONE]"
    assert all(f.startswith("data: ") for f in frames[:-1])
    chunks = [json.loads(f[len("data: ") :]) for f in frames[:-2]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[0]["object"] == "chat.completion.chunk"
    content = [c for c in chunks[1:-1]]
    assert all(c["choices"][0]["delta"].get("role") is None for c in content)
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in content)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert all("usage" not in c for c in chunks[:-1])


def test_chat_streaming_sdk_matches_non_streaming(client):
    kw = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "abc"}],
        "max_tokens": 8,
        "temperature": 0,
        "extra_body": GREEDY,
    }
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full


def test_async_client_concurrent_requests(aclient):
    async def run() -> None:
        completions = [
            aclient.completions.create(model=MODEL, prompt=f"p{i}", max_tokens=4, extra_body=GREEDY) for i in range(4)
        ]
        chats = [
            aclient.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"q{i}"}], max_tokens=4, extra_body=GREEDY
            )
            for i in range(2)
        ]
        results = await asyncio.gather(*completions, *chats)
        assert all(r.usage.completion_tokens == 4 for r in results)

        stream = await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "s"}], max_tokens=4, stream=True, extra_body=GREEDY
        )
        pieces = [chunk async for chunk in stream]
        assert pieces[0].choices[0].delta.role == "assistant"
        assert pieces[-1].choices[0].finish_reason == "length"
        await aclient.close()

    asyncio.run(run())


def test_prefix_cache_hit_reported_as_cached_tokens(client):
    prompt = "a shared prefix that spans several blocks"
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body=GREEDY)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body=GREEDY)
    assert again.usage.prompt_tokens_details.cached_tokens >= 4 * ((len(prompt) + 1) // 4 - 1)


def test_stop_string_and_stop_reason(client):
    first = client.completions.create(model=MODEL, prompt="xyz", max_tokens=8, temperature=0, extra_body=GREEDY)
    text = first.choices[0].text
    stop = text[2:4]
    r = client.completions.create(
        model=MODEL, prompt="xyz", max_tokens=8, temperature=0, stop=[stop], extra_body=GREEDY
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.index(stop)]
    assert r.choices[0].model_dump()["stop_reason"] == stop


def test_tokenize_detokenize_version(http):
    r = http.post("/tokenize", json={"prompt": "abc"})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"][1:] == [ord("a") - 27, ord("b") - 27, ord("c") - 27] and body["count"] == 4
    assert body["max_model_len"] > 0
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "x"}]}).json()
    assert chat["count"] == len("<user>x\n<assistant>") + 1
    assert http.post("/detokenize", json={"tokens": body["tokens"]}).json() == {"prompt": "<bos>abc"}
    assert http.get("/version").json()["version"]


def test_chat_n_streaming_gives_each_choice_a_role_and_a_finish(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "n"}],
            n=2,
            max_tokens=3,
            stream=True,
            seed=3,
            extra_body=GREEDY,
        )
    )
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    finishes = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason == "length"]
    assert sorted(roles) == [0, 1] and sorted(finishes) == [0, 1]
    assert chunks.index(next(c for c in chunks if c.choices[0].finish_reason)) > 1  # roles come first
