"""Real GPUs through CuPy, imported lazily: without CuPy, or without a visible device,
there are simply no CuPy devices."""

from __future__ import annotations

from typing import Any

from aiogguf.io.devices.base import BufferRole, BufferType, DeviceCaps, DeviceKind
from aiogguf.io.ggml_types import GGMLType

__all__ = ["CupyDevice", "cupy_devices", "import_cupy"]

# One pinned host buffer type serves every CUDA device, as in ggml-cuda.
HOST_BUFFER_TYPE = "CUDA_Host"


def import_cupy() -> Any | None:
    """The ``cupy`` module, or None when it is not installed or cannot initialise."""
    try:
        import cupy
    except ImportError:
        return None
    except Exception:  # a broken CUDA install raises from cupy's own import machinery
        return None
    return cupy


class CupyDevice:
    """CUDA device ``ordinal``, named ``CUDA<ordinal>`` like ggml-cuda names it."""

    backend = "cupy"

    def __init__(self, ordinal: int, *, kind: DeviceKind, device_id: str | None) -> None:
        self.ordinal = ordinal
        self.name = f"CUDA{ordinal}"
        self.kind: DeviceKind = kind
        self.device_id = device_id
        # CUDA cannot wrap a file mapping as device memory (ggml-cuda reports
        # buffer_from_host_ptr = false), but it copies from mapped pages fine.
        self.caps = DeviceCaps(host_pointer=False, async_copies=True, events=True, mmap=True)
        self.buffer_type = BufferType(self.name, self.name, BufferRole.DEFAULT, host=False)
        self.host_buffer_type: BufferType | None = BufferType(
            HOST_BUFFER_TYPE, self.name, BufferRole.HOST, host=True
        )
        self.split_buffer_type: BufferType | None = BufferType(
            f"{self.name}_Split", self.name, BufferRole.SPLIT, host=False, matrices_only=True
        )
        self.extra_buffer_types: tuple[BufferType, ...] = ()

    def memory(self) -> tuple[int, int]:
        cupy = import_cupy()
        if cupy is None:
            return 0, 0
        try:
            with cupy.cuda.Device(self.ordinal):
                free, total = cupy.cuda.runtime.memGetInfo()
        except Exception:  # the device went away or the driver failed: report nothing
            return 0, 0
        return int(free), int(total)

    def supports(self, tensor_type: GGMLType) -> bool:
        # Weights are uploaded as raw bytes; every valid type can be held.
        return tensor_type.valid

    def __repr__(self) -> str:
        return f"CupyDevice({self.name!r}, kind={self.kind!r}, id={self.device_id!r})"


def _pci_bus_id(cupy: Any, ordinal: int) -> str | None:
    try:
        return str(cupy.cuda.runtime.deviceGetPCIBusId(ordinal)).lower()
    except Exception:
        pass
    try:
        return str(cupy.cuda.Device(ordinal).pci_bus_id).lower()
    except Exception:
        return None


def cupy_devices() -> tuple[CupyDevice, ...]:
    """The CUDA devices CuPy sees, de-duplicated by PCI bus id; ``()`` without CuPy or
    without a device."""
    cupy = import_cupy()
    if cupy is None:
        return ()
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no driver, no device: CUDA raises rather than returning 0
        return ()
    found: list[CupyDevice] = []
    seen: set[str] = set()
    for ordinal in range(count):
        try:
            props = cupy.cuda.runtime.getDeviceProperties(ordinal)
            integrated = bool(props.get("integrated", 0))
        except Exception:
            integrated = False
        bus_id = _pci_bus_id(cupy, ordinal)
        if bus_id is not None:
            if bus_id in seen:
                continue
            seen.add(bus_id)
        found.append(CupyDevice(ordinal, kind="igpu" if integrated else "gpu", device_id=bus_id))
    return tuple(found)
