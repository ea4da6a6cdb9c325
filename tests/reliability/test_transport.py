"""The HTTP transport under hostile clients: the API key is checked before the body is read, JSON bodies of
unbounded parse cost are refused before parsing (off the event loop), slow headers and bodies are cut off,
an empty API key is refused at startup, invalid JSON says where, and HTTP/2 upgrade offers are answered over
HTTP/1.1 without log noise. Raw sockets where the bytes on the wire matter; every wait is bounded."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from reliability_support import assert_openai_error, assert_serving
from server_support import API_KEY, MODEL, RunningServer, make_engine

from kvserve.cli import main
from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.server.app import build_app
from kvserve.server.context import ServerSettings
from kvserve.server.json_limits import JSONLimits
from kvserve.server.transport import TransportLimits

EIGHT_MIB = 8 << 20
SOCKET_TIMEOUT_S = 15.0  # a bound on every raw-socket wait, far above the timeouts under test
SHORT_S = 1.0  # the transport timeouts of the `strict_server`


def nested_empty_lists(size: int) -> bytes:
    """`{"prompt": [[], [], ...]}` of about `size` bytes: millions of containers, each one cheap to send."""
    return b'{"prompt": [' + b"[]," * (size // 3 - 6) + b"[]]}"


@pytest.fixture(scope="module")
def strict_server(tiny_model_dir: Path) -> Iterator[RunningServer]:
    """API key on, header and body read timeouts of SHORT_S seconds."""
    transport = TransportLimits(timeout_header_read=SHORT_S, timeout_body_read=SHORT_S)
    async_engine = AsyncLLMEngine(make_engine(tiny_model_dir))
    settings = ServerSettings(served_model_names=(MODEL,), api_key=API_KEY)
    server = RunningServer(build_app(async_engine, settings, transport), async_engine, transport=transport).start()
    yield server
    server.stop()


def connect(server: RunningServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=SOCKET_TIMEOUT_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length body: (status, headers in lower case, body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    while len(body) < int(headers.get("content-length", "0")):
        chunk = sock.recv(65536)
        assert chunk, "connection closed mid-body"
        body += chunk
    return int(status_line.split()[1]), headers, body


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closes the connection (EOF or reset) within SOCKET_TIMEOUT_S, reading and
    discarding whatever it sends first."""
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def post_head(path: str, length: int, extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n{extra}\r\n"
    ).encode()


# --- 1. the API key before the body -------------------------------------------------------------------------


def test_keyless_request_gets_401_before_sending_its_body(guarded_server):
    """The 401 comes back while the client has sent the headers only: the body was never waited for. The
    declared body (within the size limit) is then discarded by the server, and the connection stays usable."""
    body = nested_empty_lists(EIGHT_MIB)
    with connect(guarded_server) as sock:
        sock.sendall(post_head("/v1/completions", len(body)))
        status, headers, payload = read_response(sock)
        assert status == 401 and json.loads(payload)["error"]["type"] == "authentication_error"
        assert headers.get("connection") != "close"
        sock.sendall(body)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
        assert read_response(sock)[0] == 200


def test_keyless_oversized_or_chunked_body_gets_401_and_the_connection_closes(guarded_server):
    """A body the server would not accept anyway is not drained either: 401, then the connection closes."""
    for head in (
        post_head("/v1/completions", 1 << 30),
        b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nTransfer-Encoding: chunked\r\n\r\n",
    ):
        with connect(guarded_server) as sock:
            sock.sendall(head)
            status, headers, _ = read_response(sock)
            assert status == 401 and headers.get("connection") == "close"
            assert closed_by_server(sock)


def test_refused_body_gets_its_413_and_a_lingering_close_not_a_reset(guarded_server):
    """A 413 sent before the body is read ends the connection with a lingering close: the server shuts down
    its sending side after the response and discards what the client still sends, so the client reads the
    whole 413 and none of its sends meets a reset. (Closing at once, with body bytes unread, resets the
    connection, and a reset can destroy the response in flight: httpx saw "peer closed connection without
    sending complete message body" on 1 request in 6 on a loaded machine.)"""
    chunk = b"x" * (1 << 20)
    auth = f"Authorization: Bearer {API_KEY}\r\n"
    with connect(guarded_server) as sock:
        sock.sendall(post_head("/v1/completions", EIGHT_MIB + len(chunk), auth) + chunk)
        status, headers, payload = read_response(sock)
        assert status == 413 and headers.get("connection") == "close", payload
        assert json.loads(payload)["error"]["code"] == "request_too_large"
        time.sleep(0.2)  # room for a reset to arrive, if the server reset the connection
        for _ in range(8):
            sock.sendall(chunk)  # the rest of the body: read and discarded, never refused with a reset
        assert sock.recv(65536) == b""  # the server's FIN after its response
    with guarded_server.client() as c:
        assert c.get("/health").status_code == 200


