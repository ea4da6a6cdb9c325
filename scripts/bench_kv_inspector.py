"""What the KV inspector costs.

OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python scripts/bench_kv_inspector.py
    on the tiny test model, in seconds: one snapshot of a ~7,000-block pool, its JSON, one delta between two
    snapshots a decode step apart (diff time and size), and decode steps with and without a watcher
    (interleaved runs, medians)
HF_HUB_OFFLINE=1 python scripts/bench_kv_inspector.py --serve [--model M] [--pairs 5] [--window 20]
    the issue's proof: a real `kvserve serve` process (default model unless --model), 32 requests decoding
    through the HTTP API, and its decode throughput (the generation-tokens counter on /metrics over a window)
    with a /v1/kv/stream reader open vs none, in interleaved windows (alternating which goes first), medians
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "server"), str(ROOT / "tests" / "models")]

from server_support import make_engine  # noqa: E402
from tiny_models import build_tiny_hf_model  # noqa: E402
from tiny_tokenizer import write_char_tokenizer  # noqa: E402

from kvserve.engine.engine import LLMEngine  # noqa: E402
from kvserve.engine.inspector_delta import diff_snapshots  # noqa: E402
from kvserve.engine.kv_publisher import KVPublisher  # noqa: E402
from kvserve.sampling_params import SamplingParams  # noqa: E402

STEPS = 150  # per run: long against the snapshot interval, so that a run sees the steady publishing rate


def busy_engine(model_dir: Path, num_blocks: int = 7000, batch: int = 32) -> LLMEngine:
    """A pool mostly full of cached prefixes, and `batch` requests decoding with a shared system prompt."""
    engine = make_engine(
        model_dir, num_gpu_blocks_override=num_blocks, block_size=16, max_num_seqs=batch, max_num_batched_tokens=8192
    )
    rng = random.Random(0)
    for i in range(300):
        engine.add_request(f"fill{i}", [rng.randrange(3, 250) for _ in range(250)], SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    system = [rng.randrange(3, 250) for _ in range(64)]
    for i in range(batch):
        prompt = system + [rng.randrange(3, 250) for _ in range(60)]
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=120, ignore_eos=True))
    for _ in range(3):
        engine.step()
    return engine


def top_up(engine: LLMEngine, batch: int, rng: random.Random) -> None:
    """Keep `batch` requests decoding: replace finished ones with fresh ones (sharing the system prompt)."""
    while len(engine.core.requests.groups) < batch:
        prompt = [7] * 64 + [rng.randrange(3, 250) for _ in range(8)]
        engine.add_request(f"r{rng.random()}", prompt, SamplingParams(max_tokens=150, ignore_eos=True))


def steps_per_s(engine: LLMEngine, publisher: KVPublisher, steps: int, watched: bool, rng: random.Random) -> float:
    """Decode steps per second over `steps` steps (with top-ups), with or without a watcher on the publisher."""
    batch = engine.config.max_num_seqs
    with contextlib.ExitStack() as stack:
        if watched:
            stack.enter_context(publisher.watch())
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
            publisher.tick(True)
            top_up(engine, batch, rng)
        return steps / (time.perf_counter() - start)


def main() -> None:
    model_dir = Path(tempfile.mkdtemp())
    build_tiny_hf_model("llama_gqa").save_pretrained(model_dir)
    write_char_tokenizer(model_dir)
    engine = busy_engine(model_dir)
    snap = engine.kv_snapshot(False)
    states = {c: snap["block_states"].count(c) for c in "nfucs"}
    build = []
    for _ in range(20):
        start = time.perf_counter()
        engine.kv_snapshot(False)
        build.append(time.perf_counter() - start)
    encode = []
    for _ in range(5):
        start = time.perf_counter()
        text = json.dumps(snap)
        encode.append(time.perf_counter() - start)
    diffs, sizes = [], []
    for _ in range(5):  # a delta one decode step apart: the stream's usual update at batch 32
        before = engine.kv_snapshot(False)
        engine.step()
        top_up(engine, 32, random.Random(2))
        after = engine.kv_snapshot(False)
        start = time.perf_counter()
        delta = diff_snapshots(before, after)
        diffs.append(time.perf_counter() - start)
        sizes.append(len(json.dumps(delta)))
    publisher = KVPublisher(engine.core, lambda: None)
    off, on = [], []
    rng = random.Random(1)
    for _ in range(5):  # interleaved, so that drift (other load, the sequences growing) hits both alike
        off.append(steps_per_s(engine, publisher, STEPS, False, rng))
        on.append(steps_per_s(engine, publisher, STEPS, True, rng))
    print(f"pool {engine.core.pool.num_blocks} blocks {states}, {len(snap['requests'])} requests")
    print(
        f"snapshot {statistics.median(build) * 1e3:.2f} ms (median of 20); "
        f"JSON {statistics.median(encode) * 1e3:.2f} ms, {len(text) / 1024:.0f} KiB"
    )
    print(
        f"delta one step apart: diff {statistics.median(diffs) * 1e3:.2f} ms (median of 5), "
        f"JSON {statistics.median(sizes) / 1024:.1f} KiB"
    )
    ratio = statistics.median(on) / statistics.median(off)
    print(
        f"decode steps/s at batch {len(engine.core.scheduler.running)}: "
        f"without a watcher {statistics.median(off):.1f}, with {statistics.median(on):.1f} (ratio {ratio:.3f})"
    )


# ---- --serve: a real server process, 32 requests through HTTP, a stream reader open or not ----


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _generated(client: Any) -> float:
    text = client.get("/metrics").text
    match = re.search(r"^\S*generation_tokens_total(?:\{[^}]*\})? (\S+)$", text, re.MULTILINE)
    if match is None:
        raise RuntimeError("no generation_tokens_total on /metrics")
    return float(match.group(1))


def _running(client: Any) -> float:
    match = re.search(r"^\S*num_requests_running(?:\{[^}]*\})? (\S+)$", client.get("/metrics").text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _decode_rate(client: Any, pid: int, window: float, poll_s: float = 0.1) -> tuple[float, float]:
    """Generated tokens per second over about `window` seconds, between two changes of the counter (a slow model
    makes a step every second or so: a window of fixed length would be quantized by whole steps), and the server
    process's CPU milliseconds per generated token over the same span (less sensitive than the rate to what else
    the machine runs)."""
    changes: list[tuple[float, float, float]] = []
    last = _generated(client)
    end = time.monotonic() + window
    while time.monotonic() < end or len(changes) < 2:
        time.sleep(poll_s)
        now = _generated(client)
        if now != last:
            changes.append((time.monotonic(), now, _cpu_s(pid)))
            last = now
    (t0, g0, c0), (t1, g1, c1) = changes[0], changes[-1]
    return (g1 - g0) / (t1 - t0), (c1 - c0) * 1e3 / (g1 - g0)


class Load:
    """`batch` client threads, each sending one long completion after another, so the batch stays full."""

    def __init__(self, base_url: str, batch: int, max_tokens: int) -> None:
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._loop, args=(base_url, i, max_tokens), daemon=True) for i in range(batch)
        ]

    def _loop(self, base_url: str, i: int, max_tokens: int) -> None:
        import httpx

        with httpx.Client(base_url=base_url, timeout=None) as client:
            n = 0
            while not self.stop.is_set():
                prompt = f"Request {i}.{n}: write a long story about the sea, the ships and the sailors."
                client.post(
                    "/v1/completions",
                    json={"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0},
                )
                n += 1


class StreamReader:
    """What the page does on the wire: reads /v1/kv/stream and parses every frame's JSON."""

    def __init__(self, base_url: str) -> None:
        self.sizes: dict[str, list[int]] = {"snapshot": [], "delta": []}
        self.kind = ""
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._read, args=(base_url,), daemon=True)
        self.thread.start()

    def _read(self, base_url: str) -> None:
        import httpx

        with httpx.Client(base_url=base_url, timeout=None) as client, client.stream("GET", "/v1/kv/stream") as r:
            for line in r.iter_lines():
                if self.stop.is_set():
                    return
                if line.startswith("event:"):
                    self.kind = line[6:].strip()
                elif line.startswith("data:"):
                    json.loads(line[5:])
                    self.sizes[self.kind].append(len(line))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(30)


