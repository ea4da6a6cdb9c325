"""One slow grammar holds up nobody (#27's hostile run: a 100,000-string guided_choice compiled for 24-97 s on the
one preparation thread while /tokenize took 21-45 s and a 4-token chat 76 s). Compiles run on a pool of their own,
in worker processes, within --structured-outputs-config's budgets: prompts, /tokenize and unconstrained requests go
on while one compiles; a full compile queue is a 503, a constraint over a budget a 400 naming the limit, and a
client that leaves abandons its compile (its worker is killed, its slot freed). Every check is by event order,
never by elapsed time: on the 256-token test vocabulary the slow constraint compiles for ~12 s, the rest in ms."""

from __future__ import annotations

import json
import socket
import threading

from reliability_support import assert_openai_error
from server_support import wait_until

from kvserve.structured.params import StructuredOutputsParams

SLOW_CHOICE = [f"option {i} of many, x{i * 7919 % 1000003}" for i in range(20_000)]  # ~700 KB, ~12 s to compile
BUDGETS = {
    "max_grammar_bytes": 4 << 20,
    "max_compile_seconds": 120,
    "max_concurrent_compiles": 1,
    "max_queued_compiles": 0,
}


def _send_and_hold(port: int, body: dict) -> socket.socket:
    """A raw client that sends one request and reads nothing: closing it is the client leaving."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def test_a_slow_compile_holds_up_no_prompt_and_leaves_with_its_client(make_server) -> None:
    server = make_server(structured_outputs_config=BUDGETS)
    grammar = server.engine.grammar
    with server.client(timeout=60) as c:
        assert (
            c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "guided_regex": "[ab]+"}).status_code == 200
        )
        slow = _send_and_hold(server.port, {"prompt": "pick", "max_tokens": 4, "guided_choice": SLOW_CHOICE})
        try:
            wait_until(lambda: len(grammar._jobs) == 1, timeout=60)  # it is compiling
            # Meanwhile: tokenizing, an ordinary request, and a second constraint that finds the queue full.
            assert c.post("/tokenize", json={"prompt": "hello"}).status_code == 200
            assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3}).status_code == 200
            busy = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "guided_regex": "[cd]+"})
            assert assert_openai_error(busy, 503)["code"] == "grammar_queue_full"
            assert len(grammar._jobs) == 1  # all of that while the slow one still compiles
        finally:
            slow.close()  # the client leaves
        wait_until(lambda: not grammar._jobs, timeout=30)  # its compile abandoned: the worker killed, the slot free
        assert grammar.lookup(StructuredOutputsParams(choice=SLOW_CHOICE)) is None
        ok = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "guided_regex": "[cd]+"})
        assert ok.status_code == 200 and set(ok.json()["choices"][0]["text"]) <= {"c", "d"}


def test_a_compile_past_its_time_budget_is_a_400_naming_the_limit(make_server) -> None:
    server = make_server(structured_outputs_config={**BUDGETS, "max_compile_seconds": 0.5})
    with server.client(timeout=60) as c:
        r = c.post("/v1/completions", json={"prompt": "pick", "max_tokens": 4, "guided_choice": SLOW_CHOICE})
        error = assert_openai_error(r, 400)
        assert error["param"] == "guided_choice" and "max_compile_seconds 0.5" in error["message"]
        assert (
            c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "guided_regex": "[ab]+"}).status_code == 200
        )


def test_a_constraint_over_the_size_budget_is_a_400_before_any_compile(make_server) -> None:
    server = make_server()  # the default budgets: 256 KiB of constraint
    with server.client(timeout=60) as c:
        r = c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "pick"}], "max_tokens": 4, "guided_choice": SLOW_CHOICE},
        )
        error = assert_openai_error(r, 400)
        assert error["param"] == "guided_choice" and "over max_grammar_bytes 262144" in error["message"]
    assert not server.engine.grammar.is_built


def test_the_default_budgets_hold_the_hostile_runs_request_off_everyone_else(make_server) -> None:
    """The reported request itself (100,000 choices) is refused at once by the size budget, on a thread of its own:
    the server answers the next prompt as if it had never come."""
    server = make_server()
    threads = []
    results: list[int] = []
    huge = [f"choice number {i}" for i in range(100_000)]
    with server.client(timeout=60) as c:
        for _ in range(4):
            t = threading.Thread(
                target=lambda: results.append(
                    c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "guided_choice": huge}).status_code
                )
            )
            t.start()
            threads.append(t)
        assert c.post("/tokenize", json={"prompt": "hello"}).status_code == 200
        for t in threads:
            t.join(60)
    assert results == [400] * 4
