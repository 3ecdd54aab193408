"""Real GPUs through CuPy, imported lazily: without CuPy, or without a visible device,
there are simply no CuPy devices.

Uploads (``stages/upload.py``): one ``cupy.cuda.Memory`` allocation (a ``cudaMalloc``)
per planned buffer, kept by the device's arena across loads (``arena.py``), page-aligned
pinned host slots (``cupy.cuda.PinnedMemory``, over-allocated by the alignment, so
O_DIRECT reads land in them directly) kept by the device's staging pool, one
non-blocking stream per transfer thread, one event per slot, and one
``cudaMemcpyAsync`` per staged chunk. Every CUDA call runs with its device current
(worker threads have no fixed device) and every CuPy error is translated into a
``LoadError`` naming the device and the operation.

Discovery (``cupy_devices``) imports CuPy and initialises CUDA: both are slow and hold
the GIL for part of the time, so the result is cached for the life of the process and
the engine calls it from a worker thread.

Arrays view device memory through ``cupy.cuda.UnownedMemory`` whose owner is an object
of ours (``_Anchor``), one per buffer: CuPy's ``Memory`` cannot be weakly referenced, the
anchor can, and its death says that the buffer is closed and no array of it is left
(the arena then takes the block back; ``held_by_views`` watches it).

The streams are non-blocking: they do not order with the legacy default stream, so read
a buffer (``to_host``, ``array`` + kernels) only after the uploader drained its device.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import numpy

from aiogguf.errors import GGUFError, LoadError
from aiogguf.io._devices.base import (
    BufferRole,
    BufferType,
    CopyStream,
    DeviceBuffer,
    DeviceCaps,
    DeviceKind,
    SharedDeviceMemory,
    StagingSlot,
)
from aiogguf.io.buffers import held_by_views
from aiogguf.io.ggml_types import GGMLType

__all__ = [
    "CupyBlock",
    "CupyCopyStream",
    "CupyDevice",
    "CupyDeviceBuffer",
    "CupyEvent",
    "CupyStagingSlot",
    "cupy_devices",
    "forget_cupy_devices",
    "import_cupy",
    "open_ipc_buffer",
]

# One pinned host buffer type serves every CUDA device, as in ggml-cuda.
HOST_BUFFER_TYPE = "CUDA_Host"


_warned = threading.Event()


def import_cupy() -> Any | None:
    """The ``cupy`` module, or None when it is not installed or cannot initialise (a
    broken install is said once, as a ``RuntimeWarning``: the load then runs without
    GPUs, which the user should hear of)."""
    try:
        import cupy  # pyright: ignore[reportMissingImports]  (the optional cupy extra)
    except ImportError:
        return None
    except Exception as exc:  # a broken CUDA install raises from cupy's own import machinery
        if not _warned.is_set():
            _warned.set()
            warnings.warn(
                f"CuPy is installed but cannot be imported ({type(exc).__name__}: {exc}); "
                "loading without GPUs",
                RuntimeWarning,
                stacklevel=2,
            )
        return None
    return cupy


class CupyDevice:
    """CUDA device ``ordinal``, named ``CUDA<ordinal>`` like ggml-cuda names it."""

    backend = "cupy"

    def __init__(self, ordinal: int, *, kind: DeviceKind, device_id: str | None) -> None:
        self.ordinal = ordinal
        self.name: str = f"CUDA{ordinal}"
        self.kind: DeviceKind = kind
        self.device_id = device_id
        # CUDA cannot wrap a file mapping as device memory (ggml-cuda reports
        # buffer_from_host_ptr = false), but it copies from mapped pages fine.
        self.caps: DeviceCaps = DeviceCaps(
            host_pointer=False, async_copies=True, events=True, mmap=True
        )
        self.buffer_type: BufferType = BufferType(
            self.name, self.name, BufferRole.DEFAULT, host=False
        )
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

    def allocate(self, nbytes: int) -> CupyDeviceBuffer:
        """Blocking: ``nbytes`` of device memory of its own (one ``cudaMalloc``, not
        CuPy's pool; ``cudaFree`` once it is closed and no array views it)."""
        block = self.allocate_block(nbytes)
        return block.buffer(nbytes, block.free)

    def allocate_block(self, nbytes: int) -> CupyBlock:
        """Blocking: ``nbytes`` of device memory for the device's arena (one
        ``cudaMalloc``, not CuPy's pool)."""
        cupy = _require_cupy(self.name)
        with _cuda_errors(self.name, f"allocating {nbytes} bytes of device memory"):
            return CupyBlock(cupy, self.ordinal, self.name, nbytes)

    def open_copy_stream(self, *, asynchronous: bool) -> CupyCopyStream:
        cupy = _require_cupy(self.name)
        with _cuda_errors(self.name, "creating a copy stream"):
            return CupyCopyStream(cupy, self.ordinal, self.name, asynchronous=asynchronous)

    def open_staging_slot(self, index: int, nbytes: int, alignment: int) -> CupyStagingSlot:
        cupy = _require_cupy(self.name)
        with _cuda_errors(self.name, f"allocating {nbytes} bytes of pinned host memory"):
            return CupyStagingSlot(cupy, self.ordinal, index, nbytes, alignment)

    def new_event(self) -> CupyEvent:
        cupy = _require_cupy(self.name)
        with _cuda_errors(self.name, "creating an event"):
            return CupyEvent(cupy, self.ordinal, self.name)

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


_discovered: tuple[CupyDevice, ...] | None = None
_discovery_lock = threading.Lock()


def cupy_devices() -> tuple[CupyDevice, ...]:
    """The CUDA devices CuPy sees, de-duplicated by PCI bus id; ``()`` without CuPy or
    without a device. Found once per process (blocking: import, driver start-up)."""
    global _discovered
    with _discovery_lock:
        if _discovered is None:
            _discovered = _discover()
        return _discovered


def forget_cupy_devices() -> None:
    """Drop the cached discovery, and the memory of a broken CuPy having been said
    (tests that fake CuPy)."""
    global _discovered
    with _discovery_lock:
        _discovered = None
        _warned.clear()


def _discover() -> tuple[CupyDevice, ...]:
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
        found.append(
            CupyDevice(
                ordinal, kind=DeviceKind.IGPU if integrated else DeviceKind.GPU, device_id=bus_id
            )
        )
    return tuple(found)


# ---------------------------------------------------------------------------------------
# Uploads.


def _require_cupy(device: str) -> Any:
    cupy = import_cupy()
    if cupy is None:
        raise LoadError(None, None, f"{device}: CuPy is not available")
    return cupy


@contextlib.contextmanager
def _cuda_errors(device: str, what: str) -> Iterator[None]:
    """Translate CuPy/CUDA errors raised inside into ``LoadError``s (the one boundary)."""
    try:
        yield
    except GGUFError:
        raise
    except Exception as exc:  # CUDARuntimeError, OutOfMemoryError, ...: no common base
        raise LoadError(None, None, f"{device}: {what} failed: {exc}") from exc


def _check_range(what: str, offset: int, nbytes: int, size: int) -> None:
    if offset < 0 or nbytes < 0 or offset + nbytes > size:
        raise ValueError(f"{what}: range [{offset}, {offset + nbytes}) outside [0, {size})")


class CupyBlock:
    """One ``cudaMalloc`` (``cupy.cuda.Memory``), lent to one buffer at a time."""

    def __init__(self, cupy: Any, ordinal: int, device: str, nbytes: int) -> None:
        self.device = device
        self.nbytes = nbytes
        self._cupy = cupy
        self._ordinal = ordinal
        with cupy.cuda.Device(ordinal):
            self._mem: Any = cupy.cuda.Memory(nbytes)
        self.ptr: int = int(self._mem.ptr)

    def buffer(self, nbytes: int, released: Callable[[], None]) -> CupyDeviceBuffer:
        if self._mem is None:
            raise LoadError(None, None, f"{self.device}: device memory used after free")
        _check_range(f"{self.device} block", 0, nbytes, self.nbytes)
        return CupyDeviceBuffer(self._cupy, self._ordinal, self, nbytes, released)

    def fence(self) -> CupyEvent:
        event = CupyEvent(self._cupy, self._ordinal, self.device)
        with (
            _cuda_errors(self.device, "recording an event"),
            self._cupy.cuda.Device(self._ordinal),
        ):
            # The legacy default stream waits for the work of every blocking stream:
            # its event covers kernels run on the last load's arrays by default.
            event._event.record(self._cupy.cuda.Stream.null)
        return event

    def free(self) -> None:
        mem, self._mem = self._mem, None
        if mem is not None:
            with _cuda_errors(self.device, "freeing device memory"):
                del mem  # cudaFree: nothing else references it (arrays hold anchors)


class _Anchor:
    """Owner of one buffer's ``UnownedMemory``: every array of the buffer holds it, and
    it holds the block. Weakly referenceable, unlike CuPy's ``Memory``."""

    __slots__ = ("__weakref__", "block")

    def __init__(self, block: CupyBlock) -> None:
        self.block: CupyBlock = block


class CupyDeviceBuffer:
    """A buffer over the first ``nbytes`` of a ``CupyBlock``. ``array()`` views keep it
    alive after ``close()``; ``released`` is called once both are gone."""

    def __init__(
        self,
        cupy: Any,
        ordinal: int,
        block: CupyBlock,
        nbytes: int,
        released: Callable[[], None],
    ) -> None:
        self.device: str = block.device
        self.nbytes = nbytes
        self.xp: ModuleType = cupy
        self._cupy = cupy
        self._ordinal = ordinal
        self.anchor: _Anchor | None = _Anchor(block)
        finalizer = weakref.finalize(self.anchor, released)
        finalizer.atexit = False
        self._mem: Any = cupy.cuda.UnownedMemory(block.ptr, nbytes, self.anchor, ordinal)

    @property
    def closed(self) -> bool:
        return self._mem is None

    @property
    def ptr(self) -> int:
        return int(self._live().ptr)

    def _live(self) -> Any:
        if self._mem is None:
            raise LoadError(None, None, f"{self.device}: device buffer used after close")
        return self._mem

    def array(self, offset: int, nbytes: int) -> Any:
        _check_range(f"{self.device} buffer", offset, nbytes, self.nbytes)
        cupy, mem = self._cupy, self._live()
        with _cuda_errors(self.device, "viewing device memory"), cupy.cuda.Device(self._ordinal):
            pointer = cupy.cuda.MemoryPointer(mem, offset)
            return cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=pointer)

    def to_host(self, offset: int, nbytes: int) -> memoryview:
        _check_range(f"{self.device} buffer", offset, nbytes, self.nbytes)
        cupy, mem = self._cupy, self._live()
        host = numpy.empty(nbytes, dtype=numpy.uint8)
        if nbytes:
            with (
                _cuda_errors(self.device, "copying device memory to the host"),
                cupy.cuda.Device(self._ordinal),
            ):
                runtime = cupy.cuda.runtime
                runtime.memcpy(
                    host.ctypes.data, mem.ptr + offset, nbytes, runtime.memcpyDeviceToHost
                )
        return host.data

    def export(self) -> SharedDeviceMemory:
        """Where another process finds this buffer's memory: the CUDA IPC handle of the
        ``cudaMalloc`` that holds it (an arena's block: the buffer is a part of it, so the
        offset inside it goes along). Raises ``LoadError`` after close or when CUDA
        refuses (memory that is not a ``cudaMalloc``'s)."""
        mem, anchor = self._live(), self.anchor
        assert anchor is not None
        cupy = self._cupy
        runtime = cupy.cuda.runtime
        with _cuda_errors(self.device, "exporting device memory"), cupy.cuda.Device(self._ordinal):
            handle = bytes(runtime.ipcGetMemHandle(anchor.block.ptr))
            bus_id = str(runtime.deviceGetPCIBusId(self._ordinal))
        return SharedDeviceMemory(
            self.device,
            self.nbytes,
            int(mem.ptr) - anchor.block.ptr,
            ipc_handle=handle,
            device_id=bus_id,
        )

    def close(self) -> None:
        # The block goes back (to its arena, or to the device) when the last reference to
        # the anchor (ours, or an array view's) goes.
        anchor, self.anchor = self.anchor, None
        self._mem = None
        if anchor is not None:
            held_by_views(anchor)

    def __repr__(self) -> str:
        state = "closed" if self._mem is None else "open"
        return f"CupyDeviceBuffer({self.device!r}, {self.nbytes}, {state})"


