"""Which sockets a kvserve command listens on, and on which addresses: the process and all its descendants (Ray's
GCS, raylet, workers and agents with --data-parallel-size > 1), read from the OS with psutil once the server
answers /health. docs/RELIABILITY.md's socket list and docs/SCALE_OUT.md's ports come from it.

    python scripts/listening_sockets.py --port 8011 -- kvserve serve --port 8011 --data-parallel-size 2
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from collections import defaultdict

import httpx
import psutil


def _wait_healthy(proc: subprocess.Popen[bytes], port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the command exited with {proc.returncode} before answering /health")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"no /health on port {port} after {timeout:.0f} s")


def _name(process: psutil.Process) -> str:
    """A short name: Ray names its Python processes in their command line (ray::..., raylet's agents)."""
    try:
        cmd = process.cmdline()
    except psutil.Error:
        return "?"
    if not cmd:
        return process.name()
    head = cmd[0].rsplit("/", 1)[-1]
    if head.startswith("python") and len(cmd) > 1:
        script = next((c for c in cmd[1:] if not c.startswith("-")), cmd[1])
        if script == "kvserve.cli" or script.endswith("/kvserve"):
            return "kvserve (ingress)"
        return script.rsplit("/", 1)[-1]
    return head


def listening(root: psutil.Process) -> list[tuple[str, str, int]]:
    """(process, address, port) for every listening TCP socket of `root` and its descendants."""
    found = []
    for process in [root, *root.children(recursive=True)]:
        try:
            connections = process.net_connections(kind="inet")
        except psutil.Error:
            continue
        for c in connections:
            if c.status == psutil.CONN_LISTEN:
                found.append((_name(process), c.laddr.ip, c.laddr.port))
    return sorted(set(found))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True, help="the command's HTTP port, for /health")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    proc = subprocess.Popen(command)
    try:
        _wait_healthy(proc, args.port, args.timeout)
        time.sleep(3)  # Ray's agents finish starting after the replicas answer
        sockets = listening(psutil.Process(proc.pid))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    by_scope: dict[str, list[str]] = defaultdict(list)
    for name, ip, port in sockets:
        wildcard = ip in ("0.0.0.0", "::")
        loopback = ip.startswith("127.") or ip == "::1"
        scope = "loopback" if loopback else "every interface" if wildcard else "one interface"
        by_scope[scope].append(f"{name} {ip}:{port}")
    print(f"{len(sockets)} listening sockets of `{' '.join(command)}` and its descendants")
    for scope in ("loopback", "one interface", "every interface"):
        print(f"\n{scope} ({len(by_scope[scope])}):")
        for line in by_scope[scope]:
            print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
