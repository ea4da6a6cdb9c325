"""Security: the API key guards every API route (compared in constant time), request bodies are bounded,
cache_salt isolates tenants' prefix caches, and nothing from a request is evaluated as code."""

from __future__ import annotations

import hmac
from collections.abc import Iterator
from pathlib import Path

import pytest
from reliability_support import assert_api_error, assert_openai_error, assert_serving
from server_support import API_KEY

import kvserve
from kvserve.model.chat_template import GEMMA_CHAT_TEMPLATE

OPEN_PATHS = {"/health", "/version", "/metrics"}  # /docs, /redoc and /openapi.json need the key (test_transport.py)
USER = [{"role": "user", "content": "hi"}]


def api_routes(server) -> list[tuple[str, str]]:
    """(method, path) of every route in the app's OpenAPI schema, except the open probes."""
    paths = server.server.config.app.openapi()["paths"]
    return [(method.upper(), path) for path, ops in paths.items() if path not in OPEN_PATHS for method in ops]


def test_every_v1_route_is_guarded(guarded_server):
    routes = api_routes(guarded_server)
    assert {p for _, p in routes} >= {
        "/v1/models",
        "/v1/completions",
        "/v1/chat/completions",
        "/tokenize",
        "/detokenize",
    }
    bad_headers = [
        {},
        {"Authorization": "Bearer"},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Basic {API_KEY}"},
        {"Authorization": API_KEY},
        {"Authorization": f"Bearer {API_KEY}x"},
        {"Authorization": f"Bearer {API_KEY[:-1]}"},
        {"x-api-key": "wrong"},
        {"x-api-key": f"{API_KEY}x"},
    ]
    for method, path in routes:
        for headers in bad_headers:
            with guarded_server.client(headers=headers) as c:
                r = c.request(method, path, json={"prompt": "x", "messages": USER, "tokens": [5]})
            err = assert_api_error(r, 401)
            assert err["type"] == "authentication_error", (method, path, headers)


def test_open_endpoints_stay_open(guarded_server):
    with guarded_server.client() as c:
        for path in ("/health", "/version", "/metrics"):
            assert c.get(path).status_code == 200


def test_key_is_compared_in_constant_time(guarded_server, monkeypatch):
    """The comparison goes through hmac.compare_digest (whose time does not depend on where the first
    differing byte is), for wrong keys as for the right one."""
    seen: list[tuple[bytes, bytes]] = []
    original = hmac.compare_digest

    def spy(a, b):
        seen.append((a, b))
        return original(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    with guarded_server.client(headers={"Authorization": "Bearer sk-wrong"}) as c:
        assert c.get("/v1/models").status_code == 401
    with guarded_server.client(headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        assert c.get("/v1/models").status_code == 200
    assert (b"sk-wrong", API_KEY.encode()) in seen and (API_KEY.encode(), API_KEY.encode()) in seen


def test_body_limit_is_configurable_and_counts_chunked_bodies(make_configured_server):
    server = make_configured_server(max_request_body_bytes=2000)
    with server.client() as c:
        ok = c.post("/v1/completions", json={"prompt": "a" * 100, "max_tokens": 1})
        assert ok.status_code == 200, ok.text
        err = assert_openai_error(c.post("/v1/completions", json={"prompt": "a" * 2500}), 413)
        assert "2000" in err["message"]

        def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
            yield b'{"prompt": "'
            for _ in range(30):
                yield b"a" * 100
            yield b'"}'

        assert_openai_error(
            c.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"}), 413
        )
    assert_serving(server)


def test_cache_salt_isolates_prefix_caches(make_server):
    server = make_server(enable_prefix_caching=True)
    prompt = "a shared system prompt that spans several blocks of four tokens each"

    def cached(**extra) -> int:
        with server.client() as c:
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, **extra})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-a") > 0  # same tenant: a hit
    assert cached(cache_salt="tenant-b") == 0  # another tenant never sees tenant a's blocks
    assert cached() == 0  # nor does an unsalted request
    assert cached() > 0


def test_request_chat_template_is_refused_by_default(guarded_server):
    with guarded_server.client(headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        err = assert_openai_error(
            c.post("/v1/chat/completions", json={"messages": USER, "chat_template": "{{ messages }}"}), 400
        )
    assert err["param"] == "chat_template" and "--trust-request-chat-template" in err["message"]


ESCAPES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{{ cycler.__init__.__globals__.os.popen('touch {marker}').read() }}",
    "{{ self._TemplateReference__context }}{{ lipsum.__globals__['os'].system('touch {marker}') }}",
    "{% for c in [].__class__.__base__.__subclasses__() %}{{ c }}{% endfor %}",
    "{{ raise_exception.__globals__ }}",
]


@pytest.mark.parametrize("template", ESCAPES)
def test_trusted_request_templates_are_still_sandboxed(make_configured_server, tmp_path: Path, template: str):
    marker = tmp_path / "pwned"
    server = make_configured_server(trust_request_chat_template=True)
    with server.client() as c:
        r = c.post(
            "/v1/chat/completions",
            json={"messages": USER, "max_tokens": 1, "chat_template": template.replace("{marker}", str(marker))},
        )
        if r.status_code == 200:  # the sandbox may render an unsafe attribute as undefined: nothing at all
            assert r.json()["usage"]["prompt_tokens"] <= 1, r.text  # BOS alone
        else:
            assert_openai_error(r, 400)
        ok = c.post(
            "/v1/chat/completions",
            json={"messages": USER, "max_tokens": 1, "chat_template": "{{ messages[0]['content'] }}"},
        )
        assert ok.status_code == 200, ok.text
    assert not marker.exists()


def test_operator_templates_render_in_the_sandbox(guarded_server):
    """--chat-template and checkpoint templates go through the same sandboxed renderer."""
    tok = guarded_server.engine.tokenizer
    assert "<start_of_turn>" in tok.apply_chat_template(USER, chat_template=GEMMA_CHAT_TEMPLATE)
    with pytest.raises(ValueError, match="unsafe"):
        tok.apply_chat_template(USER, chat_template="{{ ''.__class__.__mro__ }}")


def test_no_remote_code_is_ever_trusted():
    root = Path(kvserve.__file__).parent
    offenders = [str(p) for p in root.rglob("*.py") if "trust_remote_code=True" in p.read_text()]
    assert not offenders
