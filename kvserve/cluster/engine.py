"""N engine replicas on Ray behind the server's one engine interface: what `--data-parallel-size N` serves.

Why the server does not change: ClusterEngine offers what the FastAPI app uses of AsyncLLMEngine (facts,
tokenizer, stats, add_requests returning RequestStreams, abort, call, lifecycle), so every route, field, error,
header, auth rule and transport limit is the single-process server's own code. Each request goes to one replica
(chosen by the router) and its outputs come back as token ids through a Ray streaming generator into an ordinary
RequestStream, which detokenizes them here (the ingress is the replicas' front end; a stop string found here is
sent back to the replica as `stop_sequence`). A poller collects each replica's report (load and prefix-cache
events) every `POLL_INTERVAL_S` and feeds the router's index.

Faults: a replica that dies (or stops answering its report) is marked down and the router forgets its blocks;
Ray restarts it (max_restarts) and it is used again once it reports. A request whose replica died before it
produced any output is sent to another replica; one that had already streamed ends with an error
(EngineFaultError: 500, or an error frame in a stream).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvserve.cluster.kv_view import replica_views
from kvserve.cluster.private_ray import connect_ray
from kvserve.cluster.replica import EngineReplica, ReplicaReport
from kvserve.cluster.router import ReplicaLoad, RequestHasher, RouteDecision, Router
from kvserve.config import EngineConfig
from kvserve.engine.async_engine import (
    EngineDeadError,
    EngineFaultError,
    QueueFullError,
    RequestStream,
    ServerShuttingDownError,
)
from kvserve.engine.facts import EngineFacts
from kvserve.engine.output_processor import RequestState
from kvserve.engine.stats import EngineStats
from kvserve.sampling_params import SamplingParams
from kvserve.structured.compiler import GrammarCompiler

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

    from kvserve.engine.core import EngineCore
    from kvserve.engine.inspected import InspectedEngine
    from kvserve.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.05  # how often the ingress collects reports: the router's index lags the engines by this
REPORT_TIMEOUT_S = 10.0  # a replica that does not report within this is treated as down
START_TIMEOUT_S = 600.0  # a replica loads its model (first start: dequantize, compile) within this
SHUTDOWN_TIMEOUT_S = 30.0


@dataclass(slots=True)
class ReplicaState:
    """The ingress's view of one replica."""

    name: str
    handle: Any  # a Ray ActorHandle of EngineReplica
    stats: EngineStats
    up: bool = True
    pending: int = 0  # sequences sent since its last report (not yet in its num_waiting)

    @property
    def load(self) -> ReplicaLoad:
        return ReplicaLoad(self.stats.num_running, self.stats.num_waiting + self.pending, self.stats.kv_cache_usage)


@dataclass(slots=True)
class _Flight:
    """A request in flight: its stream, the replica serving it, and the task pumping its outputs."""

    stream: RequestStream
    replica: str | None = None
    task: asyncio.Task | None = None
    tried: set[str] = field(default_factory=set)


