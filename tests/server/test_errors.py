"""Error statuses and OpenAI's error body, over raw HTTP: 400 (incl. FastAPI's 422), 401, 404, 503."""

from __future__ import annotations

import threading

import httpx
import pytest
from server_support import API_KEY, MODEL


def assert_error(response: httpx.Response, status: int, *words: str, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and isinstance(error["type"], str)
    for word in words:
        assert word in error["message"], error["message"]
    if param is not None:
        assert error["param"] == param
    return error


@pytest.mark.parametrize(
    "path,method",
    [
        ("/v1/completions", "POST"),
        ("/v1/chat/completions", "POST"),
        ("/v1/models", "GET"),
        ("/tokenize", "POST"),
        ("/detokenize", "POST"),
    ],
)
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}])
def test_api_key_required(server, path, method, headers):
    with server.client(headers=headers) as c:
        r = c.request(method, path, json={"prompt": "x"})
    assert_error(r, 401, "API key")


def test_open_endpoints_need_no_key(server):
    with server.client() as c:
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 200
        assert c.get("/version").status_code == 200


def test_unknown_model_is_404(http):
    err = assert_error(
        http.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"}), 404, "gpt-4", param="model"
    )
    assert err["code"] == "model_not_found"
    assert_error(
        http.post("/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]}), 404
    )


@pytest.mark.parametrize(
    "body,param",
    [
        ({}, "prompt"),  # missing field (FastAPI's 422)
        ({"prompt": "x", "temperature": "hot"}, "temperature"),  # wrong type (422)
        ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "x", "temperature": -1}, "temperature"),  # SamplingParams' own check
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),  # over --max-logprobs
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"prompt": []}, "prompt"),
        ({"prompt": "x", "n": 0}, "n"),
    ],
)
def test_bad_completion_requests_are_400(http, body, param):
    assert_error(http.post("/v1/completions", json={"model": MODEL, **body}), 400, param=param)


def test_malformed_json_is_400(http):
    r = http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert_error(r, 400)


def test_out_of_vocabulary_and_empty_token_prompts(http):
    assert_error(http.post("/v1/completions", json={"prompt": [5, 9999]}), 400, "9999", "vocabulary")
    assert_error(http.post("/v1/completions", json={"prompt": [[]]}), 400, "empty")


def test_prompt_over_max_model_len_names_both_numbers(http, server):
    limit = server.engine.core.max_model_len
    prompt = "x" * (limit + 10)
    assert_error(http.post("/v1/completions", json={"prompt": prompt}), 400, str(limit + 11), str(limit))


def test_max_tokens_that_cannot_fit(http, server):
    limit = server.engine.core.max_model_len
    err = assert_error(
        http.post("/v1/completions", json={"prompt": "abc", "max_tokens": limit}),
        400,
        str(limit),
        "4 in the prompt",
        param="max_tokens",
    )
    assert err["type"] == "invalid_request_error"


def test_chat_errors(http, server):
    user = [{"role": "user", "content": "x"}]
    assert_error(http.post("/v1/chat/completions", json={"messages": []}), 400, param="messages")
    assert_error(http.post("/v1/chat/completions", json={"messages": [{"content": "no role"}]}), 400)
    assert_error(
        http.post("/v1/chat/completions", json={"messages": user, "tools": [{"type": "function"}]}), 400, param="tools"
    )
    assert_error(
        http.post("/v1/chat/completions", json={"messages": user, "response_format": {"type": "xml"}}),
        400,
        param="response_format.type",
    )
    assert_error(http.post("/v1/chat/completions", json={"messages": user, "top_logprobs": 2}), 400)
    assert_error(
        http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
        400,
        "image_url",
    )
    long_chat = [{"role": "user", "content": "y" * server.engine.core.max_model_len}]
    assert_error(http.post("/v1/chat/completions", json={"messages": long_chat}), 400, "max-model-len")


def test_unknown_fields_are_ignored(http):
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "some_future_field": 3})
    assert r.status_code == 200, r.text


def test_unknown_route_is_openai_shaped_404(http):
    assert_error(http.get("/v1/nothing"), 404)


