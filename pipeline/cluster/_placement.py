"""One plan over the cluster: the union of every node's devices, offered to the plan
stage exactly as one machine's are, and each node's part of the plan in that node's
own names.

The plan stage sees one CPU (the named CPU node's, ``n0/CPU``), then every node's GPUs
in node order (``order_nodes``), each in its node's order. ``-ngl``, ``-ts``, ``-sm``,
``-mg`` and ``-ot`` therefore work over the union as over one machine's devices; an
override to ``CPU`` means the CPU node's. A buffer belongs to the node of its device.
One difference from one machine: only the CPU node's GPUs offer their pinned host
buffer type (``n0/g0_Host``, host memory of their node), so that the CPU part, which
llama.cpp puts there when it does not map the file, stays on the CPU node.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from aiogguf._config import Config
from aiogguf._records import LayerAssignment, Plan
from aiogguf.cluster._nodes import NodeDevice, NodeInfo, local_name, node_of, order_nodes
from aiogguf.errors import ConfigError
from aiogguf.io._devices.base import DeviceKind

__all__ = ["ClusterPlan", "cluster_config", "node_part", "union_devices"]


@dataclass(frozen=True, slots=True)
class ClusterPlan:
    """The plan of a load over the cluster: ``plan`` places every tensor on a device
    named by node (``n1/g0``), ``nodes`` are what each node reported, ``cpu_node`` holds
    the CPU part."""

    plan: Plan
    nodes: tuple[NodeInfo, ...]
    cpu_node: str

    def node(self, name: str) -> NodeInfo:
        """What node ``name`` reported; ``KeyError`` for a node the cluster lacks."""
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def loading_nodes(self) -> list[str]:
        """The nodes that hold some buffer of the plan, in node order."""
        return order_nodes({node_of(b.device) for b in self.plan.buffers})

    def node_bytes(self, name: str) -> int:
        """The tensor bytes node ``name`` loads (lazy buffers excluded: read on use)."""
        return sum(b.nbytes for b in self.plan.buffers if node_of(b.device) == name and not b.lazy)

    def node_read_bytes(self, name: str) -> int:
        """The file bytes node ``name`` reads for its buffers: their coalesced ranges."""
        return sum(
            r.nbytes
            for b in self.plan.buffers
            if node_of(b.device) == name and not b.lazy
            for r in b.ranges
        )

    def part(self, name: str) -> Plan:
        """Node ``name``'s part of the plan, in its own names (``node_part``)."""
        return node_part(self.plan, name)


def union_devices(nodes: Sequence[NodeInfo], cpu_node: str) -> tuple[NodeDevice, ...]:
    """The devices the plan places over: the CPU node's CPU and accelerators, then every
    node's GPUs (discrete and integrated), node by node in ``order_nodes`` order.

    Raises ``ConfigError`` when ``cpu_node`` is not a node of the cluster.
    """
    by_name = {n.name: n for n in nodes}
    if cpu_node not in by_name:
        known = ", ".join(order_nodes(by_name))
        raise ConfigError("cpu_node", None, f"no node named {cpu_node!r} (the nodes: {known})")
    host = by_name[cpu_node].devices
    cpu = [d for d in host if d.kind is DeviceKind.CPU]
    accels = [d for d in host if d.kind is DeviceKind.ACCEL]
    # A GPU's pinned host memory is its node's: the CPU part (which llama.cpp puts in the
    # first GPU's pinned host buffer when it does not map the file) may use only the CPU
    # node's, as llama.cpp's RPC devices offer none.
    gpus = [
        d if name == cpu_node else replace(d, host_buffer_type=None)
        for name in order_nodes(by_name)
        for d in by_name[name].devices
        if d.kind in (DeviceKind.GPU, DeviceKind.IGPU)
    ]
    return (*cpu, *accels, *gpus)


def cluster_config(config: Config, cpu_node: str) -> Config:
    """``config`` for the plan over the cluster: an override to ``CPU`` names the CPU
    node's CPU (``n0/CPU``); every other target names a device or buffer type by node."""
    rules = config.placement.override
    if not any(r.buffer_type == "CPU" for r in rules):
        return config
    return config.with_overrides(
        override=[
            {
                "pattern": r.pattern,
                "buffer_type": f"{cpu_node}/CPU" if r.buffer_type == "CPU" else r.buffer_type,
            }
            for r in rules
        ]
    )


def node_part(plan: Plan, node: str) -> Plan:
    """The part of the cluster's ``plan`` on ``node``, in the node's own names
    (``n1/g0`` → ``g0``): its buffers and their tensors only, so that a load that follows
    it allocates and reads nothing of another node's. The layers it lists are its own;
    the warnings are the driver's to say."""

    def mine(name: str) -> bool:
        return node_of(name) == node

    buffers = tuple(
        replace(b, device=local_name(b.device), buffer_type=local_name(b.buffer_type))
        for b in plan.buffers
        if mine(b.device)
    )
    held = {t for b in buffers for t in b.tensors}
    return replace(
        plan,
        devices=tuple(replace(d, name=local_name(d.name)) for d in plan.devices if mine(d.name)),
        input_device=local_name(plan.input_device),
        layers=tuple(
            LayerAssignment(a.layer, local_name(a.device)) for a in plan.layers if mine(a.device)
        ),
        tensors=tuple(
            replace(t, device=local_name(t.device), buffer_type=local_name(t.buffer_type))
            for t in plan.tensors
            if t.name in held
        ),
        buffers=buffers,
        moved=None,
        warnings=(),
    )