class ClusterEngine:
    """Replicas of one model on Ray, served as one engine. Build with `launch`."""

    def __init__(
        self,
        replicas: list[ReplicaState],
        facts: EngineFacts,
        tokenizer: Tokenizer,
        grammar: GrammarCompiler,
        router: Router,
        max_queued_requests: int,
        owns_ray: bool,
    ) -> None:
        self.replicas = {r.name: r for r in replicas}
        self.facts = facts
        self.tokenizer = tokenizer  # the ingress's own: it is the replicas' front end (text work, on the loop)
        self.grammar = grammar  # the ingress's own, for the server to fail a bad constraint fast
        self.router = router
        self.max_queued_requests = max_queued_requests
        self.decisions: dict[tuple[str, str], int] = {}  # (policy, reason) -> count, for the metrics
        self._owns_ray = owns_ray
        self._flights: dict[str, _Flight] = {}
        self._poller: asyncio.Task | None = None
        self._started = False
        self._stopping = False

    # ---- construction ---------------------------------------------------------------------------

    @classmethod
    def launch(
        cls,
        config: EngineConfig,
        num_replicas: int,
        router_policy: str = "prefix_aware",
        ray_address: str | None = None,
        max_queued_requests: int = 1000,
    ) -> ClusterEngine:
        """Start `num_replicas` engines on Ray (a local instance, or the cluster at `ray_address` /
        $RAY_ADDRESS), wait until each has loaded the model, and load the tokenizer here for the server."""
        import ray

        from kvserve.model.source import resolve_model
        from kvserve.model.tokenizer import load_tokenizer

        if num_replicas < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {num_replicas}")
        owns_ray = connect_ray(ray_address, include_dashboard=False, log_to_driver=True)
        threads = config.cpu_threads or 1
        # --device cuda: one GPU per replica, chosen by Ray (it sets the replica's CUDA_VISIBLE_DEVICES, so the
        # replica's own device is always cuda:0 of what it sees).
        gpus = 1 if config.device.startswith("cuda") else 0
        resources = ray.cluster_resources()
        cpus, cluster_gpus = resources.get("CPU", 0), resources.get("GPU", 0)
        shortfall = (
            f"{num_replicas} replicas of {threads} CPU thread(s) need {num_replicas * threads} CPUs; the Ray "
            f"cluster has {cpus:g}: lower --data-parallel-size or --cpu-threads, or add machines"
            if cpus < num_replicas * threads
            else f"{num_replicas} replicas on --device {config.device} need {num_replicas} GPUs (one each); the "
            f"Ray cluster has {cluster_gpus:g}: lower --data-parallel-size, or add machines"
            if cluster_gpus < num_replicas * gpus
            else None
        )
        if shortfall is not None:
            if owns_ray:
                ray.shutdown()
            raise ValueError(f"{shortfall} (docs/SCALE_OUT.md)")
        # Every thread pool of a replica honours --cpu-threads: torch's and the native kernels' OpenMP read it
        # from the environment at start, and Ray reserves that many CPUs for the replica. SPREAD: replicas go to
        # different machines where the cluster has several (Ray's default packs the head node first), so that
        # they do not share one machine's memory bandwidth while others idle.
        actor: Any = ray.remote(EngineReplica).options(
            num_cpus=threads,
            num_gpus=gpus,
            max_restarts=-1,
            max_task_retries=0,
            max_concurrency=10_000,
            scheduling_strategy="SPREAD",
            runtime_env={
                "env_vars": {"OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "0")}
            },
        )
        replica_config = dataclasses.replace(config, cpu_threads=threads, device="cuda" if gpus else config.device)
        handles: list[Any] = [
            actor.remote(dataclasses.replace(replica_config, data_parallel_rank=rank), max_queued_requests)
            for rank in range(num_replicas)
        ]
        try:
            facts_list = ray.get([h.facts.remote() for h in handles], timeout=START_TIMEOUT_S)
            reports = ray.get([h.report.remote() for h in handles], timeout=START_TIMEOUT_S)
        except Exception:
            for handle in handles:
                ray.kill(handle, no_restart=True)
            if owns_ray:
                ray.shutdown()
            raise
        facts = facts_list[0]
        tokenizer = load_tokenizer(resolve_model(config.model), chat_template=config.chat_template)
        grammar = GrammarCompiler(
            tokenizer,
            facts.logits_width,
            facts.eos_token_ids,
            backend=config.structured_outputs_backend,
            config=config.structured_outputs_config,
        )
        # Replicas on different machines may fit different pools: the server promises what all of them hold.
        facts = dataclasses.replace(facts, num_blocks=min(f.num_blocks for f in facts_list))
        replicas = [ReplicaState(f"replica-{i}", h, r.stats) for i, (h, r) in enumerate(zip(handles, reports))]
        router = Router(router_policy, RequestHasher(facts.block_size, config.prefix_caching_hash_algo))
        logger.info("kvserve: %d replicas on Ray, router %s", num_replicas, router_policy)
        return cls(replicas, facts, tokenizer, grammar, router, max_queued_requests, owns_ray)

    # ---- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start polling the replicas (on the serving event loop)."""
        if not self._started:
            self._started = True
            self._poller = asyncio.get_running_loop().create_task(self._poll())

    def stop(self) -> None:
        """Refuse new requests and end every stream in flight with ServerShuttingDownError (safe on the loop)."""
        self._stopping = True
        for request_id, flight in list(self._flights.items()):
            self._abort_remote(request_id, flight)
            flight.stream.put(ServerShuttingDownError("the server is shutting down"))
            if flight.task is not None:
                flight.task.cancel()

    async def shutdown_async(self, timeout: float = SHUTDOWN_TIMEOUT_S) -> None:
        import ray

        self.stop()
        if self._poller is not None:
            self._poller.cancel()
        handles = [r.handle for r in self.replicas.values()]
        with contextlib.suppress(Exception):
            await asyncio.wait_for(
                asyncio.gather(*(h.shutdown.remote() for h in handles), return_exceptions=True), timeout
            )
        for handle in handles:
            with contextlib.suppress(Exception):
                ray.kill(handle, no_restart=True)
        if self._owns_ray:
            ray.shutdown()

    @property
    def is_running(self) -> bool:
        return not self._stopping and any(r.up for r in self.replicas.values())

    @property
    def error(self) -> BaseException | None:
        return None if self.is_running else EngineDeadError("no replica is up")

    def check_alive(self) -> None:
        if self._stopping:
            raise ServerShuttingDownError("the server is shutting down")
        if not any(r.up for r in self.replicas.values()):
            raise EngineDeadError("no engine replica is up (Ray is restarting them); retry later")

    def stats(self) -> EngineStats:
        """The replicas' stats added up (KV usage and hit rate as the whole fleet's)."""
        return sum_stats(
            [r.stats for r in self.replicas.values() if r.up] or [next(iter(self.replicas.values())).stats]
        )

    def kv_views(self, include_tokens: bool) -> dict[str, InspectedEngine]:
        """The KV inspector's stand-in for each replica, by name (cluster/kv_view.py): the page shows one."""
        return replica_views(self, include_tokens)

    def metric_collectors(self) -> list[Collector]:
        """Per-replica series and the router's decisions, beside the summed engine series."""
        from kvserve.cluster.metrics import ClusterCollector

        return [ClusterCollector(self)]

    # ---- requests -------------------------------------------------------------------------------

    def add_requests(
        self, requests: Sequence[tuple[str, str | list[int]]], params: SamplingParams, cache_salt: str | None = None
    ) -> list[RequestStream]:
        """Route each (request id, prompt) pair to a replica and return its stream; all or none are queued."""
        self.check_alive()
        num_seqs = len(requests) * params.n
        if num_seqs > self.max_queued_requests:
            raise ValueError(
                f"this request asks for {num_seqs} sequences (prompts x n), more than the server "
                f"queues at once (--max-num-queued-reqs {self.max_queued_requests})"
            )
        up = [r for r in self.replicas.values() if r.up]
        queued = sum(r.stats.num_waiting + r.pending for r in up)
        if queued + num_seqs > self.max_queued_requests * len(up):
            raise QueueFullError(
                f"the server is at capacity: {queued} sequences are already waiting and this "
                f"request adds {num_seqs} (--max-num-queued-reqs {self.max_queued_requests} "
                f"per replica); retry later"
            )
        loop = asyncio.get_running_loop()
        streams = []
        for request_id, prompt in requests:
            if request_id in self._flights:
                raise ValueError(f"request id {request_id!r} is already in flight")
            text, token_ids = (None, prompt) if isinstance(prompt, list) else (prompt, self.tokenizer.encode(prompt))
            state = RequestState(self.tokenizer, request_id, text, token_ids, params)
            stream = RequestStream(state, loop, self.abort, self.stop_sequence)
            flight = _Flight(stream)
            self._flights[request_id] = flight
            flight.task = loop.create_task(self._serve(request_id, token_ids, params, cache_salt, flight))
            streams.append(stream)
        return streams

    def abort(self, request_id: str) -> None:
        flight = self._flights.pop(request_id, None)
        if flight is not None:
            self._abort_remote(request_id, flight)
            if flight.task is not None:
                flight.task.cancel()

    def stop_sequence(self, request_id: str, index: int) -> None:
        """A stop string ended sample `index` here (the ingress is the front end): its replica stops it."""
        flight = self._flights.get(request_id)
        replica = self.replicas.get(flight.replica) if flight is not None and flight.replica is not None else None
        if replica is not None and replica.up:
            with contextlib.suppress(Exception):
                replica.handle.stop_sequence.remote(request_id, index)

    def call(self, fn: Callable[[EngineCore], Any]) -> concurrent.futures.Future:
        """Run `fn(engine)` on the first replica that is up (diagnosis)."""
        replica = next((r for r in self.replicas.values() if r.up), None)
        if replica is None:
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.set_exception(EngineDeadError("no engine replica is up"))
            return future
        return replica.handle.call.remote(fn).future()

    # ---- internals ------------------------------------------------------------------------------

    def _route(
        self, token_ids: list[int], cache_salt: str | None, exclude: set[str], cache_key: str | None = None
    ) -> RouteDecision:
        loads = {name: r.load for name, r in self.replicas.items() if r.up and name not in exclude}
        if not loads:
            raise EngineDeadError("no engine replica is up (Ray is restarting them); retry later")
        decision = self.router.choose(token_ids, cache_salt, loads, cache_key)
        key = (self.router.policy, decision.reason)
        self.decisions[key] = self.decisions.get(key, 0) + 1
        return decision

    async def _serve(
        self, request_id: str, token_ids: list[int], params: SamplingParams, cache_salt: str | None, flight: _Flight
    ) -> None:
        """Pump one request's outputs from its replica into its stream; retry elsewhere if the replica dies
        before the first output."""
        from ray.exceptions import RayActorError, RayTaskError

        stream = flight.stream
        try:
            while True:
                try:
                    decision = self._route(token_ids, cache_salt, flight.tried, params.prompt_cache_key)
                except EngineDeadError as e:
                    stream.put(e)
                    return
                replica = self.replicas[decision.replica]
                flight.replica = decision.replica
                flight.tried.add(decision.replica)
                replica.pending += params.n
                produced = False
                try:
                    async for ref in replica.handle.generate.remote(request_id, token_ids, params, cache_salt):
                        output = await ref
                        produced = True
                        stream.put(output)
                    return
                except RayTaskError as e:  # the engine's own error (400, 503 ...), raised in the replica
                    stream.put(_cause(e))
                    return
                except RayActorError as e:
                    self._mark_down(replica, e)
                    if produced:
                        stream.put(EngineFaultError(f"the replica serving this request died: {e}"))
                        return
                    logger.warning("replica %s died before %s started; retrying on another", replica.name, request_id)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug here must still end the stream, never hang it
            logger.exception("request %s failed in the ingress", request_id)
            stream.put(EngineFaultError(f"{type(e).__name__}: {e}"))
        finally:
            self._flights.pop(request_id, None)

    def _abort_remote(self, request_id: str, flight: _Flight) -> None:
        if flight.replica is not None:
            replica = self.replicas.get(flight.replica)
            if replica is not None and replica.up:
                with contextlib.suppress(Exception):
                    replica.handle.abort.remote(request_id)

    def _mark_down(self, replica: ReplicaState, why: BaseException | str) -> None:
        if replica.up:
            logger.warning("replica %s is down (%s); routing around it until it reports again", replica.name, why)
        replica.up = False
        self.router.forget([replica.name])

    async def _poll(self) -> None:
        """One loop per replica: a replica that hangs delays only its own reports."""
        await asyncio.gather(*(self._poll_replica(r) for r in self.replicas.values()))

    async def _poll_replica(self, replica: ReplicaState) -> None:
        while True:
            await self._collect(replica)
            await asyncio.sleep(POLL_INTERVAL_S)

    async def _collect(self, replica: ReplicaState) -> None:
        try:
            report: ReplicaReport = await asyncio.wait_for(replica.handle.report.remote(), REPORT_TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        # Dead, restarting or hung: Ray restarts it, and it comes back when it reports.
        except Exception as e:  # noqa: BLE001 -- any failure of the remote call means the replica is down
            self._mark_down(replica, e)
            return
        if not replica.up:
            logger.info("replica %s is up again", replica.name)
            self.router.forget([replica.name])  # a restarted replica starts with an empty cache
        replica.up = report.running
        replica.stats = report.stats
        replica.pending = 0
        if report.resync is not None:
            self.router.index.replace(replica.name, report.resync)
        for event in report.events:
            self.router.index.apply(replica.name, event)


def _cause(error: BaseException) -> BaseException:
    """The exception raised inside the replica (a ValueError is a 400 here as in one process)."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, BaseException) else EngineFaultError(str(error))


def sum_stats(stats: Sequence[EngineStats]) -> EngineStats:
    """Several engines' stats as one: counts add up; KV usage is the share of all usable blocks in use; the
    hit rate is weighted by each engine's queried tokens."""
    first = stats[0]
    usable = [max(s.num_blocks - 1, 1) for s in stats]
    queries = sum(s.prefix_cache_queries_tokens for s in stats)
    width = max(len(s.spec_decode_num_accepted_tokens_per_pos) for s in stats)
    return EngineStats(
        num_running=sum(s.num_running for s in stats),
        num_waiting=sum(s.num_waiting for s in stats),
        num_blocks=sum(s.num_blocks for s in stats),
        num_free_blocks=sum(s.num_free_blocks for s in stats),
        block_size=first.block_size,
        kv_cache_usage=sum(s.kv_cache_usage * u for s, u in zip(stats, usable)) / sum(usable),
        prefix_cache_queries_tokens=queries,
        prefix_cache_hits_tokens=sum(s.prefix_cache_hits_tokens for s in stats),
        prefix_cache_hit_rate=(
            sum(s.prefix_cache_hit_rate * s.prefix_cache_queries_tokens for s in stats) / queries
            if queries
            else first.prefix_cache_hit_rate
        ),
        num_preemptions=sum(s.num_preemptions for s in stats),
        prompt_tokens_total=sum(s.prompt_tokens_total for s in stats),
        generation_tokens_total=sum(s.generation_tokens_total for s in stats),
        spec_decode_num_drafts=sum(s.spec_decode_num_drafts for s in stats),
        spec_decode_num_draft_tokens=sum(s.spec_decode_num_draft_tokens for s in stats),
        spec_decode_num_accepted_tokens=sum(s.spec_decode_num_accepted_tokens for s in stats),
        spec_decode_num_accepted_tokens_per_pos=tuple(
            sum(
                s.spec_decode_num_accepted_tokens_per_pos[i]
                for s in stats
                if i < len(s.spec_decode_num_accepted_tokens_per_pos)
            )
            for i in range(width)
        ),
        iteration_tokens_counts=tuple(
            sum(counts) for counts in zip(*(s.iteration_tokens_counts for s in stats if s.iteration_tokens_counts))
        ),
        iteration_tokens_sum=sum(s.iteration_tokens_sum for s in stats),
        kv_pinned_prefixes=sum(s.kv_pinned_prefixes for s in stats),
        kv_pinned_blocks=sum(s.kv_pinned_blocks for s in stats),
        kv_pins_created=sum(s.kv_pins_created for s in stats),
        kv_pins_expired=sum(s.kv_pins_expired for s in stats),
        kv_pins_displaced=sum(s.kv_pins_displaced for s in stats),
        kv_pins_refused=sum(s.kv_pins_refused for s in stats),
        prefix_cache_miss_reasons=_sum_pairs(s.prefix_cache_miss_reasons for s in stats),
    )


def _sum_pairs(pairs: Iterable[tuple[tuple[str, int], ...]]) -> tuple[tuple[str, int], ...]:
    """(name, count) pairs of several engines, added up by name (first seen order)."""
    total: dict[str, int] = {}
    for items in pairs:
        for name, count in items:
            total[name] = total.get(name, 0) + count
    return tuple(total.items())
