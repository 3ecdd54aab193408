"""Loads beyond one machine, on Ray (the ``cluster`` extra): one plan over every node's
devices, each node reading its own part from its own storage (docs/cluster.md).

``async with aiogguf.cluster.load(path, n_gpu_layers=-1) as model``; ``await
aiogguf.cluster.plan(path)`` for the plan alone. Ray is imported on first use.
"""

from __future__ import annotations

from aiogguf.cluster._load import (
    AttachAddress as AttachAddress,
)
from aiogguf.cluster._load import (
    ClusterLoad as ClusterLoad,
)
from aiogguf.cluster._load import (
    ClusterModel as ClusterModel,
)
from aiogguf.cluster._load import (
    ClusterProgress as ClusterProgress,
)
from aiogguf.cluster._load import (
    ClusterReport as ClusterReport,
)
from aiogguf.cluster._load import (
    NodeRow as NodeRow,
)
from aiogguf.cluster._load import (
    load as load,
)
from aiogguf.cluster._load import (
    load_sync as load_sync,
)
from aiogguf.cluster._load import (
    plan as plan,
)
from aiogguf.cluster._load import (
    plan_sync as plan_sync,
)
from aiogguf.cluster._nodes import NodeDevice as NodeDevice
from aiogguf.cluster._nodes import NodeInfo as NodeInfo
from aiogguf.cluster._placement import ClusterPlan as ClusterPlan

__all__ = [
    "AttachAddress",
    "ClusterLoad",
    "ClusterModel",
    "ClusterPlan",
    "ClusterProgress",
    "ClusterReport",
    "NodeDevice",
    "NodeInfo",
    "NodeRow",
    "load",
    "load_sync",
    "plan",
    "plan_sync",
]
