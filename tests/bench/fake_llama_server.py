"""A stand-in for llama.cpp's llama-server in tests of `bench offload --llama-server`, `bench long-context` and `bench
agents`: `--help` lists --cache-ram, and it serves /health and streaming /v1/completions (one SSE frame per token, then
usage and [DONE]), /v1/chat/completions (chat deltas, then usage and llama-server's timings) and /v1/messages
(Anthropic's events) on --port, ignoring every other flag. Its prompt cache is a character count: the prefix a request's
body shares with the one before it, a token every 4 characters. At start it logs its KV caches' sizes as llama.cpp does
(the full-attention layers' and, unless --swa-full, a small SWA cache), and it records the flags it was started with
next to itself (args.json), for the test to read."""

from __future__ import annotations

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        body = b'{"status": "ok"}'
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    last_prompt = ""  # the previous request's prompt text (the fake prompt cache)

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        n = int(request["max_tokens"])
        path = self.path.partition("?")[0]
        if path == "/v1/messages":
            self._messages(request, n)
        elif path == "/v1/chat/completions":
            self._chat(request, n)
        else:
            for i in range(n):
                self._frame({"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]})
            prompt = request["prompt"]
            self._frame({"choices": [], "usage": {"prompt_tokens": len(prompt), "completion_tokens": n}})
            self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")

    def _cache(self, request: dict) -> tuple[int, int]:
        """(prompt tokens, of them cached) of a request: its text's characters / 4, the prefix shared with the last."""
        text = json.dumps({k: request.get(k) for k in ("system", "tools", "messages")})
        last = Handler.last_prompt
        shared = next((i for i, (a, b) in enumerate(zip(text, last)) if a != b), min(len(text), len(last)))
        Handler.last_prompt = text
        return len(text) // 4, shared // 4

    def _chat(self, request: dict, n: int) -> None:
        prompt, cached = self._cache(request)
        for i in range(n):
            self._frame({"choices": [{"index": 0, "delta": {"content": f" t{i}"}, "finish_reason": None}]})
        usage = {"prompt_tokens": prompt, "completion_tokens": n}
        self._frame({"choices": [], "usage": usage, "timings": {"cache_n": cached, "prompt_n": prompt - cached}})
        self._chunk(b"data: [DONE]\n\n")

    def _messages(self, request: dict, n: int) -> None:
        prompt, cached = self._cache(request)
        usage = {"input_tokens": prompt - cached, "cache_read_input_tokens": cached, "output_tokens": 0}
        self._event("message_start", {"message": {"role": "assistant", "content": [], "usage": usage}})
        self._event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
        for i in range(n):
            self._event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": f" t{i}"}})
        self._event("content_block_stop", {"index": 0})
        self._event("message_delta", {"delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": n}})
        self._event("message_stop", {})

    def _event(self, kind: str, doc: dict) -> None:
        self._chunk(f"event: {kind}\ndata: {json.dumps({'type': kind, **doc})}\n\n".encode())

    def _frame(self, doc: dict) -> None:
        self._chunk(f"data: {json.dumps(doc)}\n\n".encode())

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


def main(argv: list[str]) -> None:
    if "--help" in argv:
        print("usage: llama-server [options]\n  --cache-ram N   prompt cache in host RAM, MiB")
        return
    (Path(__file__).parent / "args.json").write_text(json.dumps(argv))
    swa = "  96.00" if "--swa-full" in argv else "   3.00"
    print("llama_kv_cache: size =   24.00 MiB (  2048 cells,   3 layers,  2/2 seqs), K (f16): 12.00 MiB", flush=True)
    print(f"llama_kv_cache: size = {swa} MiB (   256 cells,  15 layers,  2/2 seqs), K (f16): 1.50 MiB", flush=True)
    port = int(argv[argv.index("--port") + 1])
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