def test_concurrent_keyless_bodies_leave_the_server_serving(guarded_server, auth):
    """The issue's attack, four keyless 8 MiB bodies of nested empty lists at once: each gets 401 and the
    server goes on answering."""
    body = nested_empty_lists(EIGHT_MIB)
    statuses: list[int] = []

    def attack() -> None:
        with guarded_server.client() as c:
            statuses.append(
                c.post("/v1/completions", content=body, headers={"content-type": "application/json"}).status_code
            )

    threads = [threading.Thread(target=attack) for _ in range(4)]
    for t in threads:
        t.start()
    with guarded_server.client() as c:
        assert c.get("/health").status_code == 200
    for t in threads:
        t.join(SOCKET_TIMEOUT_S * 4)
    assert statuses == [401] * 4
    assert_serving(guarded_server, auth)


def test_docs_and_schema_need_the_key_and_probes_do_not(guarded_server, auth):
    for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
        with guarded_server.client() as c:
            assert_openai_error(c.get(path), 401)
        with guarded_server.client(headers=auth) as c:
            assert c.get(path).status_code == 200, path
    with guarded_server.client() as c:
        for path in ("/health", "/version", "/metrics"):
            assert c.get(path).status_code == 200, path


# --- 2. parse cost -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body,limit",
    [
        (nested_empty_lists(EIGHT_MIB), "arrays and objects"),
        (b'{"prompt": "x", "stop": [' + b'"a",' * 400_000 + b'"a"]}', "JSON values"),
        (b'{"prompt": "x", "user": ' + b"[" * 100 + b"]" * 100 + b"}", "nesting depth"),
    ],
)
def test_bodies_of_unbounded_parse_cost_are_refused_before_parsing(guarded_server, auth, body, limit):
    """The 400 names the shape limit: it came from the scan of the raw bytes, before json.loads or pydantic
    saw the body (those would answer with a validation error instead)."""
    with guarded_server.client(headers=auth) as c:
        err = assert_openai_error(
            c.post("/v1/completions", content=body, headers={"content-type": "application/json"}), 400
        )
    assert limit in err["message"] and "too complex" in err["message"] and err["param"] is None
    assert_serving(guarded_server, auth)


def test_health_answers_while_a_large_body_is_measured(guarded_server, auth, monkeypatch):
    """Large bodies are measured in a worker thread: with the measurement held, the loop still answers."""
    started, release = threading.Event(), threading.Event()
    original = JSONLimits.check

    def held(self: JSONLimits, body: bytes) -> None:
        if len(body) > 1 << 20:
            started.set()
            assert release.wait(SOCKET_TIMEOUT_S), "never released"
        original(self, body)

    monkeypatch.setattr(JSONLimits, "check", held)
    result: list[httpx.Response] = []

    def send() -> None:
        with guarded_server.client(headers=auth) as c:
            result.append(
                c.post(
                    "/v1/completions",
                    content=nested_empty_lists(EIGHT_MIB),
                    headers={"content-type": "application/json"},
                )
            )

    sender = threading.Thread(target=send)
    sender.start()
    try:
        assert started.wait(SOCKET_TIMEOUT_S), "the body was never measured"
        with guarded_server.client(timeout=SOCKET_TIMEOUT_S / 3) as c:  # a blocked loop would time out here
            assert c.get("/health").status_code == 200  # the measurement is still held
    finally:
        release.set()
        sender.join(SOCKET_TIMEOUT_S)
    assert "arrays and objects" in assert_openai_error(result[0], 400)["message"]


def test_invalid_json_says_where_not_in_param(guarded_server, auth):
    with guarded_server.client(headers=auth) as c:
        r = c.post(
            "/v1/completions", content=b'{\n  "prompt": "x",\n  "n": }', headers={"content-type": "application/json"}
        )
    err = assert_openai_error(r, 400)
    assert err["param"] is None
    assert "not valid JSON" in err["message"] and "line 3, column 8" in err["message"], err["message"]


