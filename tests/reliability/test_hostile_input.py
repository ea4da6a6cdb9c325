"""Hostile request bodies: text that is not UTF-8 (lone surrogates, which JSON's \\ud800 escape can carry),
loosely typed values, an empty cache_salt, and one request that asks for more work than the shared queue
holds. Each gets a clean 4xx (or a 503 for a full queue) naming the field, on a connection that stays
open, and the server goes on serving."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest
from reliability_support import assert_openai_error, assert_serving, leaked_blocks
from server_support import wait_until

CMPL, CHAT, TOK = "/v1/completions", "/v1/chat/completions", "/tokenize"
JSON = {"content-type": "application/json"}
LONE = "\\ud800"  # the JSON escape of a lone (high) surrogate, as a client sends it on the wire
LOW = "\\udfff"

# (id, path, raw JSON body, the field the error must name). Raw: json.dumps cannot encode a lone surrogate.
SURROGATES: list[tuple[str, str, str, str]] = [
    ("prompt", CMPL, f'{{"prompt": "hi {LONE}"}}', "prompt"),
    ("prompt list", CMPL, f'{{"prompt": ["ok", "{LOW}"]}}', "prompt"),
    ("stop string", CMPL, f'{{"prompt": "x", "stop": "{LONE}"}}', "stop"),
    ("stop list", CMPL, f'{{"prompt": "x", "stop": ["a", "{LONE}"]}}', "stop"),
    ("cache_salt", CMPL, f'{{"prompt": "x", "cache_salt": "{LONE}"}}', "cache_salt"),
    ("user", CMPL, f'{{"prompt": "x", "user": "{LONE}"}}', "user"),
    ("unknown field", CMPL, f'{{"prompt": "x", "metadata": {{"k": ["{LONE}"]}}}}', "metadata"),
    ("chat content", CHAT, f'{{"messages": [{{"role": "user", "content": "{LONE}"}}]}}', "messages"),
    (
        "chat content part",
        CHAT,
        f'{{"messages": [{{"role": "user", "content": [{{"type": "text", "text": "{LONE}"}}]}}]}}',
        "messages",
    ),
    ("chat role", CHAT, f'{{"messages": [{{"role": "us{LONE}er", "content": "x"}}]}}', "messages"),
    ("chat stop", CHAT, f'{{"messages": [{{"role": "user", "content": "x"}}], "stop": ["{LONE}"]}}', "stop"),
    (
        "chat cache_salt",
        CHAT,
        f'{{"messages": [{{"role": "user", "content": "x"}}], "cache_salt": "{LONE}"}}',
        "cache_salt",
    ),
    ("tokenize prompt", TOK, f'{{"prompt": "{LONE}"}}', "prompt"),
    ("tokenize messages", TOK, f'{{"messages": [{{"role": "user", "content": "{LONE}"}}]}}', "messages"),
]


@pytest.mark.parametrize("path,body,field", [c[1:] for c in SURROGATES], ids=[c[0] for c in SURROGATES])
def test_lone_surrogates_are_a_400_naming_the_field(guarded_server, auth, path, body, field):
    with guarded_server.client(headers=auth) as c:
        r = c.post(path, content=body.encode(), headers=JSON)
        error = assert_openai_error(r, 400)
        assert error["param"] is not None and error["param"].startswith(field), error
        assert "UTF-8" in error["message"] or "unicode" in error["message"], error
        assert r.headers.get("connection", "").lower() != "close"  # the keep-alive connection stays up
        ok = c.post(CMPL, json={"prompt": "still here", "max_tokens": 2})  # on the same connection
        assert ok.status_code == 200, ok.text


def test_paired_surrogates_are_fine(guarded_server, auth):
    """A JSON surrogate pair is one character (here U+1F600), valid UTF-8: not refused."""
    body = '{"prompt": "smile \\ud83d\\ude00", "max_tokens": 2, "stop": ["\\ud83d\\ude00"]}'
    with guarded_server.client(headers=auth) as c:
        r = c.post(CMPL, content=body.encode(), headers=JSON)
        assert r.status_code == 200, r.text


# (id, path, raw JSON body, the field). Raw: Python's json writes inf as Infinity but never 1e39 for a float, and
# a client need not be Python. Each once killed the engine for everyone (NaN logits, then an id past the vocabulary):
# 1e39 is finite in float64 and infinite in float32, where the sampler computes.
NON_FINITE: list[tuple[str, str, str, str]] = [
    (
        "temperature Infinity",
        CMPL,
        '{"prompt": "x", "temperature": Infinity, "min_tokens": 1, "max_tokens": 2}',
        "temperature",
    ),
    ("temperature 1e39", CMPL, '{"prompt": "x", "temperature": 1e39, "min_tokens": 1, "max_tokens": 2}', "temperature"),
    ("temperature NaN", CMPL, '{"prompt": "x", "temperature": NaN, "max_tokens": 2}', "temperature"),
    ("top_p -Infinity", CMPL, '{"prompt": "x", "top_p": -Infinity, "max_tokens": 2}', "top_p"),
    ("presence_penalty 1e39", CMPL, '{"prompt": "x", "presence_penalty": 1e39, "max_tokens": 2}', "presence_penalty"),
    (
        "chat temperature 1e39",
        CHAT,
        '{"messages": [{"role": "user", "content": "x"}], "temperature": 1e39, "min_tokens": 1, "max_tokens": 2}',
        "temperature",
    ),
    (
        "chat temperature Infinity",
        CHAT,
        '{"messages": [{"role": "user", "content": "x"}], "temperature": Infinity, "max_tokens": 1}',
        "temperature",
    ),
]


@pytest.mark.parametrize("path,body,field", [c[1:] for c in NON_FINITE], ids=[c[0] for c in NON_FINITE])
def test_non_finite_numbers_are_a_400_and_the_engine_lives(guarded_server, auth, path, body, field):
    with guarded_server.client(headers=auth) as c:
        error = assert_openai_error(c.post(path, content=body.encode(), headers=JSON), 400)
        assert error["param"] == field, error
        assert field in error["message"], error
        assert c.get("/health").status_code == 200
    assert_serving(guarded_server, auth)


# (id, path, body, the field) -- OpenAI's API types: integers are JSON integers, booleans true/false.
LOOSE_TYPES: list[tuple[str, str, dict[str, Any], str]] = [
    ("max_tokens string", CMPL, {"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ("max_tokens true", CMPL, {"prompt": "x", "max_tokens": True}, "max_tokens"),
    ("max_tokens float", CMPL, {"prompt": "x", "max_tokens": 5.0}, "max_tokens"),
    ("n string", CMPL, {"prompt": "x", "n": "2"}, "n"),
    ("seed true", CMPL, {"prompt": "x", "seed": True}, "seed"),
    ("logprobs true", CMPL, {"prompt": "x", "logprobs": True}, "logprobs"),
    ("temperature string", CMPL, {"prompt": "x", "temperature": "0.5"}, "temperature"),
    ("top_p true", CMPL, {"prompt": "x", "top_p": True}, "top_p"),
    ("stream string", CMPL, {"prompt": "x", "stream": "true"}, "stream"),
    ("echo 1", CMPL, {"prompt": "x", "echo": 1}, "echo"),
    ("token ids as booleans", CMPL, {"prompt": [True, False]}, "prompt"),
    ("stop_token_ids strings", CMPL, {"prompt": "x", "stop_token_ids": ["5"]}, "stop_token_ids"),
    (
        "include_usage 1",
        CMPL,
        {"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}},
        "stream_options",
    ),
    ("chat max_tokens string", CHAT, {"messages": [{"role": "user", "content": "x"}], "max_tokens": "5"}, "max_tokens"),
    ("chat logprobs 1", CHAT, {"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs"),
    ("chat content number", CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages"),
    ("tokenize add_special_tokens 0", TOK, {"prompt": "x", "add_special_tokens": 0}, "add_special_tokens"),
]


@pytest.mark.parametrize("path,body,field", [c[1:] for c in LOOSE_TYPES], ids=[c[0] for c in LOOSE_TYPES])
def test_loose_types_are_a_400_naming_the_field(guarded_server, auth, path, body, field):
    with guarded_server.client(headers=auth) as c:
        error = assert_openai_error(c.post(path, json=body), 400)
        assert error["param"] is not None and error["param"].startswith(field), error


def test_numbers_take_integers_as_openai_does(guarded_server, auth):
    """A float field takes a JSON integer (temperature 1, top_p 1), as OpenAI's API and its SDK send them."""
    body = {
        "prompt": "x",
        "max_tokens": 2,
        "temperature": 1,
        "top_p": 1,
        "presence_penalty": 0,
        "logit_bias": None,
        "stream": False,
        "echo": False,
        "seed": 3,
    }
    with guarded_server.client(headers=auth) as c:
        r = c.post(CMPL, json=body)
        assert r.status_code == 200, r.text


