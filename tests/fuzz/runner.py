"""The differential fuzzer's runner: a workload (tests/fuzz/workload.py) through an engine with every cache layer on,
each request checked against the same prompt run alone with every cache off, and the cache invariants checked after
every step.

What counts as a failure (`Failure`), each named by its kind:
- `divergence`: a sample's greedy tokens differ from the reference's, or a token's logprob differs by more than
  LOGPROB_TOL (a differing token whose reference logprob is within TIE_TOL of the reference's choice is a tie of the
  arithmetic, not of the cache: the rest of that sample is not compared);
- `error`: a request finished with an error, or the engine raised;
- `invariant`: the pool's and state slots' invariants (EngineCore.check_invariants) after a step; the state-copy
  rule before each forward pass (a snapshot slot named by the step's saves is that save's alone, and no restore reads
  a slot the step writes); a pin released for a live request freed no block; after a round, blocks or slots still held;
- `hang`: a round's engine computed nothing for STALL_STEPS steps and STALL_SECONDS (a restore from disk may keep a
  request waiting while the loader thread works: steps alone, on a loaded host, are no measure); the failure says
  what was waiting on what.

Tolerances: float32 KV: LOGPROB_TOL 2e-3 nats (chunked prefill and decode sum in another order than a whole
prompt's single pass); 8-bit KV: 5e-2 (a chunk's queries read the earlier chunks' K/V back quantized, a whole-prompt
pass reads them as computed). TIE_TOL equals LOGPROB_TOL.
"""

from __future__ import annotations

import random
import shutil
import tempfile
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiny_models import build_tiny_hf_model
from tiny_tokenizer import write_char_tokenizer

from kvserve.engine.engine import LLMEngine
from kvserve.kv.offload.store_dir import RECORD_SUFFIX
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import KVPin, SamplingParams

from .workload import MAX_MODEL_LEN, RequestSpec, Transcript, Workload

LOGPROB_TOL = {"auto": 2e-3, "int8": 5e-2, "fp8": 5e-2}
STALL_STEPS = 3000
STALL_SECONDS = 120.0
RETENTION_S = 3600.0


@dataclass(frozen=True, slots=True)
class Failure:
    kind: str
    message: str
    request: int | None = None  # the workload index of the request it concerns, if one

    def __str__(self) -> str:
        who = "" if self.request is None else f"request {self.request}: "
        return f"{self.kind}: {who}{self.message}"


class FuzzFailure(Exception):
    def __init__(self, failure: Failure) -> None:
        super().__init__(str(failure))
        self.failure = failure


@dataclass(slots=True)
class Clock:
    """The injected clock of pins and evictions: moved on by the runner, never by wall time."""

    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass(slots=True)
class Reference:
    """Greedy ids and logprobs of a prompt run alone with every cache off: an engine per (model, KV dtype) without
    prefix caching, tier or speculation, a whole prompt in one step. Results are kept by (prompt, params)."""

    engines: dict[tuple[str, str], LLMEngine] = field(default_factory=dict)
    results: dict[tuple[Any, ...], tuple[list[int], list[dict[int, float]]]] = field(default_factory=dict)

    def run(self, base: LLMEngine, variant: str, kv_dtype: str, prompt: list[int], spec: RequestSpec) -> tuple:
        key = (variant, kv_dtype, tuple(prompt), spec.max_tokens, spec.stop)
        if key not in self.results:
            engine = self.engines.get((variant, kv_dtype))
            if engine is None:
                engine = self.engines[(variant, kv_dtype)] = base.sibling(kv_cache_dtype=kv_dtype)
            engine.add_request("ref", prompt, params_for(spec, reference=True))
            out = None
            while engine.has_unfinished_requests():
                for o in engine.step():
                    if o.finished:
                        out = o
            assert out is not None and out.error is None, f"the reference run failed: {out and out.error}"
            sample = out.outputs[0]
            self.results[key] = (list(sample.token_ids), _logprobs(sample.logprobs))
        return self.results[key]


