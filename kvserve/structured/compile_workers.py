"""xgrammar compiles in worker processes, so that a compile can be bounded in time and abandoned.

Why processes: a compile is C++ that a thread cannot interrupt, and a hostile constraint compiles for minutes. A
worker process holds its own xgrammar compiler over the server's vocabulary (sent once, as xgrammar's serialized
TokenizerInfo: ~0.4 s to load for a 262k vocabulary, against ~2.5 s to build), compiles one constraint at a time
and sends the compiled grammar back serialized (a JSON schema: ~0.2 MB, 20 ms out, 8 ms in). A compile over its
time budget, or one whose client has gone, kills its worker: the slot is free at once, and a fresh worker is
started for the next compile. The compile's own memory (xgrammar's working state) lives and dies with the
worker, not in the server.

Workers are their own `python -m kvserve.structured.compile_workers` processes on two pipes (not multiprocessing's
spawn, which re-imports the parent's main script: a user's script without a __main__ guard would run again; and not
fork: the server has threads), started lazily and kept idle between compiles; `close()` kills them all.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvserve.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

_POLL_S = 0.05  # how often a waiting compile looks at its deadline and its client
_START_TIMEOUT_S = 120.0
# Compiles are background work beside the engine: at normal priority a worker took a core from the decode (an
# ordinary completion 2.2-3.7x slower while maximal grammars compiled, 2 cores, scripts/measure_grammar_isolation.py);
# at nice 10 the scheduler gives the engine's threads their cores first, and the compile what is left.
WORKER_NICENESS = 10


class CompileTimeout(Exception):
    """The compile ran past its budget; its worker was killed."""


class CompileAbandoned(Exception):
    """The compile's caller gave up (its future was cancelled); its worker was killed."""


def _worker_main(requests: Connection, replies: Connection) -> None:
    """A worker: load the vocabulary it is sent first, then compile each constraint it is sent; reply ("ok",
    serialized grammar) or ("error", message). Ends when its parent closes the pipe."""
    os.nice(WORKER_NICENESS)
    import xgrammar as xgr

    from kvserve.structured.backend import return_freed_heap, xgrammar_compile

    info = xgr.TokenizerInfo.deserialize_json(requests.recv())
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    replies.send(("ready", ""))
    while True:
        try:
            params = requests.recv()
        except EOFError:
            return
        try:
            replies.send(("ok", xgrammar_compile(compiler, params).serialize_json()))
        except (RuntimeError, ValueError, TypeError) as e:
            replies.send(("error", str(e)))
        return_freed_heap()  # the compile's working state, freed: back to the OS before the next one


@dataclass(slots=True, eq=False)
class _Worker:
    process: subprocess.Popen[bytes]
    requests: Connection
    replies: Connection

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(5)
        self.requests.close()
        self.replies.close()


class CompileWorkers:
    """Idle worker processes, and the compiles that borrow them (one compile per worker at a time; the caller
    bounds how many run at once, GrammarCompiler's compile threads)."""

    def __init__(self, tokenizer_info_json: Callable[[], str]) -> None:
        self._tokenizer_info_json = tokenizer_info_json  # made once, on first need
        self._info: str | None = None
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._lock = threading.Lock()
        self.num_started = 0  # workers started so far (tests; a killed one is replaced by a new one)

    def compile(self, params: StructuredOutputsParams, timeout_s: float, future: Future[Any] | None = None) -> str:
        """The serialized compiled grammar of `params`. Raises CompileTimeout after `timeout_s` of compiling,
        CompileAbandoned once `future` is cancelled, RuntimeError with xgrammar's message when it refuses the
        constraint. Startup of a fresh worker does not count against the budget."""
        worker = self._take()
        try:
            worker.requests.send(params)
            deadline = time.monotonic() + timeout_s
            while not worker.replies.poll(_POLL_S):
                if future is not None and future.cancelled():
                    raise CompileAbandoned()
                if time.monotonic() > deadline:
                    raise CompileTimeout()
                if worker.process.poll() is not None:
                    raise RuntimeError(f"the grammar compile worker died (exit code {worker.process.returncode})")
            status, payload = worker.replies.recv()
        except BaseException:
            with self._lock:
                self._busy.discard(worker)
            worker.kill()
            raise
        self._give_back(worker)
        if status != "ok":
            raise RuntimeError(payload)
        return str(payload)

    def close(self) -> None:
        """Kill every worker, idle or compiling (a compile in flight then fails at once). Later compiles start new
        ones."""
        with self._lock:
            workers = [*self._idle, *self._busy]
            self._idle, self._busy = [], set()
        for worker in workers:
            worker.kill()

    def _take(self) -> _Worker:
        with self._lock:
            worker = self._idle.pop() if self._idle else None
        worker = worker if worker is not None else self._start()
        with self._lock:
            self._busy.add(worker)
        return worker

    def _give_back(self, worker: _Worker) -> None:
        with self._lock:
            self._busy.discard(worker)
            self._idle.append(worker)

    def _start(self) -> _Worker:
        with self._lock:
            if self._info is None:
                self._info = self._tokenizer_info_json()
            info = self._info
            self.num_started += 1
        to_child, from_parent = os.pipe()
        to_parent, from_child = os.pipe()
        process = subprocess.Popen(
            [sys.executable, "-m", "kvserve.structured.compile_workers", str(to_child), str(from_child)],
            pass_fds=(to_child, from_child),
            stdin=subprocess.DEVNULL,
        )
        os.close(to_child)
        os.close(from_child)
        worker = _Worker(process, Connection(from_parent, readable=False), Connection(to_parent, writable=False))
        # Its start (xgrammar's import, the vocabulary: seconds) is not budgeted, but bounded.
        try:
            worker.requests.send(info)
            started = worker.replies.poll(_START_TIMEOUT_S)
            if started:
                worker.replies.recv()
        except (OSError, EOFError):
            started = False
        if not started:
            worker.kill()
            raise RuntimeError(f"the grammar compile worker failed to start (exit code {process.poll()})")
        return worker


if __name__ == "__main__":
    _worker_main(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False))
