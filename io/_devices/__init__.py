"""Device backends behind one protocol: cpu, sim (simulated GPUs) and cupy. The cupy
and sim backends are imported on first use (by the thread that finds such a device):
a CPU load needs neither."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from aiogguf.io._devices.base import BufferRole as BufferRole
from aiogguf.io._devices.base import BufferType as BufferType
from aiogguf.io._devices.base import Device as Device
from aiogguf.io._devices.base import DeviceCaps as DeviceCaps
from aiogguf.io._devices.base import DeviceKind as DeviceKind
from aiogguf.io._devices.base import all_buffer_types as all_buffer_types
from aiogguf.io._devices.cpu import CpuDevice as CpuDevice

if TYPE_CHECKING:
    from aiogguf.io._devices.cupy_backend import CupyDevice as CupyDevice
    from aiogguf.io._devices.sim import SimDevice as SimDevice

_LAZY = {"CupyDevice": "cupy_backend", "SimDevice": "sim"}

__all__ = [
    "BufferRole",
    "BufferType",
    "CpuDevice",
    "CupyDevice",
    "Device",
    "DeviceCaps",
    "DeviceKind",
    "SimDevice",
    "all_buffer_types",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'aiogguf.io._devices' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"aiogguf.io._devices.{module}"), name)
    globals()[name] = value
    return value
