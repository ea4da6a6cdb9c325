"""What the KV inspector's routes and stream hub use of an engine, so that they serve one process's AsyncLLMEngine and
each replica of `--data-parallel-size N` (through kvserve/cluster/kv_view.py) with the same code.

Why Protocols rather than the AsyncLLMEngine type: a replica's engine lives in another process, and the ingress reaches
it through a stand-in with exactly these members; the server never imports the cluster package (nor Ray) to know it.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from kvserve.engine.core import EngineCore
    from kvserve.engine.kv_publisher import KVPublication


class KVSource(Protocol):
    """A KV publisher as its readers see it: KVPublisher itself, or the ingress's proxy of a replica's one."""

    @property
    def published(self) -> KVPublication:
        """The latest publication; readers poll it (a plain attribute read, safe on the event loop)."""

    def watch(self) -> AbstractContextManager[None]:
        """While inside, snapshots are published (on the event loop for a proxy, which starts following then)."""

    async def latest(self) -> KVPublication:
        """The latest publication now, watched or not (a proxy asks its replica)."""


class InspectedEngine(Protocol):
    """One engine whose KV cache the inspector shows."""

    @property
    def kv_publisher(self) -> KVSource: ...

    @property
    def is_running(self) -> bool: ...

    def check_alive(self) -> None:
        """Raise EngineDeadError (or ServerShuttingDownError) when the engine cannot answer."""

    def call(self, fn: Callable[[EngineCore], Any]) -> concurrent.futures.Future[Any]:
        """Run `fn(engine)` on the engine thread between steps (`fn` must pickle for a replica)."""


@runtime_checkable
class InspectedReplicas(Protocol):
    """An engine client made of several engines (a ClusterEngine): the inspector shows one at a time."""

    def kv_views(self, include_tokens: bool) -> dict[str, InspectedEngine]:
        """Each replica's stand-in by name, in the replicas' order; `include_tokens` False redacts token ids."""
