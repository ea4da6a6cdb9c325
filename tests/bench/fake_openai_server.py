"""A minimal OpenAI-style streaming server on the standard library, for testing the serve benchmark client
without a model: /v1/models, and /v1/completions streaming one SSE frame per token then [DONE]."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass(frozen=True)
class FakeBehaviour:
    model: str = "fake-model"
    token_delay_s: float = 0.002
    fail_every: int = 0  # every n-th completion request answers HTTP 500 (0: never)
    send_usage: bool = True


def _handler(behaviour: FakeBehaviour, counter: list[int], lock: threading.Lock) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # keep test output quiet
            pass

        def _send_json(self, status: int, doc: dict) -> None:
            body = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/v1/models":
                self._send_json(200, {"object": "list", "data": [{"id": behaviour.model, "object": "model"}]})
            else:
                self._send_json(404, {"error": {"message": "not found"}})

        def do_POST(self) -> None:
            request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            with lock:
                counter[0] += 1
                number = counter[0]
            if self.path != "/v1/completions" or request.get("model") != behaviour.model:
                self._send_json(404, {"error": {"message": f"unknown path or model {request.get('model')!r}"}})
                return
            if behaviour.fail_every and number % behaviour.fail_every == 0:
                self._send_json(500, {"error": {"message": "injected failure"}})
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            n = int(request["max_tokens"])
            for i in range(n):
                time.sleep(behaviour.token_delay_s)
                self._frame({"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]})
            self._frame({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
            if behaviour.send_usage:
                self._frame({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": n}})
            self._chunk(b"data: [DONE]\n\n")
            self._chunk(b"")

        def _frame(self, doc: dict) -> None:
            self._chunk(f"data: {json.dumps(doc)}\n\n".encode())

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

    return Handler


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client closing its keep-alive connection is not an error worth a traceback in test output


@contextmanager
def fake_server(behaviour: FakeBehaviour | None = None) -> Iterator[str]:
    """Serve on a free localhost port for the duration of the block; yields the base URL."""
    server = _QuietServer(("127.0.0.1", 0), _handler(behaviour or FakeBehaviour(), [0], threading.Lock()))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
