"""docs/SCALE_OUT.md's several-machines recipe, on one machine: an existing Ray cluster of two nodes (two raylets,
as Ray's own tests build with ray.cluster_utils), joined through `ray_address` (`--ray-address`). The replicas
are spread one per node even where one node has the CPUs for both, and both serve."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster
from server_support import CHAT_TEMPLATE, MODEL, RunningServer, wait_until

from kvserve.cluster.engine import ClusterEngine
from kvserve.config import EngineConfig
from kvserve.server.app import build_app
from kvserve.server.context import ServerSettings

# Each node could hold both 1-CPU replicas: Ray's default policy would pack them on the head node.
CPUS_PER_NODE = 3


@pytest.fixture
def two_nodes() -> Iterator[Cluster]:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": CPUS_PER_NODE, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=CPUS_PER_NODE)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()


def test_replicas_spread_over_the_nodes_of_an_existing_cluster(two_nodes: Cluster, tiny_model_dir: Path) -> None:
    config = EngineConfig(
        model=str(tiny_model_dir), num_gpu_blocks_override=64, block_size=4, chat_template=CHAT_TEMPLATE, cpu_threads=1
    )
    engine = ClusterEngine.launch(config, 2, router_policy="round_robin", ray_address=two_nodes.address)
    server = RunningServer(build_app(engine, ServerSettings(served_model_names=(MODEL,))), engine).start()
    try:
        # Defined here so that Ray pickles it by value: a replica cannot import this test module.
        def node_of(_engine: object) -> str:
            import ray as replica_ray

            return replica_ray.get_runtime_context().get_node_id()

        nodes = {name: ray.get(r.handle.call.remote(node_of), timeout=30) for name, r in engine.replicas.items()}
        assert len(set(nodes.values())) == 2, nodes
        assert set(nodes.values()) == {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        with server.client() as c:
            for i in range(4):
                r = c.post(
                    "/v1/completions", json={"model": MODEL, "prompt": [5 + i, 6, 7], "max_tokens": 3, "temperature": 0}
                )
                assert r.status_code == 200, r.text
        # Both nodes served (the ingress reads the replicas' counters every 50 ms).
        wait_until(lambda: all(r.stats.generation_tokens_total > 0 for r in engine.replicas.values()), timeout=30)
    finally:
        server.stop()
