"""Hand-written bad input: each case gets a 4xx with OpenAI's error body, no 5xx, no crash, and the server
answers the next request. (test_fuzz.py covers what a generator finds from the OpenAPI schema.)"""

from __future__ import annotations

import json
from typing import Any

import pytest
from reliability_support import assert_openai_error, assert_serving, leaked_blocks

CMPL, CHAT, TOK, DETOK = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
USER = [{"role": "user", "content": "hi"}]
JSON = {"content-type": "application/json"}

# (id, path, JSON body or raw bytes, the status expected; None: any 4xx)
CASES: list[tuple[str, str, Any, int | None]] = [
    ("invalid json", CMPL, b'{"prompt": "x",', 400),
    ("json not an object", CMPL, b"[1, 2, 3]", 400),
    ("empty body", CMPL, b"", 400),
    ("invalid utf-8", CMPL, b'{"prompt": "\xff\xfe\xfd"}', 400),
    ("invalid utf-8 chat", CHAT, b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}', 400),
    ("prompt wrong type", CMPL, {"prompt": {"a": 1}}, 400),
    ("max_tokens wrong type", CMPL, {"prompt": "x", "max_tokens": "many"}, 400),
    ("n wrong type", CMPL, {"prompt": "x", "n": [1]}, 400),
    ("messages wrong type", CHAT, {"messages": "hi"}, 400),
    ("empty prompt list", CMPL, {"prompt": []}, 400),
    ("empty token list", CMPL, {"prompt": [[]]}, 400),
    ("empty messages", CHAT, {"messages": []}, 400),
    ("message without role", CHAT, {"messages": [{"content": "x"}]}, 400),
    ("unknown role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("unknown role tokenize", TOK, {"messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("image content part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400),
    ("max_tokens huge", CMPL, {"prompt": "x", "max_tokens": 10**30}, 400),
    ("max_tokens negative", CMPL, {"prompt": "x", "max_tokens": -5}, 400),
    ("chat max_tokens negative", CHAT, {"messages": USER, "max_tokens": -1}, 400),
    ("chat max_tokens zero", CHAT, {"messages": USER, "max_tokens": 0}, 400),
    ("temperature negative", CMPL, {"prompt": "x", "temperature": -0.5}, 400),
    ("temperature NaN", CMPL, b'{"prompt": "x", "temperature": NaN}', 400),
    ("top_p zero", CMPL, {"prompt": "x", "top_p": 0}, 400),
    ("top_p over one", CHAT, {"messages": USER, "top_p": 1.5}, 400),
    ("top_k below -1", CMPL, {"prompt": "x", "top_k": -7}, 400),
    ("n zero", CMPL, {"prompt": "x", "n": 0}, 400),
    ("n huge", CMPL, {"prompt": "x", "n": 10**6}, 400),
    ("chat n huge", CHAT, {"messages": USER, "n": 100000}, 400),
    ("logprobs 1000", CMPL, {"prompt": "x", "logprobs": 1000}, 400),
    ("top_logprobs 1000", CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 1000}, 400),
    ("token id out of vocabulary", CMPL, {"prompt": [5, 256]}, 400),
    ("token id negative", CMPL, {"prompt": [-1]}, 400),
    ("token id over 64 bits", CMPL, {"prompt": [2**70]}, 400),
    ("detokenize out of vocabulary", DETOK, {"tokens": [10**9]}, 400),
    ("stop_token_ids out of vocabulary", CMPL, {"prompt": "x", "stop_token_ids": [2**70]}, 400),
    ("empty stop string", CMPL, {"prompt": "x", "stop": [""]}, 400),
    ("seed over 64 bits", CMPL, {"prompt": "x", "seed": 2**70}, 400),
    ("seed over 64 bits streaming", CMPL, {"prompt": "x", "seed": 2**70, "stream": True}, 400),
    ("seed + n over 64 bits", CMPL, {"prompt": "x", "seed": 2**64 - 1, "n": 2}, 400),
    ("min_tokens over max_tokens", CMPL, {"prompt": "x", "min_tokens": 9, "max_tokens": 2}, 400),
    ("presence_penalty out of range", CMPL, {"prompt": "x", "presence_penalty": 5}, 400),
    ("logit_bias", CMPL, {"prompt": "x", "logit_bias": {"5": 1}}, 400),
    ("tools", CHAT, {"messages": USER, "tools": [{"type": "function"}]}, 400),
    ("request chat_template", CHAT, {"messages": USER, "chat_template": "{{ ''.__class__ }}"}, 400),
    ("tokenize neither", TOK, {}, 400),
    ("unknown model", CMPL, {"prompt": "x", "model": "gpt-5"}, 404),
]


def _post(client, path: str, body: Any):
    if isinstance(body, bytes):
        return client.post(path, content=body, headers=JSON)
    return client.post(path, json=body)


@pytest.mark.parametrize("path,body,status", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_a_clean_4xx(guarded_server, auth, path, body, status):
    with guarded_server.client(headers=auth) as c:
        assert_openai_error(_post(c, path, body), status)
    assert_serving(guarded_server, auth)


def test_empty_prompts(guarded_server, auth):
    """An empty token list is a 400; an empty string is BOS alone for a model that wants BOS, which is a
    valid (unconditional) prompt, as in vLLM and OpenAI's API."""
    with guarded_server.client(headers=auth) as c:
        assert_openai_error(c.post(CMPL, json={"prompt": [[]]}), 400)
        r = c.post(CMPL, json={"prompt": "", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 1, r.text


def test_prompt_of_max_model_len_plus_one_tokens(guarded_server, auth):
    limit = guarded_server.engine.core.max_model_len
    with guarded_server.client(headers=auth) as c:
        # the char tokenizer adds BOS: limit characters are limit + 1 tokens
        err = assert_openai_error(c.post(CMPL, json={"prompt": "x" * limit}), 400)
        assert str(limit + 1) in err["message"] and str(limit) in err["message"]
        ids = [5] * (limit + 1)
        err = assert_openai_error(c.post(CMPL, json={"prompt": ids}), 400)
        assert str(limit + 1) in err["message"]
        ok = c.post(CMPL, json={"prompt": [5] * (limit - 1), "max_tokens": 1})
        assert ok.status_code == 200, ok.text


def test_ten_megabyte_body_is_413(guarded_server, auth):
    body = json.dumps({"prompt": "x" * 10_000_000}).encode()
    with guarded_server.client(headers=auth) as c:
        err = assert_openai_error(c.post(CMPL, content=body, headers=JSON), 413)
        assert "--max-request-body-bytes" in err["message"]
    assert_serving(guarded_server, auth)


def test_megabyte_prompt_is_refused_before_tokenizing(guarded_server, auth):
    """A prompt under the body limit but far beyond what max-model-len holds is refused from its length
    alone (tokenizing it would hold the event loop for seconds)."""
    with guarded_server.client(headers=auth, timeout=5) as c:
        err = assert_openai_error(c.post(CMPL, json={"prompt": "y" * 4_000_000}), 400)
        assert "characters" in err["message"]
        assert_openai_error(c.post(CHAT, json={"messages": [{"role": "user", "content": "y" * 4_000_000}]}), 400)
        assert_openai_error(c.post(TOK, json={"prompt": "y" * 4_000_000}), 400)


def test_bad_input_leaves_the_pool_whole(guarded_server, auth):
    with guarded_server.client(headers=auth) as c:
        for _, path, body, _ in CASES:
            _post(c, path, body)
    assert leaked_blocks(guarded_server) == 0