def _logprobs(entries: list | None) -> list[dict[int, float]]:
    return [{tid: lp.logprob for tid, lp in e.items()} for e in (entries or [])]


def params_for(spec: RequestSpec, reference: bool = False) -> SamplingParams:
    """Greedy, every token up to max_tokens (EOS ignored), top-2 logprobs; the cache fields only for the engine under
    test."""
    kw: dict[str, Any] = dict(temperature=0.0, max_tokens=spec.max_tokens, ignore_eos=True, logprobs=2)
    if spec.stop:
        kw["stop"] = list(spec.stop)
    if not reference:
        kw["n"] = spec.n
        if spec.pin_tokens:
            kw["kv_pins"] = tuple(KVPin(t, spec.pin_ttl) for t in spec.pin_tokens)
        if spec.retain:
            kw["prompt_cache_retention_s"] = RETENTION_S
    return SamplingParams(**kw)


class Models:
    """Tiny checkpoints, one per variant, built once per process; each with a base engine (caching off) whose model the
    engines under test share (LLMEngine.sibling)."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="kvserve-fuzz-models-"))
        self.bases: dict[str, LLMEngine] = {}

    def base(self, variant: str) -> LLMEngine:
        if variant not in self.bases:
            from kvserve.config import EngineConfig

            path = self.root / variant
            build_tiny_hf_model(variant).save_pretrained(path)
            write_char_tokenizer(path)
            config = EngineConfig.parse(
                model=str(path),
                num_gpu_blocks_override=256,
                block_size=4,
                max_model_len=MAX_MODEL_LEN,
                max_num_batched_tokens=MAX_MODEL_LEN,
                max_num_seqs=1,
                enable_prefix_caching=False,
            )
            self.bases[variant] = LLMEngine.from_config(config)
        return self.bases[variant]

    def close(self) -> None:
        for engine in self.bases.values():
            engine.close()
        shutil.rmtree(self.root, ignore_errors=True)


def compare(got: list[int], got_lps: list[dict[int, float]], want: list[int], want_lps: list[dict[int, float]],
            tol: float, partial: bool) -> str | None:  # fmt: skip
    """Why a sample's ids and logprobs are not the reference's (None: they agree)."""
    for p, (g, w) in enumerate(zip(got, want)):
        ref = want_lps[p]
        if g != w:
            if g in ref and ref[w] - ref[g] <= tol:
                return None  # a tie within the arithmetic's tolerance: the rest may differ
            return f"token {p}: got {g}, want {w} (reference logprobs {ref})"
        if p < len(got_lps) and abs(got_lps[p][g] - ref[w]) > tol:
            return f"token {p} ({g}): logprob {got_lps[p][g]:.5f}, reference {ref[w]:.5f} (tolerance {tol})"
    if len(got) > len(want) or (not partial and len(got) != len(want)):
        return f"{len(got)} tokens, reference {len(want)}: got {got}, want {want}"
    return None


@contextmanager
def checked_state_copies(engine: LLMEngine, failures: list[Failure]) -> Iterator[None]:
    """Check, before each forward pass, the rule of state snapshot slots: each save planned for the step writes a slot
    reserved for its snapshot alone (still pending, mapped to that slot), and no restore of the step reads a slot the
    step writes. Wraps the runner's execute (the one moment between scheduling and the forward pass)."""
    core = engine.core
    kv = core.kv_manager
    runner = core.runner
    execute = runner.execute
    if kv.state_snapshots is None:
        yield
        return

    def checked(out: Any) -> Any:
        snapshots, state = kv.state_snapshots, kv.state
        assert snapshots is not None and state is not None
        targets = [t for _, t in state.saves]
        if len(set(targets)) != len(targets):
            failures.append(Failure("invariant", f"two state saves of one step write slot(s) {sorted(targets)}"))
        for (_, target), record in zip(state.saves, state.save_records):
            if snapshots.by_hash.get(record.block_hash) != target or record.block_hash not in snapshots.pending:
                failures.append(
                    Failure(
                        "invariant",
                        f"a state save into slot {target} is planned for a snapshot that no longer holds it "
                        f"(now slot {snapshots.by_hash.get(record.block_hash)}): another reservation took the slot",
                    )
                )
        read = {src for src, _ in state.restores} & set(targets)
        if read:
            failures.append(Failure("invariant", f"a restore reads slot(s) {sorted(read)} that the same step writes"))
        loaded = {snapshots.by_hash[h] for h in snapshots.loading} & ({src for src, _ in state.restores} | set(targets))
        if loaded:
            failures.append(Failure("invariant", f"a tier restore writes slot(s) {sorted(loaded)} the step copies"))
        return execute(out)

    runner.execute = checked  # type: ignore[method-assign]
    try:
        yield
    finally:
        runner.execute = execute  # type: ignore[method-assign]


