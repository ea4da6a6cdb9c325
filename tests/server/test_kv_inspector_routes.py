"""The KV inspector's HTTP routes on a real server: the page and assets load without the key, the data routes need
it, the snapshot reflects the engine, the SSE stream delivers snapshots and events, and the flags switch things off."""

from __future__ import annotations

import threading
import time
from typing import Any

from server_support import API_KEY, RunningServer, ServerFactory, sse_messages, wait_until

from kvserve.engine.inspector_delta import apply_delta

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def test_page_is_open_and_data_needs_the_key(make_server: ServerFactory) -> None:
    server = make_server(api_key=API_KEY)
    with server.client() as client:
        for path in ("/", "/ui"):
            page = client.get(path)
            assert page.status_code == 200 and 'src="ui/assets/app.js"' in page.text  # relative asset URLs
            assert 'data-requires-key="true"' in page.text
            assert "Model: <code>" in page.text and "{{" not in page.text  # the playground names the model
        assert client.get("/ui/assets/app.js").status_code == 200
        assert client.get("/ui/assets/app.css").headers["content-type"].startswith("text/css")
        assert client.get("/ui/assets/nope.js").status_code == 404
        assert client.get("/v1/kv/snapshot").status_code == 401
        assert client.get("/v1/kv/stream").status_code == 401
        assert client.get("/v1/kv/snapshot", headers={"Authorization": "Bearer wrong"}).status_code == 401
        snap = client.get("/v1/kv/snapshot", headers=AUTH)
        assert snap.status_code == 200
        body = snap.json()
        assert body["version"] == 2 and len(body["block_states"]) == body["pool"]["num_blocks"]
        assert body["events"] == []
        assert client.get("/v1/kv/blocks/1").status_code == 401
        assert client.get("/v1/kv/blocks/1", headers=AUTH).json()["state"] == "f"
        missing = client.get("/v1/kv/blocks/100000", headers=AUTH)
        assert missing.status_code == 404 and "out of range" in missing.json()["error"]["message"]


def test_snapshot_shows_a_running_requests_blocks(make_server: ServerFactory) -> None:
    server = make_server(before_step=lambda: time.sleep(0.05))  # slow steps: the request is seen running
    with server.client() as client:
        done: dict[str, Any] = {}

        def send() -> None:
            done["r"] = client.post(
                "/v1/completions", json={"prompt": "abcdefghijklm", "max_tokens": 20, "ignore_eos": True}
            )

        thread = threading.Thread(target=send)
        thread.start()
        try:
            snaps: list[dict[str, Any]] = []

            def running() -> bool:
                snaps.append(client.get("/v1/kv/snapshot").json())  # each taken between steps
                return bool(snaps[-1]["requests"]) and snaps[-1]["requests"][0]["status"] == "running"

            wait_until(running)
            snap = snaps[-1]
        finally:
            thread.join(30)
        assert done["r"].status_code == 200
        (request,) = snap["requests"]
        assert request["num_prompt_tokens"] >= 13 and request["block_ids"]
        for block_id in request["block_ids"]:
            assert snap["block_states"][block_id] in "us"
        after = client.get("/v1/kv/snapshot").json()
        assert after["requests"] == [] and set(after["block_states"][1:]) <= {"f", "c"}
        assert any(e["kind"] == "block_stored" for e in after["events"])
        # A cached block's detail carries its text, decoded by the route (the engine thread decodes nothing).
        cached = next(b for b in after["blocks"] if b["state"] == "c")
        detail = client.get(f"/v1/kv/blocks/{cached['id']}").json()
        assert detail["token_ids"] and detail["text"] == server.engine.tokenizer.decode(
            detail["token_ids"], skip_special_tokens=False
        )