class CupyStagingSlot:
    """A pinned host slot, its view starting on an ``alignment`` boundary."""

    def __init__(self, cupy: Any, ordinal: int, index: int, nbytes: int, alignment: int) -> None:
        self.index = index
        self.nbytes = nbytes
        alignment = max(alignment, mmap.PAGESIZE)
        total = nbytes + alignment
        with cupy.cuda.Device(ordinal):
            mem = cupy.cuda.PinnedMemory(total)
        pointer = cupy.cuda.PinnedMemoryPointer(mem, 0)
        start = (-int(pointer.ptr)) % alignment
        self.ptr: int = int(pointer.ptr) + start
        # As cupyx.empty_pinned does: a numpy array over the pinned buffer. Views of it
        # keep the pinned memory alive, so no view can outlive the memory it reads.
        whole = numpy.ndarray((total,), dtype=numpy.uint8, buffer=pointer)
        self._view: memoryview | None = whole[start : start + nbytes].data

    def view(self) -> memoryview:
        if self._view is None:
            raise LoadError(None, None, f"staging slot {self.index} used after close")
        return self._view

    def begin_write(self) -> None:
        """Nothing to check: on a real GPU the ring's event wait is the guarantee."""

    def close(self) -> None:
        self._view = None  # cudaFreeHost when the last view goes


