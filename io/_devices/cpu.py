"""The host CPU as a device: buffer type ``CPU``, memory from ``/proc/meminfo``."""

from __future__ import annotations

import os

from aiogguf.io._devices.base import BufferRole, BufferType, DeviceCaps, DeviceKind
from aiogguf.io.ggml_types import GGMLType

__all__ = ["CpuDevice", "host_memory"]


def host_memory() -> tuple[int, int]:
    """``(available_bytes, total_bytes)`` of host RAM.

    ``MemAvailable`` (what can be had without swapping) rather than ``MemFree``, which
    leaves out the reclaimable page cache; ``os.sysconf`` where there is no procfs.
    """
    try:
        # Bytes, not text: a text file looks up its codec, which in a fresh process
        # imports one; every load reads this file.
        with open("/proc/meminfo", "rb") as f:
            fields = dict(line.split(b":", 1) for line in f.read().splitlines() if b":" in line)
        total = int(fields[b"MemTotal"].split()[0]) * 1024
        free = int(fields[b"MemAvailable"].split()[0]) * 1024
        return free, total
    except (OSError, KeyError, ValueError):
        pass
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
    except (OSError, ValueError):
        return 0, 0


class CpuDevice:
    """The host. Holds every valid ggml type and wraps mappings without copying.

    ``free``/``total`` fix the reported memory (tests, dry runs); by default it is read
    from the system at each ``memory()`` call.
    """

    kind: DeviceKind = DeviceKind.CPU
    backend = "cpu"
    device_id: str | None = None

    def __init__(
        self,
        name: str = "CPU",
        *,
        free: int | None = None,
        total: int | None = None,
        extra_buffer_types: tuple[str, ...] = (),
    ) -> None:
        self.name = name
        self._memory = None if free is None else (free, total if total is not None else free)
        self.caps: DeviceCaps = DeviceCaps(
            host_pointer=True, async_copies=False, events=False, mmap=True
        )
        self.buffer_type: BufferType = BufferType(name, name, BufferRole.DEFAULT, host=True)
        self.host_buffer_type: BufferType | None = None
        self.split_buffer_type: BufferType | None = None
        self.extra_buffer_types: tuple[BufferType, ...] = tuple(
            BufferType(f"{name}_{suffix}", name, BufferRole.EXTRA, host=True)
            for suffix in extra_buffer_types
        )

    def memory(self) -> tuple[int, int]:
        return self._memory if self._memory is not None else host_memory()

    def supports(self, tensor_type: GGMLType) -> bool:
        return tensor_type.valid

    def __repr__(self) -> str:
        return f"CpuDevice({self.name!r})"
