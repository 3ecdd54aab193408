"""A Ray cluster on this machine, on loopback only, for tests and benchmarks of
``aiogguf.cluster``: each node a raylet of its own (``ray.cluster_utils.Cluster``), with
its own label (``aiogguf.node``), one CPU and its own simulated GPUs
(``AIOGGUF_SIM_GPUS`` in its raylet's environment, which its workers inherit).

Every process binds 127.0.0.1 (no dashboard); Ray's health checks are tightened so that
a node that dies is known within seconds (Ray's defaults take about 15 s).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LoopbackCluster", "NodeSpec", "loopback_cluster"]

LOOPBACK = "127.0.0.1"
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
# Ray's GCS marks a node dead after this many missed checks of this period.
HEALTH_CHECK = {
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 3,
}


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """One node: its ``aiogguf.node`` label (None: unlabelled) and its simulated GPUs
    (``--sim-gpu`` specs)."""

    label: str | None
    sim_gpus: Sequence[str] = ()
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class LoopbackCluster:
    """The running cluster: Ray's ``Cluster``, and each node's Ray ``Node`` by label
    (or ``n<i>`` in the order added, for unlabelled ones)."""

    cluster: Any
    nodes: dict[str, Any]

    @property
    def address(self) -> str:
        return str(self.cluster.address)

    def kill(self, name: str) -> None:
        """End node ``name``'s raylet and every process of it, at once (SIGKILL)."""
        self.cluster.remove_node(self.nodes.pop(name), allow_graceful=False)


@contextmanager
def loopback_cluster(specs: Sequence[NodeSpec]) -> Iterator[LoopbackCluster]:
    """Start a node per spec (the first is the head), connect this process's Ray to
    it, and shut it all down on exit."""
    # Off, Ray takes loopback for this machine's address everywhere (read when Ray is
    # imported; on, it resolves 127.0.0.1 to the machine's address and connects there).
    os.environ[LOOPBACK_ENV] = "0"
    import ray as ray_module  # pyright: ignore[reportMissingImports]  (optional: the cluster extra)
    from ray._private import ray_constants  # pyright: ignore[reportMissingImports]  (optional: the cluster extra)
    from ray.cluster_utils import Cluster  # pyright: ignore[reportMissingImports]  (optional: the cluster extra)

    ray: Any = ray_module  # partly typed: its calls are taken as they are
    if ray_constants.ENABLE_RAY_CLUSTER:
        raise RuntimeError(
            f"Ray was imported before {LOOPBACK_ENV}=0 was set: set it before importing ray"
        )

    cluster: Any = Cluster(initialize_head=False, shutdown_at_exit=True)
    nodes: dict[str, Any] = {}
    try:
        for i, spec in enumerate(specs):
            env = dict(spec.env)
            if spec.sim_gpus:
                env["AIOGGUF_SIM_GPUS"] = ";".join(spec.sim_gpus)
            args: dict[str, Any] = {
                "num_cpus": 1,
                "node_ip_address": LOOPBACK,
                "include_dashboard": False,
                "object_store_memory": 80 * 1024**2,
                "env_vars": env,
                "labels": {"aiogguf.node": spec.label} if spec.label else {},
            }
            if i == 0:
                args["_system_config"] = HEALTH_CHECK
            nodes[spec.label or f"n{i}"] = cluster.add_node(**args)
        ray.init(
            address=cluster.address,
            _node_ip_address=LOOPBACK,
            log_to_driver=False,
            configure_logging=False,
        )
        yield LoopbackCluster(cluster, nodes)
    finally:
        ray.shutdown()
        cluster.shutdown()