@contextmanager
def checked_pin_releases(engine: LLMEngine, failures: list[Failure]) -> Iterator[None]:
    """Check that pins released so that a live request fits give the pool the blocks it was short of (a pin whose
    blocks running requests hold too frees nothing: releasing it protects nothing and helps no one), and that pins
    refusing to give way were left as they were. The pin table's class is swapped for one that checks (it has slots:
    no attribute to patch)."""
    kv = engine.core.kv_manager
    pins = kv.pins
    cls = type(pins)

    class Checked(cls):  # type: ignore[misc,valid-type]
        __slots__ = ()

        def release_for(self, blocks_short: int, keep: Collection[int] = ()) -> bool:
            before, held = self.pool.num_free_blocks, len(self.pins)
            was_free = {i for i in keep if self.pool.blocks[i].ref_cnt == 0}
            released = super().release_for(blocks_short, keep)
            # The request's own hit blocks that a release freed are revived by it at once: they give it nothing.
            own = sum(1 for i in keep if i not in was_free and self.pool.blocks[i].ref_cnt == 0)
            gained = self.pool.num_free_blocks - before - own
            if released and gained < blocks_short:
                failures.append(
                    Failure("invariant", f"pins released for a request {blocks_short} blocks short freed {gained}")
                )
            if not released and len(self.pins) != held:
                failures.append(Failure("invariant", "pins were released for a request that still did not fit"))
            return released

        def release_oldest(self) -> bool:  # the rule before release_for (kvserve be018a6): one pin a call
            before = self.pool.num_free_blocks
            released = super().release_oldest()
            if released and self.pool.num_free_blocks == before:
                failures.append(Failure("invariant", "a pin was released for a live request but freed no block"))
            return released

    pins.__class__ = Checked
    try:
        yield
    finally:
        pins.__class__ = cls


