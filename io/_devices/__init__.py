"""Device backends behind one protocol: cpu, sim (simulated GPUs) and cupy."""

from aiogguf.io._devices.base import BufferRole as BufferRole
from aiogguf.io._devices.base import BufferType as BufferType
from aiogguf.io._devices.base import Device as Device
from aiogguf.io._devices.base import DeviceCaps as DeviceCaps
from aiogguf.io._devices.base import DeviceKind as DeviceKind
from aiogguf.io._devices.base import all_buffer_types as all_buffer_types
from aiogguf.io._devices.cpu import CpuDevice as CpuDevice
from aiogguf.io._devices.cupy_backend import CupyDevice as CupyDevice
from aiogguf.io._devices.sim import SimDevice as SimDevice

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
