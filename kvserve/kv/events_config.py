"""KVEventsConfig: vLLM's `--kv-events-config` JSON, validated, and the publisher it starts.

Off by default. This module never imports zmq: only an enabled "zmq" publisher loads kv/event_publisher.py, so a
server without the flag pays nothing (not even the import). The wire format is in docs/KV_EVENTS.md.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvserve.json_flags import check_field_types, config_from_json_flag
from kvserve.kv.groups import KVCacheSpec

if TYPE_CHECKING:
    from kvserve.kv.event_publisher import ZmqKVEventPublisher
    from kvserve.kv.events import KVEventBuffer

logger = logging.getLogger(__name__)

PUBLISHERS = ("null", "zmq")
# How each event inside a batch is encoded: "map" (named fields: vLLM after 0.23, since vllm-project/vllm#42892) or
# "array" (positional, what vLLM <= 0.23 sent and older subscribers decode). The batch itself is an array in both.
EVENT_ENCODINGS = ("map", "array")
ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's keys and defaults, plus `event_encoding` (kvserve's: which vLLM generation of the event layout).

    publisher None means what vLLM means: "zmq" when enable_kv_cache_events is true, else "null". endpoint binds
    when it has a wildcard (`*`, `::`) or is ipc:// / inproc://, and connects otherwise (vLLM's rule);
    replay_endpoint (a ROUTER socket, always bound) answers requests for missed batches from the last
    `buffer_steps` batches. hwm is the PUB socket's high-water mark; max_queue_size bounds the events waiting for
    the publisher thread (beyond it they are dropped and counted, the engine thread never waits).

    bind_host (kvserve's) is the interface that the `*` of a tcp endpoint binds. vLLM binds every interface there;
    kvserve binds what the server listens on, so that the events are exactly as reachable as the HTTP API: None
    means the server's `--host` (127.0.0.1 unless asked otherwise; loopback offline), "*" every interface."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    event_encoding: str = "map"
    bind_host: str | None = None

    def __post_init__(self) -> None:
        check_field_types(self, "kv_events_config")
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        checks = [
            (self.publisher in PUBLISHERS, "publisher", f"one of {', '.join(PUBLISHERS)}"),
            (self.endpoint.startswith(ENDPOINT_SCHEMES), "endpoint", f"a ZMQ address ({', '.join(ENDPOINT_SCHEMES)})"),
            (
                self.replay_endpoint is None or self.replay_endpoint.startswith(ENDPOINT_SCHEMES),
                "replay_endpoint",
                f"null or a ZMQ address ({', '.join(ENDPOINT_SCHEMES)})",
            ),
            (self.buffer_steps >= 1, "buffer_steps", ">= 1"),
            (self.hwm >= 0, "hwm", ">= 0 (0: no limit)"),
            (self.max_queue_size >= 1, "max_queue_size", ">= 1"),
            (self.event_encoding in EVENT_ENCODINGS, "event_encoding", f"one of {', '.join(EVENT_ENCODINGS)}"),
            (self.bind_host is None or self.bind_host.strip() != "", "bind_host", "null or an interface address"),
        ]
        for ok, name, expected in checks:
            if not ok:
                raise ValueError(f"kv_events_config {name} must be {expected}, got {getattr(self, name)!r}")

    def listening_on(self, host: str) -> KVEventsConfig:
        """This config as served on `host` (the server's --host): a bind_host not given is that host."""
        return self if self.bind_host is not None else dataclasses.replace(self, bind_host=host)

    @property
    def enabled(self) -> bool:
        """Events leave the process: vLLM publishes only when events are enabled and the publisher is not null."""
        return self.enable_kv_cache_events and self.publisher == "zmq"


def parse_kv_events_config(value: str | dict[str, Any] | KVEventsConfig | None) -> KVEventsConfig | None:
    """The flag's JSON text, a dict (the offline API) or a config; None (the default) means off."""
    return config_from_json_flag(value, KVEventsConfig, "kv_events_config")


def start_kv_event_publisher(
    config: KVEventsConfig | None,
    events: KVEventBuffer,
    block_size: int,
    medium: str,
    prefix_caching: bool,
    data_parallel_rank: int = 0,
    groups: Sequence[KVCacheSpec] | None = None,
) -> ZmqKVEventPublisher | None:
    """Start publishing `events` when the config enables it (binding its sockets now, so a taken port fails the
    engine's start with a clear error); None otherwise, without importing zmq."""
    if config is None or not config.enabled:
        return None
    if not prefix_caching:
        logger.warning(
            "--kv-events-config is set but prefix caching is off: no block will ever be stored, so the "
            "stream stays empty"
        )
    from kvserve.kv.event_publisher import ZmqKVEventPublisher

    publisher = ZmqKVEventPublisher(
        config,
        block_size=block_size,
        medium=medium,
        data_parallel_rank=data_parallel_rank,
        groups=(KVCacheSpec(),) if groups is None else groups,
    )
    events.listeners.append(publisher.record)
    return publisher