def test_queue_full_is_503(make_server):
    """With one request waiting (the engine held at its first step), the next one is refused."""
    entered, release = threading.Event(), threading.Event()

    def gate() -> None:
        entered.set()
        assert release.wait(30)

    srv = make_server(before_step=gate, max_queued_requests=1)
    results: dict[str, httpx.Response] = {}

    def first() -> None:
        with srv.client() as c:
            results["first"] = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})

    worker = threading.Thread(target=first)
    worker.start()
    try:
        assert entered.wait(10)
        with srv.client() as c:
            err = assert_error(
                c.post("/v1/completions", json={"prompt": "b", "max_tokens": 2}), 503, "--max-num-queued-reqs"
            )
            assert err["code"] == "queue_full"
    finally:
        release.set()
        worker.join(30)
    assert results["first"].status_code == 200


def test_chat_history_truncation(make_server):
    srv = make_server(chat_history_policy="truncate", max_model_len=64)
    system = {"role": "system", "content": "S"}
    turns = []
    for i in range(6):
        turns += [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]
    messages = [system, *turns, {"role": "user", "content": "last"}]
    with srv.client() as c:
        r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200, r.text
        dropped = int(r.headers["X-Kvserve-Truncated-Turns"])
        assert 0 < dropped <= 6
        assert r.json()["usage"]["prompt_tokens"] + 4 <= 64
        short = c.post(
            "/v1/chat/completions", json={"messages": [system, {"role": "user", "content": "q"}], "max_tokens": 2}
        )
        assert short.status_code == 200 and "X-Kvserve-Truncated-Turns" not in short.headers
        too_long = [system, {"role": "user", "content": "z" * 80}]
        assert_error(c.post("/v1/chat/completions", json={"messages": too_long}), 400)


def test_truncation_saves_a_history_longer_than_the_character_bound(make_server):
    """#43 item 9: the character pre-check (text longer than max-model-len x the longest vocabulary entry x 2 cannot
    fit) ran on the whole history before the truncation search, so a long chat was a 400 though its last turn fits."""
    srv = make_server(chat_history_policy="truncate", max_model_len=64)
    turns = []
    for i in range(30):  # about 1,500 characters; the bound here is 640
        turns += [{"role": "user", "content": f"question number {i}"}, {"role": "assistant", "content": f"answer {i}"}]
    messages = [{"role": "system", "content": "S"}, *turns, {"role": "user", "content": "last"}]
    with srv.client() as c:
        r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert 25 <= int(r.headers["X-Kvserve-Truncated-Turns"]) <= 30
        assert r.json()["usage"]["prompt_tokens"] + 4 <= 64
        too_long = [*messages[:-1], {"role": "user", "content": "z" * 1000}]  # the last turn alone cannot fit
        assert_error(c.post("/v1/chat/completions", json={"messages": too_long}), 400, "characters", param="messages")


def test_a_responses_chain_is_truncated_and_says_so(make_server):
    """#43 item 9: a previous_response_id chain died with a 400 once its history passed the character bound, and
    /v1/responses never returned X-Kvserve-Truncated-Turns."""
    srv = make_server(chat_history_policy="truncate", max_model_len=64)
    previous, dropped = None, []
    with srv.client() as c:
        for i in range(30):
            body = {"input": f"turn {i} of a long chain", "max_output_tokens": 4, "previous_response_id": previous}
            r = c.post("/v1/responses", json={k: v for k, v in body.items() if v is not None})
            assert r.status_code == 200, (i, r.text)
            previous = r.json()["id"]
            dropped.append(int(r.headers.get("X-Kvserve-Truncated-Turns", 0)))
        assert dropped[0] == 0 and dropped[-1] > 20
        body = {"input": "streamed", "max_output_tokens": 4, "previous_response_id": previous, "stream": True}
        with c.stream("POST", "/v1/responses", json=body) as streamed:
            assert streamed.status_code == 200
            assert int(streamed.headers["X-Kvserve-Truncated-Turns"]) > 20
            streamed.read()


