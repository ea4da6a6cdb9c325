"""What one slow grammar costs everyone else (#27, docs/RELIABILITY.md "One slow grammar holds up nobody").

Starts `kvserve serve` on the default model, measures the latency of `POST /tokenize` and of an ordinary 4-token
completion idle, then again while clients keep the grammar compile pool busy with maximal constraints (choices just
under the default max_grammar_bytes: the slowest a request may ask for), and reports the ratios. Then it sends 50
distinct heavy grammars and reports the server's RSS before and after (and the compile worker's), against the
grammar cache's bound, and its RSS after each of `--maximal` more maximal choices. Not run by CI (minutes on
the default model).

Usage: python scripts/measure_grammar_isolation.py [--port 8123] [--rounds 15] [--hogs 4] [--maximal 12]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import httpx
import psutil


def rss_mib(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def workers_rss_mib(pid: int) -> list[float]:
    """The compile workers' RSS (the server's child processes)."""
    return [round(c.memory_info().rss / 2**20, 1) for c in psutil.Process(pid).children(recursive=True)]


def timed(client: httpx.Client, path: str, body: dict) -> float:
    start = time.perf_counter()
    r = client.post(path, json=body)
    r.raise_for_status()
    return 1e3 * (time.perf_counter() - start)


def latencies(client: httpx.Client, rounds: int) -> dict[str, float]:
    tok = [timed(client, "/tokenize", {"prompt": "hello there"}) for _ in range(rounds)]
    gen = [
        timed(client, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 4}) for _ in range(rounds)
    ]
    return {"tokenize_ms": statistics.median(tok), "completion_ms": statistics.median(gen)}


def max_choice(tag: str, budget: int = 262_144) -> list[str]:
    """Distinct choices whose serialized constraint stays just under `budget` bytes."""
    out, size = [], 40
    i = 0
    while True:
        s = f"{tag} option {i} x{i * 7919 % 1000003}"
        if size + len(s) + 4 > budget:
            return out
        out.append(s)
        size += len(s) + 3
        i += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--hogs", type=int, default=4, help="clients sending maximal grammars meanwhile")
    parser.add_argument("--maximal", type=int, default=12, help="maximal grammars sent one by one at the end")
    args = parser.parse_args()
    base = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvserve.cli",
            "serve",
            "--port",
            str(args.port),
            "--kv-cache-memory-bytes",
            "1GiB",
            "--uvicorn-log-level",
            "warning",
        ],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the server did not start")
            time.sleep(0.5)
        with httpx.Client(base_url=base, timeout=600) as client:
            # Warm: the grammar backend and its compile worker exist before anything is timed.
            client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "guided_regex": "[ab]+"})
            rss_start = rss_mib(server.pid)
            idle = latencies(client, args.rounds)
            rss_after_idle = rss_mib(server.pid)
            stop = threading.Event()
            outcomes: list[int] = []

            def hog(n: int) -> None:
                with httpx.Client(base_url=base, timeout=600) as own:
                    k = 0
                    while not stop.is_set():
                        body = {"prompt": "pick", "max_tokens": 2, "guided_choice": max_choice(f"hog{n}-{k}")}
                        outcomes.append(own.post("/v1/completions", json=body).status_code)
                        k += 1

            hogs = [threading.Thread(target=hog, args=(n,), daemon=True) for n in range(args.hogs)]
            for t in hogs:
                t.start()
            time.sleep(2.0)  # the pool is busy (and its queue filling) before anything is timed
            busy = latencies(client, args.rounds)
            stop.set()
            for t in hogs:
                t.join(600)
            print(
                json.dumps(
                    {
                        "idle": idle,
                        "while_compiling": busy,
                        "ratios": {k: busy[k] / idle[k] for k in idle},
                        "hog_statuses": {str(s): outcomes.count(s) for s in sorted(set(outcomes))},
                    }
                )
            )
            rss_after_hogs = rss_mib(server.pid)
            statuses: list[int] = []
            for i in range(50):
                schema = {
                    "type": "object",
                    "properties": {
                        f"field_{i}_{j}": {"type": "string", "enum": [f"value {i} {j} {k}" for k in range(20)]}
                        for j in range(60)
                    },
                    "required": [f"field_{i}_0"],
                }
                body = {"prompt": "x", "max_tokens": 2, "guided_json": schema}
                statuses.append(client.post("/v1/completions", json=body).status_code)
            rss_per_maximal = []  # the bound: the cache keeps max_cache_bytes of them, whatever the count
            for i in range(args.maximal):
                body = {"prompt": "pick", "max_tokens": 2, "guided_choice": max_choice(f"seq{i}")}
                statuses.append(client.post("/v1/completions", json=body).status_code)
                rss_per_maximal.append(round(rss_mib(server.pid), 1))
            print(
                json.dumps(
                    {
                        "server_rss_mib_after_each_further_maximal_choice": rss_per_maximal,
                        "server_rss_mib_start": round(rss_start, 1),
                        "server_rss_mib_after_idle_latencies": round(rss_after_idle, 1),
                        "server_rss_mib_after_maximal_choices": round(rss_after_hogs, 1),
                        "server_rss_mib_after_50_schemas": round(rss_mib(server.pid), 1),
                        "schema_statuses": {str(s): statuses.count(s) for s in sorted(set(statuses))},
                        "compile_worker_rss_mib": workers_rss_mib(server.pid),
                    }
                )
            )
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main()
