"""Grammar compiles within --structured-outputs-config's budgets (structured/config.py): a constraint over
max_grammar_bytes is refused before any compile, an xgrammar compile past max_compile_seconds is killed (its worker
process replaced), a cancelled one is abandoned at once, and the compile queue is bounded. On the 256-token
character vocabulary, a choice of 20,000 strings takes ~12 s to compile: the slow constraint here."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from kvserve.model.tokenizer import Tokenizer
from kvserve.structured.backend import GrammarCompileError, GrammarCompileLimit
from kvserve.structured.compiler import GrammarBusy, GrammarCompiler
from kvserve.structured.config import StructuredOutputsConfig, parse_structured_outputs_config
from kvserve.structured.params import StructuredOutputsParams

SLOW = StructuredOutputsParams(choice=[f"option {i} of many, x{i * 7919 % 1000003}" for i in range(20_000)])
QUICK = StructuredOutputsParams(regex="[a-c]{1,5}")


def compiler(tiny_tokenizer: Tokenizer, **budgets: object) -> GrammarCompiler:
    config = StructuredOutputsConfig(**{"max_grammar_bytes": 10 << 20, **budgets})  # type: ignore[arg-type]
    return GrammarCompiler(tiny_tokenizer, 320, [1], backend="xgrammar", config=config)


def wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_a_constraint_over_the_size_budget_is_refused_before_compiling(tiny_tokenizer: Tokenizer) -> None:
    grammar = GrammarCompiler(tiny_tokenizer, 320, [1], config=StructuredOutputsConfig(max_grammar_bytes=1000))
    with pytest.raises(
        GrammarCompileLimit,
        match=r"structured_outputs.choice: constraint too large: \d+ bytes, over "
        r"max_grammar_bytes 1000 \(--structured-outputs-config\)",
    ):
        grammar.compile(SLOW)
    assert not grammar.is_built  # nothing was built, let alone compiled


def test_a_compile_past_its_time_budget_is_killed_and_the_next_one_runs(tiny_tokenizer: Tokenizer) -> None:
    grammar = compiler(tiny_tokenizer, max_compile_seconds=0.5)
    try:
        grammar.compile(QUICK)  # starts the worker: its start is not budgeted
        with pytest.raises(GrammarCompileLimit, match="compile took too long: stopped after max_compile_seconds 0.5"):
            grammar.compile(SLOW)
        assert grammar.lookup(SLOW) is None  # nothing half-made is cached
        assert grammar.compile(StructuredOutputsParams(regex="x+")).kind.value == "regex"  # on a fresh worker
        assert grammar.backend._workers.num_started == 2  # type: ignore[attr-defined]
    finally:
        grammar.close()


def test_a_cancelled_compile_frees_its_slot_at_once(tiny_tokenizer: Tokenizer) -> None:
    grammar = compiler(tiny_tokenizer, max_compile_seconds=60, max_concurrent_compiles=1, max_queued_compiles=0)
    try:
        grammar.compile(QUICK)
        running: Future = grammar.compile_async(SLOW)
        with pytest.raises(GrammarBusy, match="max_concurrent_compiles \\+ max_queued_compiles = 1"):
            grammar.compile_async(StructuredOutputsParams(regex="y+"))
        time.sleep(0.5)  # it is compiling now
        assert running.cancel()  # still pending for its caller while it runs: cancel() works
        wait_for(lambda: not grammar._jobs)  # the job saw it and stopped, killing its worker
        quick = grammar.compile_async(StructuredOutputsParams(regex="z+"))
        assert quick.result(timeout=60).kind.value == "regex"
    finally:
        grammar.close()


def test_close_stops_a_running_compile_at_once(tiny_tokenizer: Tokenizer) -> None:
    """What a server's shutdown does: no compile in flight holds the process (a hostile run saw a 25-31 s exit)."""
    before = set(threading.enumerate())  # other tests' engines (the session's) have compile threads of their own
    grammar = compiler(tiny_tokenizer, max_compile_seconds=60)
    grammar.compile(QUICK)
    running = grammar.compile_async(SLOW)
    wait_for(lambda: grammar.num_compiles_in_flight == 1)
    ours = {t for t in threading.enumerate() if t.name.startswith("kvserve-grammar")} - before
    assert ours  # what the check below watches
    grammar.close()
    wait_for(lambda: running.done(), timeout=10)
    assert running.cancelled()
    # The compile thread is let go at once (its worker killed under it): nothing is left for the exit to join.
    wait_for(lambda: not any(t.is_alive() for t in ours), timeout=10)


def test_a_refused_constraint_is_a_compile_error_from_the_worker(tiny_tokenizer: Tokenizer) -> None:
    grammar = compiler(tiny_tokenizer)
    try:
        with pytest.raises(GrammarCompileError, match="structured_outputs.grammar: invalid grammar"):
            grammar.compile(StructuredOutputsParams(grammar="root ::= undefined_rule"))
    finally:
        grammar.close()


def test_the_flag_parses_and_checks_its_budgets() -> None:
    assert parse_structured_outputs_config(None) == StructuredOutputsConfig()
    config = parse_structured_outputs_config('{"max_compile_seconds": 2.5, "max_queued_compiles": 0}')
    assert config.max_compile_seconds == 2.5 and config.max_queued_compiles == 0
    with pytest.raises(ValueError, match="max_compile_seconds must be > 0"):
        parse_structured_outputs_config('{"max_compile_seconds": 0}')
    with pytest.raises(ValueError, match="max_grammar_bytes must be an integer"):
        parse_structured_outputs_config('{"max_grammar_bytes": "big"}')