def test_a_bug_is_a_500_on_a_connection_that_lives_on(make_server, monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception no handler knows (here: the import error a race once raised) is a 500 in OpenAI's shape, and
    the client's kept-alive connection serves the next request: Starlette's own handler re-raised it, and uvicorn
    then closed the connection, so the next request on it was reset."""
    from kvserve.server import app as app_module

    srv = make_server()

    async def broken(*_: object) -> None:
        raise ImportError("cannot import name 'PreTrainedTokenizerBase' from 'transformers'")

    real = app_module.create_completion
    monkeypatch.setattr(app_module, "create_completion", broken)
    with srv.client() as c:
        for _ in range(3):
            error = assert_error(c.post("/v1/completions", json={"prompt": "x"}), 500, "ImportError")
            assert error["type"] == "server_error"
        assert c.get("/health").status_code == 200
        monkeypatch.setattr(app_module, "create_completion", real)
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_a_bug_inside_a_started_response_ends_it_cleanly() -> None:
    """Raised after the response started: the body is ended (what was sent stays sent), and the connection serves
    the next request."""
    import asyncio

    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    from kvserve.server.errors import install_error_handlers

    app = FastAPI()
    install_error_handlers(app)

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def chunks():
            yield b"first "
            await asyncio.sleep(0)
            raise RuntimeError("a bug in the middle of a stream")

        return StreamingResponse(chunks())

    @app.get("/ok")
    async def ok() -> dict[str, bool]:
        return {"ok": True}

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive()
            threading.Event().wait(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
            for _ in range(2):
                r = c.get("/stream")
                assert r.status_code == 200 and r.content == b"first "
                assert c.get("/ok").json() == {"ok": True}
    finally:
        server.should_exit = True
        thread.join(10)


def test_the_server_serves_once_the_preparation_thread_has_its_imports(
    make_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chat-template renderer (transformers) is imported before the first request, not beside it: two threads
    importing transformers at once (this one and the first grammar compile's xgrammar import) failed."""
    from kvserve.server.prepare import PromptPreparer

    warmed = threading.Event()
    real = PromptPreparer.warm

    def slow_warm(self: PromptPreparer) -> None:
        threading.Event().wait(0.5)
        real(self)
        warmed.set()

    monkeypatch.setattr(PromptPreparer, "warm", slow_warm)
    make_server()
    assert warmed.is_set()


def test_x_api_key_is_accepted_as_anthropic_sends_it(server):
    """Anthropic's SDK sends the key as `x-api-key`: either header opens either API."""
    with server.client(headers={"x-api-key": API_KEY}) as c:
        assert c.get("/v1/models").status_code == 200
    with server.client(headers={"x-api-key": "wrong"}) as c:
        assert_error(c.get("/v1/models"), 401, "x-api-key")


def assert_anthropic_error(response: httpx.Response, status: int, kind: str, *words: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind
    for word in words:
        assert word in body["error"]["message"], body["error"]["message"]


def test_messages_api_errors_have_anthropics_shape(server, http):
    """/v1/messages speaks Anthropic's error shape, for errors of the middleware (the key), of validation (a missing
    field) and of the route (an unknown model)."""
    with server.client(headers={"x-api-key": "wrong"}) as c:
        assert_anthropic_error(c.post("/v1/messages", json={}), 401, "authentication_error", "API key")
    user = [{"role": "user", "content": "hi"}]
    assert_anthropic_error(
        http.post("/v1/messages", json={"messages": user}), 400, "invalid_request_error", "max_tokens"
    )
    body = {"model": "claude-nope", "max_tokens": 4, "messages": user}
    assert_anthropic_error(http.post("/v1/messages", json=body), 404, "not_found_error", "claude-nope")
    body = {"max_tokens": 4, "messages": user, "system": [{"type": "text", "text": "x", "cache_control": {}}]}
    assert_anthropic_error(
        http.post("/v1/messages", json=body), 400, "invalid_request_error", "system[0].cache_control"
    )
    count = http.post("/v1/messages/count_tokens", json={"messages": [{"role": "robot", "content": "x"}]})
    assert_anthropic_error(count, 400, "invalid_request_error", "messages[0].role")
    assert_error(http.post("/v1/chat/completions", json={"messages": user, "max_tokens": "x"}), 400)  # still OpenAI's