class CupyEvent:
    """A CUDA event (blocking sync: a waiting worker thread sleeps instead of spinning)."""

    def __init__(self, cupy: Any, ordinal: int, device: str) -> None:
        self._cupy = cupy
        self._ordinal = ordinal
        self._device = device
        with cupy.cuda.Device(ordinal):
            self._event = cupy.cuda.Event(block=True, disable_timing=True)

    def record(self, stream: CopyStream) -> None:
        if not isinstance(stream, CupyCopyStream) or stream.device != self._device:
            raise ValueError(f"{self._device}: cannot record an event on {stream!r}")
        with (
            _cuda_errors(self._device, "recording an event"),
            self._cupy.cuda.Device(self._ordinal),
        ):
            self._event.record(stream._live())

    def query(self) -> bool:
        with _cuda_errors(self._device, "querying an event"):
            return bool(self._event.done)

    def synchronize(self) -> None:
        with _cuda_errors(self._device, "waiting for a copy"):
            self._event.synchronize()


class CupyCopyStream:
    """One non-blocking CUDA stream of one device, for one load."""

    def __init__(self, cupy: Any, ordinal: int, device: str, *, asynchronous: bool) -> None:
        self.device = device
        self.asynchronous = asynchronous
        self._cupy = cupy
        self._ordinal = ordinal
        with cupy.cuda.Device(ordinal):
            self._stream: Any = cupy.cuda.Stream(non_blocking=True)

    def _live(self) -> Any:
        if self._stream is None:
            raise RuntimeError(f"{self.device}: copy stream used after close")
        return self._stream

    def copy_async(
        self, dest: DeviceBuffer, dest_offset: int, slot: StagingSlot, nbytes: int
    ) -> None:
        stream = self._live()
        target, source = self._check(dest, dest_offset, nbytes), slot
        if not isinstance(source, CupyStagingSlot) or nbytes > source.nbytes:
            raise ValueError(f"{self.device}: cannot copy {nbytes} bytes out of {slot!r}")
        runtime = self._cupy.cuda.runtime
        with (
            _cuda_errors(self.device, f"queueing a {nbytes}-byte copy"),
            self._cupy.cuda.Device(self._ordinal),
        ):
            runtime.memcpyAsync(
                target.ptr + dest_offset,
                source.ptr,
                nbytes,
                runtime.memcpyHostToDevice,
                stream.ptr,
            )

    def copy_sync(self, dest: DeviceBuffer, dest_offset: int, src: memoryview) -> None:
        self._live()
        target = self._check(dest, dest_offset, src.nbytes)
        if not src.nbytes:
            return
        host = numpy.frombuffer(src, dtype=numpy.uint8)
        runtime = self._cupy.cuda.runtime
        with (
            _cuda_errors(self.device, f"copying {src.nbytes} bytes"),
            self._cupy.cuda.Device(self._ordinal),
        ):
            runtime.memcpy(
                target.ptr + dest_offset, host.ctypes.data, src.nbytes, runtime.memcpyHostToDevice
            )

    def synchronize(self) -> None:
        stream = self._live()
        with _cuda_errors(self.device, "waiting for copies"):
            stream.synchronize()

    def close(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            with _cuda_errors(self.device, "waiting for copies"):
                stream.synchronize()

    def _check(self, dest: DeviceBuffer, dest_offset: int, nbytes: int) -> CupyDeviceBuffer:
        if not isinstance(dest, CupyDeviceBuffer) or dest.device != self.device:
            raise ValueError(f"{self.device}: cannot copy into {dest!r}")
        _check_range(f"copy into {self.device} buffer", dest_offset, nbytes, dest.nbytes)
        return dest


class _IpcBlock:
    """Another process's ``cudaMalloc``, opened from its IPC handle
    (``cudaIpcOpenMemHandle``): ``ptr`` is the buffer's start inside it; ``free``
    closes the handle once (``cudaIpcCloseMemHandle``)."""

    def __init__(self, cupy: Any, ordinal: int, shared: SharedDeviceMemory) -> None:
        assert shared.ipc_handle is not None
        self.device = shared.device
        self.nbytes = shared.offset + shared.nbytes
        self._cupy = cupy
        self._ordinal = ordinal
        runtime = cupy.cuda.runtime
        with _cuda_errors(shared.device, "opening an IPC handle"), cupy.cuda.Device(ordinal):
            self._base: int | None = int(
                runtime.ipcOpenMemHandle(shared.ipc_handle, runtime.cudaIpcMemLazyEnablePeerAccess)
            )
        self.ptr: int = self._base + shared.offset

    def free(self) -> None:
        base, self._base = self._base, None
        if base is not None:
            with (
                _cuda_errors(self.device, "closing an IPC handle"),
                self._cupy.cuda.Device(self._ordinal),
            ):
                self._cupy.cuda.runtime.ipcCloseMemHandle(base)


def open_ipc_buffer(shared: SharedDeviceMemory) -> CupyDeviceBuffer:
    """A buffer over another process's device memory (``CupyDeviceBuffer.export``), on
    the GPU of its PCI bus id. The memory is the exporter's own (CUDA maps no
    copy-on-write device memory): a write through it reaches every process that maps
    it. Raises ``LoadError`` without CuPy, for a GPU this process cannot see, or when
    CUDA refuses the handle."""
    cupy = _require_cupy(shared.device)
    if shared.ipc_handle is None or shared.device_id is None:
        raise LoadError(None, None, f"{shared.device}: no CUDA IPC handle to open")
    with _cuda_errors(shared.device, f"finding the GPU at PCI bus {shared.device_id}"):
        ordinal = int(cupy.cuda.runtime.deviceGetByPCIBusId(shared.device_id))
    block = _IpcBlock(cupy, ordinal, shared)
    return CupyDeviceBuffer(cupy, ordinal, block, shared.nbytes, block.free)  # type: ignore[arg-type]