def _kib(sizes: list[int]) -> str:
    return f"{statistics.median(sizes) / 1024:.1f}" if sizes else "-"


def serve_bench(args: argparse.Namespace) -> None:
    import httpx

    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "kvserve.cli",
        "serve",
        *([args.model] if args.model else []),
        "--port",
        str(port),
        "--max-num-seqs",
        str(args.batch),
        *args.server_args,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base_url = f"http://127.0.0.1:{port}"
    load = Load(base_url, args.batch, args.max_tokens)
    try:
        with httpx.Client(base_url=base_url, timeout=30) as client:
            deadline = time.monotonic() + 600
            while True:
                if server.poll() is not None:
                    raise RuntimeError(f"the server exited: {server.stderr.read() if server.stderr else ''}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get("/health").status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError("the server did not start in 10 minutes")
                time.sleep(1)
            pool = client.get("/v1/kv/snapshot").json()["pool"]
            for thread in load.threads:
                thread.start()
            while _running(client) < args.batch:
                time.sleep(0.5)
            time.sleep(args.window / 2)  # past the prefills
            rates: dict[bool, list[float]] = {False: [], True: []}
            cpus: dict[bool, list[float]] = {False: [], True: []}
            sizes: dict[str, list[int]] = {"snapshot": [], "delta": []}
            for pair in range(args.pairs):
                for watched in (False, True) if pair % 2 == 0 else (True, False):
                    reader = StreamReader(base_url) if watched else None
                    time.sleep(1.0)  # the stream's full snapshot and the first deltas, as a page opening
                    rate, cpu = _decode_rate(client, server.pid, args.window)
                    rates[watched].append(rate)
                    cpus[watched].append(cpu)
                    if reader is not None:
                        reader.close()
                        for kind, values in reader.sizes.items():
                            sizes[kind].extend(values)
                    print(
                        f"pair {pair} {'stream open  ' if watched else 'stream closed'} {rate:8.1f} tokens/s "
                        f"{cpu:7.2f} server CPU ms/token",
                        flush=True,
                    )
        off, on = statistics.median(rates[False]), statistics.median(rates[True])
        ratios = [b / a for a, b in zip(rates[False], rates[True], strict=True)]
        cpu_off, cpu_on = statistics.median(cpus[False]), statistics.median(cpus[True])
        print(
            f"model {args.model or 'default'}, pool {pool['num_blocks']} blocks of {pool['block_size']}, "
            f"batch {args.batch}, {args.pairs} pairs of {args.window:.0f} s windows"
        )
        print(
            f"decode tokens/s: stream closed {off:.1f}, open {on:.1f} (ratio of medians {on / off:.3f}; "
            f"median of per-pair ratios {statistics.median(ratios):.3f}; "
            f"per pair {', '.join(f'{r:.3f}' for r in ratios)})"
        )
        print(
            f"server CPU ms per generated token: stream closed {cpu_off:.2f}, open {cpu_on:.2f} "
            f"(ratio of medians {cpu_on / cpu_off:.3f})"
        )
        print(
            f"stream frames: {len(sizes['snapshot'])} snapshots, median {_kib(sizes['snapshot'])} KiB; "
            f"{len(sizes['delta'])} deltas, median {_kib(sizes['delta'])} KiB, "
            f"largest {max(sizes['delta'] or [0]) / 1024:.1f} KiB"
        )
    finally:
        load.stop.set()
        server.terminate()
        server.wait(60)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--serve", action="store_true", help="measure a real server with the stream open vs closed")
    p.add_argument("--model", default=None, help="--serve: the model (default: kvserve serve's default)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--pairs", type=int, default=5, help="--serve: interleaved (closed, open) window pairs")
    p.add_argument("--window", type=float, default=20.0, help="--serve: seconds per window")
    p.add_argument("--max-tokens", type=int, default=400, help="--serve: tokens per request (requests repeat)")
    p.add_argument(
        "--server-arg",
        dest="server_args",
        action="append",
        default=[],
        help="--serve: one more `kvserve serve` argument (repeatable), e.g. --server-arg=--cpu-threads=2",
    )
    return p.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    serve_bench(arguments) if arguments.serve else main()
