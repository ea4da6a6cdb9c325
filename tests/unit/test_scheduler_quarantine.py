"""Scheduler fault isolation without a model: after a failed step every request of it is requeued as a suspect
(blocks freed, progress reset, not counted as a preemption); suspects run alone, one per step, until each
samples a token; a suspect that fails alone is the culprit."""

from __future__ import annotations

from test_scheduler import check, make, req

from kvserve.engine.request import RequestStatus
from kvserve.engine.sampler import SampledToken
from kvserve.engine.scheduler import Scheduler


def ids(out) -> list[str]:
    return [s.request.request_id for s in out.scheduled]


def succeed(sched: Scheduler, out) -> None:
    """The step of `out` went well: progress advances and sampled requests get a token (update_from_output)."""
    tokens = {s.request.request_id: [SampledToken(7, None, None, None)] for s in out.scheduled if s.completes_sequence}
    sched.update_from_output(out, tokens)


def test_failed_step_requeues_its_requests_as_suspects_run_alone_in_order():
    sched, pool, kv = make(budget=64)
    for i, n in enumerate((5, 6, 7)):
        sched.add(req(f"r{i}", n, base=10 * i))
    first = sched.schedule()
    assert ids(first) == ["r0", "r1", "r2"]
    assert sched.quarantine(first) == []
    check(sched, pool, kv)
    assert [r.request_id for r in sched.waiting] == ["r0", "r1", "r2"] and not sched.running
    assert pool.num_free_blocks == pool.num_usable_blocks and sched.num_preemptions == 0
    assert all(r.num_computed_tokens == 0 and r.status is RequestStatus.PREEMPTED for r in sched.waiting)
    sched.add(req("late", 4, base=90))
    for expected in ("r0", "r1", "r2"):
        out = sched.schedule()
        assert ids(out) == [expected]
        succeed(sched, out)
        assert expected not in sched.suspects
    out = sched.schedule()  # no suspect left: back to batches, the late request included
    assert ids(out) == ["r0", "r1", "r2", "late"]
    check(sched, pool, kv)


def test_a_suspect_that_fails_alone_is_the_culprit():
    sched, pool, kv = make(budget=64)
    sched.add(req("a", 5))
    sched.add(req("b", 6, base=20))
    out = sched.schedule()
    sched.quarantine(out)
    alone = sched.schedule()
    assert ids(alone) == ["a"]
    assert sched.quarantine(alone) == [alone.scheduled[0].request]
    sched.finish(alone.scheduled[0].request, RequestStatus.FINISHED_ABORTED)  # what the engine does with it
    assert sched.suspects == {"b"}
    out = sched.schedule()
    assert ids(out) == ["b"]
    succeed(sched, out)
    assert not sched.suspects
    check(sched, pool, kv)


def test_a_suspect_stays_suspect_through_its_chunked_prefill():
    sched, pool, kv = make(budget=8, max_len=48)
    sched.add(req("long", 20))
    out = sched.schedule()
    sched.quarantine(out)
    steps = []
    while sched.suspects:
        out = sched.schedule()
        steps.append((ids(out), out.scheduled[0].num_tokens))
        succeed(sched, out)
    assert steps == [(["long"], 8), (["long"], 8), (["long"], 4)]
    check(sched, pool, kv)


def test_a_suspect_preempts_newer_running_requests_when_the_pool_is_short():
    sched, pool, kv = make(num_blocks=6, budget=64, max_len=24)
    sched.add(req("s", 8))
    out = sched.schedule()
    sched.quarantine(out)
    bystander = req("x", 16, base=40)
    sched.running.append(bystander)  # a request admitted outside the failed step, holding 4 of the 6 blocks
    bystander.status = RequestStatus.RUNNING
    assert kv.allocate_slots(bystander, 16)
    bystander.num_computed_tokens = 16
    kv.allocate_slots(req("filler", 4), 4)  # and one more block in use elsewhere
    out = sched.schedule()
    assert ids(out) == ["s"] and out.preempted == [bystander]
    assert sched.num_preemptions == 1  # this one is KV pressure, and counted
