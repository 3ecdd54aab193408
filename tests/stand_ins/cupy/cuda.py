"""``cupy.cuda`` of the stand-in: devices, memory, streams and events over host memory.

It carries what CUDA's start-up costs a process on a GPU host, as CUDA pays it (issue
23): the driver's start-up (``cuInit``, on the first runtime call) and each device's
first context (on the first call that needs one: memory, a stream, an event, its memory
figures) hold the GIL, ``STAND_IN_CUPY_INIT_S`` (default 0.2) and
``STAND_IN_CUPY_CONTEXT_S`` (default 0.13) seconds, in one C call that keeps it (not a
``time.sleep``, which lets go of it); pinning host memory takes
``STAND_IN_CUPY_PIN_S_PER_GIB`` (default 1.1) seconds per GiB, one pin at a time per
device, the GIL let go. Set them to 0 for a stand-in without the costs.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
from types import TracebackType
from typing import Any

_current = threading.local()
MEMORY_TOTAL = 80 * 1024**3
INIT_S = float(os.environ.get("STAND_IN_CUPY_INIT_S", "0.2"))
CONTEXT_S = float(os.environ.get("STAND_IN_CUPY_CONTEXT_S", "0.13"))
PIN_S_PER_GIB = float(os.environ.get("STAND_IN_CUPY_PIN_S_PER_GIB", "1.1"))


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


# A PyDLL keeps the GIL during its calls: libc's nanosleep through it is a C call that
# blocks every Python thread, as CUDA's start-up does.
_nanosleep = ctypes.PyDLL(None).nanosleep
_started: set[int] = set()  # -1: the driver; i: device i's context
_start_lock = threading.RLock()
_pin_locks = {i: threading.Lock() for i in range(64)}


def _hold_gil(seconds: float) -> None:
    if seconds > 0:
        whole = int(seconds)
        _nanosleep(ctypes.byref(_Timespec(whole, int((seconds - whole) * 1e9))), None)


def _start(what: int, seconds: float) -> None:
    """The driver's (``what`` -1) or a device's first start, once per process."""
    if what in _started:
        return
    with _start_lock:
        if what not in _started:
            if what >= 0:
                _start(-1, INIT_S)
            _hold_gil(seconds)
            _started.add(what)


def _context() -> None:
    """The current device's context, created on first use."""
    _start(current(), CONTEXT_S)


def _count() -> int:
    return int(os.environ.get("STAND_IN_CUPY_DEVICES", "1"))


def current() -> int:
    return int(getattr(_current, "device", 0))


class CUDARuntimeError(RuntimeError):
    pass


def _check_device(ordinal: int) -> int:
    _start(-1, INIT_S)
    if not 0 <= ordinal < _count():
        raise CUDARuntimeError(f"cudaErrorInvalidDevice: invalid device ordinal {ordinal}")
    return ordinal


class Device:
    def __init__(self, device: int | None = None) -> None:
        self.id = _check_device(current() if device is None else int(device))
        self._saved: list[int] = []

    @property
    def pci_bus_id(self) -> str:
        return runtime.deviceGetPCIBusId(self.id)

    @property
    def compute_capability(self) -> str:
        return "90"

    def use(self) -> None:
        _current.device = self.id

    def synchronize(self) -> None:
        pass

    def __enter__(self) -> Device:
        self._saved.append(current())
        _current.device = self.id
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        _current.device = self._saved.pop()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self) -> int:
        return self.id


def _host_memory(size: int) -> tuple[mmap.mmap, int]:
    """``size`` bytes of page-aligned anonymous memory, and its address."""
    block = mmap.mmap(-1, max(size, 1))
    return block, ctypes.addressof(ctypes.c_char.from_buffer(block))


class Memory:
    """Device memory: host memory on the stand-in. As CuPy's (a Cython class without
    ``__weakref__``), it cannot be weakly referenced."""

    __slots__ = ("_block", "device_id", "ptr", "size")

    def __init__(self, size: int) -> None:
        _context()
        self.device_id = current()
        self.size = size
        self._block, self.ptr = _host_memory(size)


class UnownedMemory:
    """Device memory someone else owns: ``owner`` is kept alive as long as this is. Not
    weakly referenceable either."""

    __slots__ = ("_owner", "device_id", "ptr", "size")

    def __init__(self, ptr: int, size: int, owner: object, device_id: int = -1) -> None:
        self.ptr = ptr
        self.size = size
        self._owner = owner
        self.device_id = current() if device_id < 0 else device_id


class MemoryPointer:
    def __init__(self, mem: Memory | UnownedMemory, offset: int) -> None:
        self.mem = mem
        self.ptr = mem.ptr + offset
        self.device_id = mem.device_id

    @classmethod
    def at(cls, mem: Memory | UnownedMemory | None, address: int) -> MemoryPointer:
        """The pointer to ``address`` (in ``mem``, when known)."""
        if mem is None:
            pointer = cls.__new__(cls)
            pointer.mem, pointer.ptr, pointer.device_id = None, address, current()
            return pointer
        return cls(mem, address - mem.ptr)


