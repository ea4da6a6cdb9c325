"""Constraints no output can satisfy, or that a backend cannot enforce, are a 400 at request time, never a 500 or
output the constraint does not constrain (#27's hostile run: `{"$ref": "#"}` and an empty character class gave 500
engine_fault every time; a remote `$ref` was only logged and `allOf` of a string and an integer emitted integers)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from reliability_support import assert_openai_error, leaked_blocks
from server_support import MODEL, RunningServer, make_engine

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.server.app import build_app
from kvserve.server.context import ServerSettings


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[RunningServer]:
    async_engine = AsyncLLMEngine(make_engine(tiny_model_dir))
    running = RunningServer(build_app(async_engine, ServerSettings(served_model_names=(MODEL,))), async_engine).start()
    yield running
    running.stop()


CASES = [
    ({"guided_json": {"$ref": "#"}}, "guided_json", "invalid JSON schema"),
    ({"guided_json": {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}, "guided_json", ""),
    ({"guided_grammar": "root ::= [^\\x00-\\U0010FFFF]"}, "guided_grammar", "no output can satisfy it"),
    ({"guided_json": {"$ref": "http://example.com/schema.json"}}, "guided_json", "points outside the schema"),
    (
        {"guided_json": {"type": "object", "properties": {"a": {"$ref": "https://x.test/a.json"}}}},
        "guided_json",
        "at /properties/a",
    ),
    ({"guided_json": {"allOf": [{"type": "string"}, {"type": "integer"}]}}, "guided_json", "Unsatisfiable"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}},
        "response_format.json_schema.schema",
        "",
    ),
]


@pytest.mark.parametrize(("fields", "param", "reason"), CASES)
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_constraint_nothing_can_satisfy_is_a_400(server, route: str, fields: dict, param: str, reason: str):
    if "chat" not in route and "response_format" in fields:
        pytest.skip("response_format is chat's field")
    body = {"max_tokens": 5, **fields}
    body.update({"messages": [{"role": "user", "content": "x"}]} if "chat" in route else {"prompt": "x"})
    with server.client(timeout=60) as c:
        error = assert_openai_error(c.post(route, json=body), 400)
        assert error["param"] == param and reason in error["message"], error
        assert c.post("/v1/completions", json={"prompt": "still", "max_tokens": 2}).status_code == 200
    assert leaked_blocks(server) == 0


def test_an_allof_the_backends_can_enforce_is_enforced(server):
    schema = {
        "allOf": [
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"type": "object", "properties": {"a": {"type": "integer"}}},
        ]
    }
    with server.client(timeout=60) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 30, "guided_json": schema})
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":  # complete within max_tokens: then it is the object the schema asks for
        assert isinstance(json.loads(choice["text"])["a"], int)