class Run:
    """One workload through one engine under test (rebuilt over the same tier directory on a restart)."""

    def __init__(self, workload: Workload, models: Models, reference: Reference, step_checks: bool = True) -> None:
        self.workload = workload
        self.step_checks = step_checks  # the state-copy and pin-release checks (off: only outputs and the pool)
        self.models = models
        self.reference = reference
        self.settings = workload.settings
        self.clock = Clock()
        self.tier_dir = Path(tempfile.mkdtemp(prefix="kvserve-fuzz-tier-")) if self.settings.tier == "disk" else None
        self.engine: LLMEngine | None = None
        self.failures: list[Failure] = []
        self.transcript = Transcript()
        self.steps = 0
        self.rng = random.Random(workload.seed * 7919 + 1)

    def _start(self) -> LLMEngine:
        kw = self.settings.engine_kwargs()
        if self.tier_dir is not None:
            kw["kv_offloading_path"] = str(self.tier_dir)
        engine = self.models.base(self.settings.variant).sibling(enable_prefix_caching=True, **kw)
        engine.core.pool.clock = self.clock
        engine.core.kv_manager.pins.clock = self.clock
        return engine

    def _stop(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def _flush_tier(self) -> None:
        core = self.engine.core if self.engine is not None else None
        if core is None:
            return
        for tier in (core.offload, core.state_offload):
            if tier is not None:
                tier.flush()

    def _damage_tier(self, delete: int, damage: int) -> None:
        if self.tier_dir is None:
            return
        records = sorted(self.tier_dir.glob(f"*/blocks/*/*{RECORD_SUFFIX}"))
        self.rng.shuffle(records)
        for path in records[:delete]:
            path.unlink(missing_ok=True)
        for path in records[delete : delete + damage]:
            data = bytearray(path.read_bytes())
            if data:
                data[self.rng.randrange(len(data))] ^= 0x5A
                path.write_bytes(bytes(data))

    def run(self) -> list[Failure]:
        try:
            self.engine = self._start()
            for r, events in enumerate(self.workload.events):
                if r:
                    self._between_rounds(events)
                self._round(r)
                if self.failures:
                    break
        except FuzzFailure as e:
            self.failures.append(e.failure)
        except Exception as e:  # noqa: BLE001 -- the engine raising is a finding, reported with the seed
            self.failures.append(Failure("error", f"{type(e).__name__}: {e}"))
        finally:
            self._stop()
            if self.tier_dir is not None:
                shutil.rmtree(self.tier_dir, ignore_errors=True)
        return self.failures

    def _between_rounds(self, events: Any) -> None:
        self.clock.now += events.advance_clock
        if events.restart or events.delete_records or events.damage_records:
            self._flush_tier()
        if events.restart:
            self._stop()
        self._damage_tier(events.delete_records, events.damage_records)
        if self.engine is None:
            self.engine = self._start()

    def _round(self, r: int) -> None:
        engine = self.engine
        assert engine is not None
        specs = sorted((s for s in self.workload.requests if s.round == r), key=lambda s: (s.arrival, s.index))
        if not specs:
            return
        outputs: dict[int, RequestOutput] = {}
        aborted: set[int] = set()
        live: dict[int, int] = {}  # index -> the step it was added
        step = 0
        last_computed, stalled_since, stall_steps = engine.core.step_tokens_total, time.monotonic(), 0
        with ExitStack() as checks:
            if self.step_checks:
                checks.enter_context(checked_state_copies(engine, self.failures))
                checks.enter_context(checked_pin_releases(engine, self.failures))
            while specs or live or engine.has_unfinished_requests():  # the last: an aborted request's restore
                while specs and specs[0].arrival <= step:
                    spec = specs.pop(0)
                    prompt = self.transcript.prompt_of(spec)
                    self.transcript.prompts[spec.index] = prompt
                    engine.add_request(str(spec.index), prompt, params_for(spec), cache_salt=spec.salt)
                    live[spec.index] = step
                for index, added in list(live.items()):
                    spec = self._spec(index)
                    if spec.abort_after is not None and step - added >= spec.abort_after:
                        out = engine.abort_request(str(index))
                        if out is not None:
                            outputs[index] = out
                            aborted.add(index)
                        del live[index]
                for out in engine.step():
                    index = int(out.request_id)
                    outputs[index] = out
                    if out.finished:
                        live.pop(index, None)
                self.steps += 1
                self.clock.now += self.workload.clock_step
                engine.check_invariants()
                step += 1
                if self.failures:
                    return
                computed = engine.core.step_tokens_total
                if computed != last_computed:
                    last_computed, stalled_since, stall_steps = computed, time.monotonic(), 0
                stall_steps += 1
                if stall_steps > STALL_STEPS and time.monotonic() - stalled_since > STALL_SECONDS:
                    raise FuzzFailure(
                        Failure("hang", f"round {r}: nothing computed for {stall_steps} steps; {_waits(engine)}")
                    )
        self._idle_checks(engine, r)
        for index, out in sorted(outputs.items()):
            self._check_output(self._spec(index), out, index in aborted)

    def _spec(self, index: int) -> RequestSpec:
        return next(s for s in self.workload.requests if s.index == index)

    def _idle_checks(self, engine: LLMEngine, r: int) -> None:
        """After a round nothing is held but pins: every block back in the pool or pinned, every state slot free, no
        restore in flight."""
        core = engine.core
        kv = core.kv_manager
        held = kv.pool.num_usable_blocks - kv.pool.num_free_blocks
        pinned = kv.pins.num_pinned_blocks
        if kv.requests or held != pinned:
            raise FuzzFailure(Failure("invariant", f"after round {r}: {held} blocks held, {pinned} of them pinned"))
        if kv.state_slots is not None and kv.state_slots.held:
            raise FuzzFailure(Failure("invariant", f"after round {r}: state slots held by {kv.state_slots.held}"))
        connector = core.scheduler.offload
        if connector is not None and connector.loads:
            raise FuzzFailure(Failure("invariant", f"after round {r}: restores in flight {list(connector.loads)}"))

    def _check_output(self, spec: RequestSpec, out: RequestOutput, aborted: bool) -> None:
        if out.error is not None:
            raise FuzzFailure(Failure("error", out.error, spec.index))
        prompt = self.transcript.prompts[spec.index]
        want, want_lps = self.reference.run(
            self.models.base(self.settings.variant), self.settings.variant, self.settings.kv_cache_dtype, prompt, spec
        )
        tol = LOGPROB_TOL[self.settings.kv_cache_dtype]
        for sample in out.outputs:
            got = list(sample.token_ids)
            why = compare(got, _logprobs(sample.logprobs), want, want_lps, tol, partial=aborted)
            if why is not None:
                detail = (
                    f"sample {sample.index}: {why}; prompt of {len(prompt)} tokens, {out.num_cached_tokens} cached "
                    f"({out.num_restored_tokens} restored)"
                )
                raise FuzzFailure(Failure("divergence", detail, spec.index))
        if not aborted:
            self.transcript.replies[spec.index] = list(out.outputs[0].token_ids)


def replay_command(seed: int, variant: str | None, only: frozenset[int] | None) -> str:
    cmd = f"python -m tests.fuzz --seed {seed}"
    if variant:
        cmd += f" --variant {variant}"
    if only is not None:
        cmd += f" --only {','.join(map(str, sorted(only)))}"
    return cmd


def _waits(engine: LLMEngine) -> str:
    """What a stalled engine's requests wait on: the queues, restores in flight, free blocks and state slots."""
    core = engine.core
    sched = core.scheduler
    loads = {} if sched.offload is None else {rid: load.done() for rid, load in sched.offload.loads.items()}
    slots = core.kv_manager.state_slots
    return (
        f"waiting {[r.request_id for r in sched.waiting]}, running {[r.request_id for r in sched.running]}, "
        f"restores in flight (done?) {loads}, {core.pool.num_free_blocks} free blocks, "
        f"{'-' if slots is None else slots.num_free} free state slots"
    )


def run_workload(workload: Workload, models: Models, reference: Reference, step_checks: bool = True) -> list[Failure]:
    return Run(workload, models, reference, step_checks).run()


def shrink(
    workload: Workload,
    models: Models,
    reference: Reference,
    progress: Callable[[str], None] = lambda _: None,
    step_checks: bool = True,
) -> tuple[frozenset[int], list[Failure]]:
    """The fewest requests of a failing workload that still fail (greedy one-at-a-time removal, repeated until no
    request can go), and their failures."""
    keep = {s.index for s in workload.requests}
    failures = run_workload(workload, models, reference, step_checks)
    changed = True
    while changed and failures:
        changed = False
        for index in sorted(keep, reverse=True):
            trial = frozenset(keep - {index})
            if not trial:
                continue
            found = run_workload(workload.keep(trial), models, reference, step_checks)
            if found:
                keep, failures, changed = set(trial), found, True
                progress(f"shrunk to {len(keep)} requests")
    return frozenset(keep), failures