def test_stream_sends_a_snapshot_then_deltas(make_server: ServerFactory) -> None:
    server = make_server()
    assert server.engine.kv_publisher.published.snapshot is None  # nobody watched: nothing was built
    with server.client() as client, client.stream("GET", "/v1/kv/stream") as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        messages = sse_messages(stream)
        kind, first = next(messages)
        assert kind == "snapshot" and first["requests"] == [] and first["events"] == []
        with server.client() as other:
            assert (
                other.post("/v1/completions", json={"prompt": "abcdefghijklmnop", "max_tokens": 3}).status_code == 200
            )
        state, seq, events = first, first["seq"], []
        for kind, payload in messages:
            assert kind == "delta" and payload["base"] == seq  # no gap, no second snapshot
            seq = payload["seq"]
            state = apply_delta(state, payload)
            events += payload["events"]
            if (
                state["gauges"]["generation_tokens_total"] >= 3
                and not state["requests"]
                and any(e["kind"] == "block_stored" for e in events)
            ):
                break
        stored = {e["block_id"] for e in events if e["kind"] == "block_stored"}
        assert stored and all(state["block_states"][i] == "c" for i in stored)  # cached once the request ended
        fresh = client.get("/v1/kv/snapshot").json()  # what the deltas built is the engine's state
        assert state["block_states"] == fresh["block_states"]
        assert [{**b, "token_ids": None} for b in fresh["blocks"]] == state["blocks"]
        assert fresh["prefix_cache"] == state["prefix_cache"]
    wait_until(lambda: server.engine.kv_publisher.num_watchers == 0)  # the closed stream stopped watching


def test_streams_share_one_watch(make_server: ServerFactory) -> None:
    server = make_server()
    with server.client() as a, server.client() as b, a.stream("GET", "/v1/kv/stream") as sa:
        first = next(sse_messages(sa))
        with b.stream("GET", "/v1/kv/stream") as sb:
            second = next(sse_messages(sb))
        assert first[0] == second[0] == "snapshot"
        assert server.engine.kv_publisher.num_watchers == 1  # one watch for all streams (the hub's)
    wait_until(lambda: server.engine.kv_publisher.num_watchers == 0)


def test_disable_ui_and_redact_text(make_server: ServerFactory, tiny_model_dir: Any) -> None:
    from server_support import MODEL, make_engine

    from kvserve.engine.async_engine import AsyncLLMEngine
    from kvserve.server.app import build_app
    from kvserve.server.context import ServerSettings

    engine = AsyncLLMEngine(make_engine(tiny_model_dir))
    settings = ServerSettings(served_model_names=(MODEL,), disable_ui=True, ui_redact_text=True)
    server = RunningServer(build_app(engine, settings), engine).start()
    try:
        with server.client() as client:
            assert client.get("/").status_code == 404 and client.get("/ui").status_code == 404
            assert (
                client.post("/v1/completions", json={"prompt": "abcdefghijklmnop", "max_tokens": 2}).status_code == 200
            )
            snap = client.get("/v1/kv/snapshot").json()
            assert snap["redacted"] and snap["blocks"]
            assert all(b["token_ids"] is None for b in snap["blocks"])
            assert all(e.get("token_ids") is None for e in snap["events"])
            detail = client.get(f"/v1/kv/blocks/{snap['blocks'][0]['id']}").json()
            assert detail["text"] is None and detail["token_ids"] is None
    finally:
        server.stop()


def test_serve_flags_parse() -> None:
    from kvserve.cli import build_parser

    args = build_parser().parse_args(["serve", "--disable-ui", "--ui-redact-text"])
    assert args.disable_ui and args.ui_redact_text
    defaults = build_parser().parse_args(["serve"])
    assert not defaults.disable_ui and not defaults.ui_redact_text


def test_the_playground_suggests_the_instruct_model_on_the_base_model() -> None:
    from kvserve.server.kv_inspector import model_note

    base = model_note("gemma-3-270m")
    assert "a base (pretrained) model" in base and "--model qwen2.5-coder-0.5b-instruct" in base
    assert model_note("qwen2.5-coder-0.5b-instruct") == "Model: <code>qwen2.5-coder-0.5b-instruct</code>"
    assert model_note("<b>") == "Model: <code>&lt;b&gt;</code>"
