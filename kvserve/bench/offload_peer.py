"""`bench offload --llama-server PATH`: the multi-round chat against llama.cpp's llama-server with its prompt cache,
both as servers measured by one streaming client (bench/serve_client.py), the requests alternating between them.

Why over HTTP with canned replies: llama-server is a server, so kvserve is measured as one too (`kvserve serve` in
its own process). The client sends token ids, so both servers see identical prompts; each round's reply joins the
history as a fixed random answer (the same for both) rather than each server's own output, so the histories stay
identical token for token whatever either model generates."""

from __future__ import annotations

import asyncio
import random
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvserve.bench.server_process import ServerProcess, free_port
from kvserve.bench.stats import percentile


@dataclass(frozen=True, slots=True)
class ChatShape:
    users: int
    rounds: int
    system_tokens: int
    question_tokens: int
    output_len: int
    seed: int


def chat_turns(shape: ChatShape, vocab: int, exclude: list[int], bos: list[int]) -> list[list[list[int]]]:
    """turns[round][user]: the prompt of that user's request in that round (system, then each earlier question and
    canned reply, then the new question)."""
    from kvserve.bench.workload import random_token_ids

    rng = random.Random(shape.seed)
    histories = [bos + random_token_ids(rng, shape.system_tokens, vocab, exclude) for _ in range(shape.users)]
    turns = []
    for _ in range(shape.rounds):
        row = []
        for user in range(shape.users):
            prompt = histories[user] + random_token_ids(rng, shape.question_tokens, vocab, exclude)
            row.append(prompt)
            histories[user] = prompt + random_token_ids(rng, shape.output_len, vocab, exclude)
        turns.append(row)
    return turns


def has_flag(binary: str, flag: str) -> bool:
    out = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60)
    return flag in out.stdout + out.stderr


class LlamaServer:
    """llama-server on a free loopback port, waited for until /health answers, stopped with SIGTERM."""

    def __init__(self, binary: str, args: list[str], log_path: Path, timeout_s: float = 300.0) -> None:
        self.port = free_port()
        self.args = [binary, *args, "--host", "127.0.0.1", "--port", str(self.port)]
        self.base_url = f"http://127.0.0.1:{self.port}"
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ValueError(f"llama-server exited with {self.proc.returncode}: {log_path.read_text()[-2000:]}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise ValueError(f"llama-server was not healthy within {timeout_s:.0f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


async def _run(turns: list[list[list[int]]], urls: dict[str, str], output_len: int) -> dict[str, dict[str, Any]]:
    from kvserve.bench.serve_client import Endpoint, stream_completion

    ttfts: dict[str, list[float]] = {name: [] for name in urls}
    walls = dict.fromkeys(urls, 0.0)
    tokens = dict.fromkeys(urls, 0)
    cached = dict.fromkeys(urls, 0)
    names = list(urls)
    async with httpx.AsyncClient(timeout=600.0) as client:
        k = 0
        for row in turns:
            for prompt in row:
                order = names[k % len(names) :] + names[: k % len(names)]
                k += 1
                for name in order:
                    start = time.perf_counter()
                    result = await stream_completion(client, Endpoint(urls[name]), prompt, output_len, True)
                    if not result.ok or result.ttft_s is None:
                        raise RuntimeError(f"{name}: {result.error}")
                    walls[name] += time.perf_counter() - start
                    tokens[name] += len(prompt) + result.output_tokens
                    ttfts[name].append(1e3 * result.ttft_s)
                    cached[name] += result.cached_tokens or 0
    return {
        name: {
            "ttft_ms_p50": percentile(ttfts[name], 50),
            "ttft_ms_p90": percentile(ttfts[name], 90),
            "throughput_tok_s": tokens[name] / walls[name],
            "cached_tokens_reported": cached[name],
            "ttft_ms": ttfts[name],
        }
        for name in urls
    }


def compare_with_llama_server(
    binary: str,
    model_path: Path,
    kvserve_args: list[str],
    llama_args: list[str],
    turns: list[list[list[int]]],
    output_len: int,
    log_dir: Path,
) -> dict[str, Any]:
    """Both servers up at once (idle while the other answers), the turns alternating between them."""
    kvserve = ServerProcess.start(kvserve_args, log_dir / "kvserve-serve.log", timeout_s=600.0)
    try:
        peer = LlamaServer(binary, ["-m", str(model_path), *llama_args], log_dir / "llama-server.log")
        try:
            urls = {"kvserve": kvserve.base_url, "llama-server": peer.base_url}
            results = asyncio.run(_run(turns, urls, output_len))
        finally:
            peer.stop()
    finally:
        kvserve.stop()
    return {"kvserve_args": kvserve_args, "llama_server_args": llama_args, "systems": results}