# --- 3. empty API key ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv,env",
    [
        (["--api-key", ""], {}),
        (["--api-key", "  "], {}),
        ([], {"KVSERVE_API_KEY": ""}),
        ([], {"VLLM_API_KEY": ""}),
    ],
)
def test_empty_api_key_is_refused_at_startup(argv, env, monkeypatch, capsys):
    """Exit 2 with a clear error, before the model loads (the model path does not even exist)."""
    for name in ("KVSERVE_API_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["serve", "/nonexistent/model", *argv]) == 2
    err = capsys.readouterr().err
    assert "empty" in err and "authentication" in err, err


def test_build_app_refuses_an_empty_key(tiny_model_dir):
    with pytest.raises(ValueError, match="empty"):
        build_app(AsyncLLMEngine(make_engine(tiny_model_dir)), ServerSettings(served_model_names=(MODEL,), api_key=""))


# --- 4. slow clients -----------------------------------------------------------------------------------------


def test_connection_with_incomplete_headers_is_closed(strict_server):
    with connect(strict_server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n")  # no blank line: the headers never end
        assert closed_by_server(sock)


def trickle_until_closed(sock: socket.socket, byte: bytes = b"a") -> bool:
    """Send one byte every SHORT_S / 10 s until the server closes the connection (True) or SOCKET_TIMEOUT_S
    pass (False). Each byte would cancel uvicorn's keep-alive timer: only a deadline can stop this client."""
    deadline = time.monotonic() + SOCKET_TIMEOUT_S
    sock.settimeout(SHORT_S / 10)
    while time.monotonic() < deadline:
        try:
            sock.sendall(byte)
            if sock.recv(65536) == b"":
                return True
        except TimeoutError:
            continue
        except (BrokenPipeError, ConnectionResetError):
            return True
    return False


def test_headers_trickled_byte_by_byte_are_cut_off(strict_server):
    """Sending keeps a connection busy but does not extend the header deadline (slowloris)."""
    with connect(strict_server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\nX-Slow: ")
        assert trickle_until_closed(sock)


def test_idle_connection_after_a_response_is_closed(strict_server):
    with connect(strict_server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
        assert read_response(sock)[0] == 200
        sock.sendall(b"GET /health HTTP/1.1\r\n")  # the next request's headers never complete
        assert closed_by_server(sock)


def test_body_that_does_not_arrive_gets_408(strict_server):
    with connect(strict_server) as sock:
        sock.sendall(post_head("/v1/completions", 100, f"Authorization: Bearer {API_KEY}\r\n") + b'{"prompt"')
        status, headers, payload = read_response(sock)
        assert status == 408 and headers.get("connection") == "close"
        assert json.loads(payload)["error"]["code"] == "request_timeout"
        assert closed_by_server(sock)


def test_unread_body_after_a_401_must_still_arrive_in_time(strict_server):
    """The server discards a refused body, but not forever: a client that trickles it is cut off."""
    with connect(strict_server) as sock:
        sock.sendall(post_head("/v1/completions", 1 << 20) + b'{"prompt"')
        assert read_response(sock)[0] == 401
        assert trickle_until_closed(sock)


def test_complete_requests_are_served_normally(strict_server):
    """The short timeouts do not touch a client that sends whole requests (several on one connection)."""
    with strict_server.client(headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        for _ in range(3):
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200, r.text


# --- 6. HTTP/2 upgrade offers --------------------------------------------------------------------------------


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_h2c_upgrade_offer_is_served_over_http1_without_warnings(guarded_server, auth):
    """Java's HttpClient offers h2c on every request: 200 over HTTP/1.1, no upgrade, no WARNING in the log."""
    records = _Records()
    uvicorn_logger = logging.getLogger("uvicorn")
    uvicorn_logger.addHandler(records)
    upgrade = {"Connection": "Upgrade, HTTP2-Settings", "Upgrade": "h2c", "HTTP2-Settings": "AAMAAABkAARAAAAAAAIAAAAA"}
    try:
        with guarded_server.client(headers={**auth, **upgrade}) as c:
            r = c.get("/v1/models")
            assert r.status_code == 200 and r.http_version == "HTTP/1.1", r.text
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert c.get("/health").status_code == 200  # the same connection goes on
    finally:
        uvicorn_logger.removeHandler(records)
    warnings = [r.getMessage() for r in records.records if r.levelno >= logging.WARNING]
    assert not warnings, warnings
