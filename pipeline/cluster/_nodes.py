"""The cluster's vocabulary, shared by the driver and the nodes' loaders: how a node is
named, what it reports (its devices, its host memory, whether it can read the model),
and its devices as the plan sees them, named by node (``n1/g0``, ``n1/CUDA0``), the way
llama.cpp's RPC backend names remote devices.

A node's devices travel to the driver as ``NodeDevice`` records: a plain description
(names, kind, capabilities, buffer types, memory, the ggml types it holds) that
implements the ``Device`` protocol the plan stage asks, and nothing more: a remote
device is planned for, never uploaded to.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from aiogguf.errors import ConfigError
from aiogguf.io._devices.base import BufferType, DeviceCaps, DeviceKind, all_buffer_types
from aiogguf.io._devices.base import Device as _Device
from aiogguf.io.ggml_types import GGML_TYPES, GGMLType

__all__ = [
    "NODE_LABEL",
    "NodeDevice",
    "NodeInfo",
    "describe_device",
    "local_name",
    "node_names",
    "node_of",
    "order_nodes",
]

# The Ray node label that names a node; unlabelled nodes are n0, n1, … in node-id order.
NODE_LABEL = "aiogguf.node"
# A node name becomes a prefix of device and buffer type names: no separator in it.
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclass(frozen=True, slots=True)
class NodeDevice:
    """One device of one node as the plan sees it: a ``Device`` whose names carry the
    node (``n1/g0``; buffer types ``n1/g0_Host``, ``n1/g0_Split``), whose memory is what
    the node reported, and which holds the ggml types (by id) in ``types``."""

    name: str
    kind: DeviceKind
    backend: str
    device_id: str | None
    caps: DeviceCaps
    buffer_type: BufferType
    host_buffer_type: BufferType | None
    split_buffer_type: BufferType | None
    extra_buffer_types: tuple[BufferType, ...]
    free_bytes: int
    total_bytes: int
    types: frozenset[int]

    def memory(self) -> tuple[int, int]:
        return self.free_bytes, self.total_bytes

    def supports(self, tensor_type: GGMLType) -> bool:
        return tensor_type.id in self.types


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """What a node's loader reported: its name and Ray node id, its devices (named by
    node; the CPU first), its host memory, the path it would read and, when it cannot
    read it, why (None: it can)."""

    name: str
    node_id: str
    devices: tuple[NodeDevice, ...]
    host_free: int
    host_total: int
    path: str
    unreadable: str | None


def _named(node: str, buffer_type: BufferType | None) -> BufferType | None:
    if buffer_type is None:
        return None
    return replace(
        buffer_type, name=f"{node}/{buffer_type.name}", device=f"{node}/{buffer_type.device}"
    )


def describe_device(device: _Device, node: str) -> NodeDevice:
    """``device`` of ``node`` as the driver plans for it: every name prefixed with
    ``node/`` (a PCI bus id too: two machines' first GPUs are not one device)."""
    default = _named(node, device.buffer_type)
    assert default is not None
    free, total = device.memory()
    return NodeDevice(
        name=f"{node}/{device.name}",
        kind=DeviceKind(device.kind),
        backend=device.backend,
        device_id=None if device.device_id is None else f"{node}/{device.device_id}",
        caps=device.caps,
        buffer_type=default,
        host_buffer_type=_named(node, device.host_buffer_type),
        split_buffer_type=_named(node, device.split_buffer_type),
        extra_buffer_types=tuple(
            b for b in (_named(node, x) for x in device.extra_buffer_types) if b is not None
        ),
        free_bytes=free,
        total_bytes=total,
        types=frozenset(t.id for t in GGML_TYPES.values() if device.supports(t)),
    )


def node_of(name: str) -> str:
    """The node of a device or buffer type name (``n1/g0`` → ``n1``)."""
    node, sep, _ = name.partition("/")
    if not sep:
        raise ValueError(f"{name!r} names no node")
    return node


def local_name(name: str) -> str:
    """A device or buffer type name as its node knows it (``n1/g0_Host`` → ``g0_Host``)."""
    return name.partition("/")[2]


def node_names(nodes: Iterable[tuple[str, Mapping[str, str]]]) -> dict[str, str]:
    """Each node's name by its Ray node id: its ``aiogguf.node`` label, else ``n<i>``
    with ``i`` its position in node-id order.

    Raises ``ConfigError`` for a label that is not a plain name, or two nodes of one name.
    """
    ordered = sorted(nodes, key=lambda n: n[0])
    names: dict[str, str] = {}
    for i, (node_id, labels) in enumerate(ordered):
        name = labels.get(NODE_LABEL) or f"n{i}"
        if _NAME.fullmatch(name) is None:
            raise ConfigError(NODE_LABEL, None, f"node {node_id[:12]}: {name!r} is not a node name")
        names[node_id] = name
    seen: dict[str, str] = {}
    for node_id, name in names.items():
        if name in seen:
            raise ConfigError(
                NODE_LABEL,
                None,
                f"nodes {seen[name][:12]} and {node_id[:12]} are both named {name!r}",
            )
        seen[name] = node_id
    return names


def _natural(name: str) -> tuple[object, ...]:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def order_nodes(names: Iterable[str]) -> list[str]:
    """Node names in the order their devices are offered to the plan: natural order
    (``n2`` before ``n10``), so that layers go to nodes in the order of their names."""
    return sorted(names, key=_natural)


def buffer_type_names(devices: Sequence[NodeDevice]) -> set[str]:
    """Every buffer type name of ``devices``."""
    return {b.name for d in devices for b in all_buffer_types(d)}
