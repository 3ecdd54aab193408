"""The device protocol that the plan, allocate and upload stages program against.

A device is something that holds tensor bytes: the CPU, a real GPU (CuPy), a simulated
GPU (tests and dry runs) or an accelerator. It reports its memory, its capabilities and
its *buffer types*, named the way llama.cpp names them, because ``-ot`` rules and plan
output use those names:

=============  ============================  =====================  ================
backend        default buffer type           pinned host type       split type
=============  ============================  =====================  ================
cpu            ``CPU``                       none                   none
cupy (GPU i)   ``CUDA<i>``                   ``CUDA_Host``          ``CUDA<i>_Split``
sim (name N)   ``N`` (``g0``, ``g1``, ...)   ``N_Host``             ``N_Split``
=============  ============================  =====================  ================

A device's name is also the name of its default buffer type, so ``-ot exps=g1`` and
``-ot exps=CUDA0`` name a device and its default buffer type at once. Extra buffer types
(llama.cpp's ``get_extra_bufts``) are listed per device and named ``<device>_<suffix>``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from types import ModuleType
from typing import Any, Protocol, runtime_checkable

from aiogguf.io.ggml_types import GGMLType

__all__ = [
    "SIM_COPY_BYTES_PER_S",
    "SIM_COPY_LATENCY_US",
    "SIM_PIN_S_PER_GIB",
    "BufferRole",
    "BufferType",
    "CachedMemory",
    "CopyEvent",
    "CopyStream",
    "Device",
    "DeviceBlock",
    "DeviceBuffer",
    "DeviceCaps",
    "DeviceKind",
    "ExportableBuffer",
    "ShareableTarget",
    "SharedDeviceMemory",
    "StagingSlot",
    "UploadTarget",
    "all_buffer_types",
]

# The costs of an NVIDIA H200 on PCIe Gen5 x16, as measured on one (docs/performance.md),
# a simulated device's defaults: pinning host memory (cudaHostAlloc) per GiB, pinned
# host-to-device copies per second, and the time to queue one copy.
SIM_PIN_S_PER_GIB = 1.1
SIM_COPY_BYTES_PER_S = 55_000_000_000
SIM_COPY_LATENCY_US = 10.0


class DeviceKind(StrEnum):
    """What a device is, as llama.cpp's device types: the host, a discrete or an
    integrated GPU, or an accelerator (a host-side buffer type, never an offload target).
    Members equal their strings (``DeviceKind.GPU == "gpu"``)."""

    CPU = "cpu"
    GPU = "gpu"
    IGPU = "igpu"
    ACCEL = "accel"


class BufferRole(StrEnum):
    """What a buffer type is to its device (llama.cpp's four places it gets them from)."""

    DEFAULT = "default"  # ggml_backend_dev_buffer_type
    HOST = "host"  # ggml_backend_dev_host_buffer_type: pinned host memory
    SPLIT = "split"  # ggml_backend_split_buffer_type: rows split across devices
    EXTRA = "extra"  # ggml_backend_dev_get_extra_bufts


@dataclass(frozen=True, slots=True)
class BufferType:
    """A kind of buffer a device can allocate.

    ``host`` is True when the memory is addressable by the CPU (plain or pinned host
    memory; an accelerator that computes in host memory). ``matrices_only`` marks types
    that hold only 2-D weights: ggml's CUDA split buffers serve ``MUL_MAT`` alone, so
    norms and 3-D expert stacks fall back to the device default (and count as moved).
    """

    name: str
    device: str  # name of the device that owns it
    role: BufferRole
    host: bool
    matrices_only: bool = False


@dataclass(frozen=True, slots=True)
class DeviceCaps:
    """What a device can do (llama.cpp's ``ggml_backend_dev_caps`` plus ``mmap_support``).

    ``host_pointer``: can wrap existing host memory (a mapping) as a buffer, zero copy.
    ``async_copies`` and ``events``: host-to-device copies can be queued and waited on;
    without both (or without a pinned host buffer type) uploads are synchronous.
    ``mmap``: can load from mapped file memory; ``load.mode = "auto"`` falls back to
    ``none`` when a device cannot.
    """

    host_pointer: bool = False
    async_copies: bool = False
    events: bool = False
    mmap: bool = True


@runtime_checkable
class Device(Protocol):
    """One device. Implementations: ``CpuDevice``, ``SimDevice``, ``CupyDevice``.

    Names are unique among the devices of one process; ``device_id`` (a PCI bus id) is
    shared by two entries that are the same physical device seen by two backends.
    """

    @property
    def name(self) -> str: ...

    @property
    def kind(self) -> DeviceKind: ...

    @property
    def backend(self) -> str:
        """``cpu``, ``sim`` or ``cupy``."""
        ...

    @property
    def device_id(self) -> str | None: ...

    @property
    def caps(self) -> DeviceCaps: ...

    @property
    def buffer_type(self) -> BufferType:
        """The default buffer type."""
        ...

    @property
    def host_buffer_type(self) -> BufferType | None:
        """The pinned host buffer type, if the device has one."""
        ...

    @property
    def split_buffer_type(self) -> BufferType | None:
        """The row-split buffer type (``split_mode = "row"``), if the device has one."""
        ...

    @property
    def extra_buffer_types(self) -> tuple[BufferType, ...]: ...

    def memory(self) -> tuple[int, int]:
        """``(free_bytes, total_bytes)`` now. Devices that cannot tell report ``(0, 0)``."""
        ...

    def supports(self, tensor_type: GGMLType) -> bool:
        """Whether the device can hold (and compute with) tensors of this ggml type."""
        ...


def all_buffer_types(device: Device) -> tuple[BufferType, ...]:
    """Every buffer type of ``device``: default, split, host, then extras."""
    found = [device.buffer_type, device.split_buffer_type, device.host_buffer_type]
    return tuple(b for b in found if b is not None) + device.extra_buffer_types


# --- the upload side: device memory, staging slots, copy streams and events ---------------


@runtime_checkable
class DeviceBuffer(Protocol):
    """One allocation of device memory: the image of one planned buffer (design §2.1).

    Copies into it are asynchronous: read it (``to_host``, or kernels on ``array()``)
    only after the uploader drained its device.
    """

    device: str  # name of the device that holds it
    nbytes: int
    xp: ModuleType  # the array module of its arrays: numpy (sim) or cupy

    def array(self, offset: int, nbytes: int) -> Any:
        """A 1-D uint8 array of ``xp`` viewing ``nbytes`` at ``offset`` (no copy)."""
        ...

    def to_host(self, offset: int, nbytes: int) -> memoryview:
        """A host copy of ``nbytes`` at ``offset``. Blocking: call it from a worker thread."""
        ...

    def close(self) -> None:
        """Free the memory (arrays still viewing it keep it alive). Idempotent."""
        ...


@dataclass(frozen=True, slots=True)
class SharedDeviceMemory:
    """How another process reaches a device buffer's memory (a load with ``[load]
    shareable``): a memfd for the simulated device (``fd``, the buffer ``offset`` bytes
    into it), a CUDA IPC handle for a GPU (``ipc_handle`` of the base allocation, the
    buffer ``offset`` bytes into it, on the GPU of PCI bus id ``device_id``). ``fd`` is
    the buffer's own: valid while the buffer is open, never to be closed by the caller."""

    device: str
    nbytes: int
    offset: int
    fd: int | None = None
    ipc_handle: bytes | None = None
    device_id: str | None = None


@runtime_checkable
class ExportableBuffer(Protocol):
    """A device buffer whose memory another process can map (``SharedDeviceMemory``)."""

    def export(self) -> SharedDeviceMemory:
        """Where another process finds this buffer's memory. Raises ``LoadError`` when
        it cannot be shared (a simulated buffer not allocated shareable)."""
        ...


@runtime_checkable
class ShareableTarget(Protocol):
    """A device that allocates shareable memory apart from its arena (the simulated
    device: its arena's memory is private to the process). A device without it (CUDA:
    every ``cudaMalloc`` has an IPC handle) shares its arena's buffers."""

    def allocate_shareable(self, nbytes: int) -> DeviceBuffer:
        """``nbytes`` of device memory that ``export`` hands to another process; freed
        when closed. Raises ``LoadError`` when the device cannot allocate it."""
        ...


class CopyEvent(Protocol):
    """A CUDA-style event of one device. Never recorded, it counts as done. Events are not
    bound to a stream: a staging slot's event is recorded on whichever stream last copied
    out of the slot (slots outlive the loads and streams that use them)."""

    def record(self, stream: CopyStream) -> None:
        """Mark the current end of ``stream``: the event completes when all work issued
        on that stream so far has completed."""
        ...

    def query(self) -> bool:
        """Whether the work before the last ``record()`` has completed. Never blocks."""
        ...

    def synchronize(self) -> None:
        """Block the calling thread until ``query()`` is true."""
        ...


class StagingSlot(Protocol):
    """One host staging buffer of a device: pinned where the device has a pinned host
    buffer type, aligned always (O_DIRECT reads land in it directly). Slots belong to the
    device's process-wide ``StagingPool``; a load leases them."""

    index: int
    nbytes: int

    def view(self) -> memoryview:
        """The writable, aligned bytes of the slot (``nbytes`` long, format ``B``)."""
        ...

    def begin_write(self) -> None:
        """Called before the slot is refilled. The simulated device raises its
        ``RingViolation`` here when a copy out of the slot is still in flight."""
        ...

    def close(self) -> None:
        """Free the slot's memory. Idempotent."""
        ...


class CopyStream(Protocol):
    """One device's in-order host-to-device copy queue (a CUDA stream), used by one
    transfer thread of one load."""

    device: str
    asynchronous: bool  # copies are queued (copy_async); else only copy_sync works

    def copy_async(
        self, dest: DeviceBuffer, dest_offset: int, slot: StagingSlot, nbytes: int
    ) -> None:
        """Queue a copy of the slot's first ``nbytes`` into ``dest`` at ``dest_offset``;
        returns at once. The slot must not be written again before the copy completes."""
        ...

    def copy_sync(self, dest: DeviceBuffer, dest_offset: int, src: memoryview) -> None:
        """Copy ``src`` into ``dest`` at ``dest_offset`` and return when it is done."""
        ...

    def synchronize(self) -> None:
        """Block until every copy issued so far has completed; raise the first failure of
        any of them (``LoadError``, or the simulated device's ``RingViolation``)."""
        ...

    def close(self) -> None:
        """Wait for the queue to empty, then release the stream (and join its threads).
        Idempotent."""
        ...


class DeviceBlock(Protocol):
    """One allocation of device memory (a ``cudaMalloc``) that the device's arena
    (``io/devices/arena.py``) keeps across loads, handing it to one load's buffer at a
    time."""

    device: str
    nbytes: int

    def buffer(self, nbytes: int, released: Callable[[], None]) -> DeviceBuffer:
        """A buffer over the block's first ``nbytes``, for one load. ``released()`` is
        called once, after the buffer is closed and no array viewing it is alive (from
        whichever thread drops the last one)."""
        ...

    def fence(self) -> CopyEvent:
        """An event recorded now behind the work queued on the device's default stream
        (kernels a user ran on the last load's arrays): the block is handed out again
        only once it has completed."""
        ...

    def free(self) -> None:
        """Give the memory back to the device (``cudaFree``: a device-wide
        synchronisation). Idempotent."""
        ...


@runtime_checkable
class UploadTarget(Protocol):
    """A device that holds memory of its own and takes uploads (sim and cupy GPUs)."""

    @property
    def name(self) -> str: ...

    @property
    def caps(self) -> DeviceCaps: ...

    @property
    def host_buffer_type(self) -> BufferType | None: ...

    def memory(self) -> tuple[int, int]:
        """``(free_bytes, total_bytes)`` now (``(0, 0)`` when it cannot tell)."""
        ...

    def allocate(self, nbytes: int) -> DeviceBuffer:
        """Blocking: ``nbytes`` of device memory of its own, freed when it is closed and
        no array views it. Raises ``LoadError`` when it fails."""
        ...

    def allocate_block(self, nbytes: int) -> DeviceBlock:
        """Blocking: ``nbytes`` of device memory for the device's arena (loads take
        their buffers from the arena, never from here). Raises ``LoadError`` when it
        fails (out of memory included)."""
        ...

    def open_copy_stream(self, *, asynchronous: bool) -> CopyStream:
        """A new copy stream; the caller must ``close()`` it."""
        ...

    def open_staging_slot(self, index: int, nbytes: int, alignment: int) -> StagingSlot:
        """Blocking: a staging slot of ``nbytes`` starting at an ``alignment`` boundary,
        pinned where the device has a pinned host buffer type (pinning is slow: the
        ``StagingPool`` keeps slots for the next load). Raises ``LoadError``."""
        ...

    def new_event(self) -> CopyEvent:
        """A new event of this device, never recorded (done)."""
        ...


@runtime_checkable
class CachedMemory(Protocol):
    """A device that keeps freed device memory for later allocations (the simulated
    device's cache). ``close_staging_pools`` (``release_device_memory``) empties it."""

    def release_cached_memory(self) -> int:
        """Give the idle cached memory back; the bytes freed."""
        ...