class PinnedMemory:
    """Pinned host memory: plain host memory on the stand-in (the pointer holds it).
    Pinning takes its modelled time, one pin at a time per device."""

    def __init__(self, size: int, flags: int = 0) -> None:
        _context()
        with _pin_locks[current()]:
            time.sleep(size / 1024**3 * PIN_S_PER_GIB)
        self.size = size


class PinnedMemoryPointer(mmap.mmap):
    """Exports the pinned buffer: its own anonymous mapping, whose pages the kernel
    zeroes on first touch, so that making one holds the GIL no longer than
    ``cudaHostAlloc`` does (CuPy calls it without the GIL); a zeroed ``bytearray`` held
    it for the whole memset, 5-10 ms per 16 MiB slot. Callers align the pointer
    themselves, as CuPy's pinned pool does not promise alignment."""

    def __new__(cls, mem: PinnedMemory, offset: int) -> PinnedMemoryPointer:
        return super().__new__(cls, -1, max(mem.size, 1))

    def __init__(self, mem: PinnedMemory, offset: int) -> None:
        anchor = (ctypes.c_char * max(mem.size, 1)).from_buffer(self)
        self.ptr = ctypes.addressof(anchor) + offset
        self.mem = mem
        del anchor


class Stream:
    null: Stream  # the legacy default stream (CuPy's ``Stream.null``)

    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False) -> None:
        if not null:  # the null stream is made at import: it needs no context yet
            _context()
        self.device_id = current()
        self.ptr = 0 if null else id(self)

    def synchronize(self) -> None:
        pass

    def wait_event(self, event: Event) -> None:
        pass


Stream.null = Stream(null=True)


class Event:
    """Complete once recorded: every stand-in copy is done when it is queued."""

    def __init__(
        self, block: bool = False, disable_timing: bool = False, interprocess: bool = False
    ) -> None:
        _context()
        self.disable_timing = disable_timing
        self.recorded_at: float | None = None

    def record(self, stream: Stream | None = None) -> None:
        self.recorded_at = time.perf_counter()

    @property
    def done(self) -> bool:
        return True

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def get_elapsed_time(start: Event, end: Event) -> float:
    """Milliseconds between two recorded events."""
    if start.recorded_at is None or end.recorded_at is None:
        raise CUDARuntimeError("cudaErrorInvalidResourceHandle: event not recorded")
    return (end.recorded_at - start.recorded_at) * 1000.0


class runtime:  # CuPy's name
    memcpyHostToHost = 0
    memcpyHostToDevice = 1
    memcpyDeviceToHost = 2
    memcpyDeviceToDevice = 3

    @staticmethod
    def getDeviceCount() -> int:
        _start(-1, INIT_S)
        return _count()

    @staticmethod
    def getDeviceProperties(ordinal: int) -> dict[str, Any]:
        _check_device(ordinal)
        return {"name": b"stand-in GPU", "integrated": 0, "totalGlobalMem": MEMORY_TOTAL}

    @staticmethod
    def deviceGetPCIBusId(ordinal: int) -> str:
        return f"0000:{_check_device(ordinal) + 1:02x}:00.0"

    @staticmethod
    def memGetInfo() -> tuple[int, int]:
        _context()
        return MEMORY_TOTAL, MEMORY_TOTAL

    @staticmethod
    def memcpyAsync(dst: int, src: int, size: int, kind: int, stream: int) -> None:
        ctypes.memmove(dst, src, size)

    @staticmethod
    def memcpy(dst: int, src: int, size: int, kind: int) -> None:
        ctypes.memmove(dst, src, size)

    # IPC handles, in this process only: a handle names the address of the allocation
    # (its base: where ``ptr`` lies inside one of this process's ``Memory``), and
    # opening it gives that address back. Another process cannot open it.
    cudaIpcMemLazyEnablePeerAccess = 1

    @staticmethod
    def ipcGetMemHandle(ptr: int) -> bytes:
        _context()
        return ptr.to_bytes(8, "little") + bytes(56)

    @staticmethod
    def ipcOpenMemHandle(handle: bytes, flags: int = 1) -> int:
        if len(handle) != 64:
            raise CUDARuntimeError("cudaErrorInvalidValue: not an IPC handle")
        return int.from_bytes(handle[:8], "little")

    @staticmethod
    def ipcCloseMemHandle(ptr: int) -> None:
        return None

    @staticmethod
    def deviceGetByPCIBusId(bus_id: str) -> int:
        for ordinal in range(_count()):
            if runtime.deviceGetPCIBusId(ordinal) == bus_id:
                return ordinal
        raise CUDARuntimeError(f"cudaErrorInvalidDevice: no device at {bus_id}")