def test_empty_cache_salt_is_a_400(guarded_server, auth):
    with guarded_server.client(headers=auth) as c:
        error = assert_openai_error(c.post(CMPL, json={"prompt": "x", "cache_salt": ""}), 400)
        assert error["param"] == "cache_salt"
        error = assert_openai_error(
            c.post(CHAT, json={"messages": [{"role": "user", "content": "x"}], "cache_salt": ""}), 400
        )
        assert error["param"] == "cache_salt"
        assert c.post(CMPL, json={"prompt": "x", "cache_salt": "t", "max_tokens": 2}).status_code == 200


def test_an_oversized_cache_salt_is_a_400(guarded_server, auth):
    """Bounded as prompt_cache_key is (1,024 characters): a 7 MiB salt once held memory per block and stalled the
    engine for seconds. The bound itself is accepted, on every generating route."""
    long = "s" * 1025
    bodies = [
        (CMPL, {"prompt": "x", "max_tokens": 1}),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
        ("/v1/messages", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
    ]
    with guarded_server.client(headers=auth) as c:
        for path, body in bodies:
            r = c.post(path, json=body | {"cache_salt": long})
            assert r.status_code == 400, r.text
            assert "1,025 characters; at most 1,024" in r.text and "cache_salt" in r.text, r.text
            assert c.post(path, json=body | {"cache_salt": long[:-1]}).status_code == 200


def test_hostile_input_leaves_the_pool_whole(guarded_server, auth):
    with guarded_server.client(headers=auth) as c:
        for _, path, body, _ in SURROGATES:
            c.post(path, content=body.encode(), headers=JSON)
        for _, path, body, _ in NON_FINITE:
            c.post(path, content=body.encode(), headers=JSON)
        for _, path, body, _ in LOOSE_TYPES:
            c.post(path, json=body)
    assert leaked_blocks(guarded_server) == 0
    assert_serving(guarded_server, auth)


# ---- one request must not fill the queue that every client shares -----------------------------------


def test_too_many_prompts_is_a_400(make_configured_server):
    server = make_configured_server(max_prompts_per_request=4)
    with server.client() as c:
        error = assert_openai_error(c.post(CMPL, json={"prompt": ["Hi"] * 5, "max_tokens": 1}), 400)
        assert error["param"] == "prompt" and "--max-prompts-per-request" in error["message"]
        error = assert_openai_error(c.post(CMPL, json={"prompt": [[5, 6]] * 5, "max_tokens": 1}), 400)
        assert error["param"] == "prompt"
        r = c.post(CMPL, json={"prompt": ["Hi"] * 4, "max_tokens": 1})
        assert r.status_code == 200 and len(r.json()["choices"]) == 4, r.text


def test_the_default_prompt_cap_refuses_the_reported_request(guarded_server, auth):
    """The request from the report: 999 prompts x n=8 would have queued 7,992 sequences."""
    with guarded_server.client(headers=auth) as c:
        error = assert_openai_error(c.post(CMPL, json={"prompt": ["Hi"] * 999, "n": 8}), 400)
        assert error["param"] == "prompt"
    assert leaked_blocks(guarded_server) == 0


def test_a_request_larger_than_the_queue_is_a_400(make_server):
    server = make_server(max_queued_requests=4)
    with server.client() as c:
        error = assert_openai_error(c.post(CMPL, json={"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 1}), 400)
        assert "--max-num-queued-reqs" in error["message"] and "6 sequences" in error["message"]
        r = c.post(CMPL, json={"prompt": ["a", "b"], "n": 2, "max_tokens": 1})  # 4 sequences: fits
        assert r.status_code == 200 and len(r.json()["choices"]) == 4, r.text


def test_queue_counts_sequences_and_refuses_a_request_whole(make_server):
    """With 3 sequences waiting (the engine held at its first step) and room for 4: a request of 2
    sequences is refused whole with 503 (none of it queued), and a request of 1 still fits."""
    entered, release = threading.Event(), threading.Event()

    def gate() -> None:
        entered.set()
        assert release.wait(30)

    server = make_server(before_step=gate, max_queued_requests=4)
    results: dict[str, httpx.Response] = {}

    def post(name: str, body: dict[str, Any]) -> None:
        with server.client() as c:
            results[name] = c.post(CMPL, json=body)

    first = threading.Thread(target=post, args=("first", {"prompt": "a", "n": 3, "max_tokens": 2}))
    first.start()
    last: threading.Thread | None = None
    try:
        assert entered.wait(10)
        with server.client() as c:
            error = assert_openai_error(c.post(CMPL, json={"prompt": ["b", "c"], "max_tokens": 2}), 503)
            assert error["code"] == "queue_full" and "3 sequences" in error["message"], error
            error = assert_openai_error(c.post(CMPL, json={"prompt": "d", "n": 2, "max_tokens": 2}), 503)
            assert error["code"] == "queue_full"
        assert server.engine.num_queued_seqs == 3  # nothing of the refused requests was queued
        last = threading.Thread(target=post, args=("last", {"prompt": "e", "max_tokens": 2}))
        last.start()  # 3 + 1 sequences: fits, and is queued while the engine is still held
        wait_until(lambda: server.engine.num_queued_seqs == 4 or "last" in results, timeout=10)
    finally:
        release.set()
        first.join(30)
        if last is not None:
            last.join(30)
    assert results["first"].status_code == 200 and len(results["first"].json()["choices"]) == 3
    assert results["last"].status_code == 200, results["last"].text
    assert leaked_blocks(server) == 0
