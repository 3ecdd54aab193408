"""Simulated GPUs (``[[device]]`` / ``--sim-gpu``) for dry runs and tests.

A ``SimDevice`` describes a simulated GPU: its memory, capabilities and buffer types,
every one of them settable, including ggml types it refuses to hold. It also *behaves*
like a GPU for the upload stage, so CI can test the staging ring without one:

* device memory is host memory (numpy arrays, filled with a poison byte), counted and
  capped at the device's ``total``; ``live`` tells how much is allocated right now. A
  GPU's memory takes no host page faults, so the sim backs each new allocation in one
  kernel call on the allocating thread (``MADV_POPULATE_WRITE``: the allocate stage pays
  it, and no copy ever faults). Freed allocations, once no array views them, go to a
  per-device cache (``SimMemoryCache``, the pattern of CuPy's memory pool) that serves
  later allocations of a fitting size, so the backing is paid once per process, as a
  GPU's memory is there from the start. ``release_cached_memory()`` (called by
  ``release_device_memory``) gives the cache back to the OS;
* it carries a real GPU's costs, so that a design that is slow on a GPU is slow here
  too: pinning a staging slot sleeps ``pin_s_per_gib`` per GiB, one pin at a time per
  device (the driver serialises them), and a copy takes
  ``copy_latency_us`` plus ``nbytes / bandwidth`` (plus a random delay up to
  ``max_delay_ms``), or the host copy's own time where that is longer; the copies of
  all its streams share the one ``bandwidth``, as they share a PCIe link. The defaults are
  an NVIDIA H200 on PCIe Gen5 (see ``SIM_*`` below); the sleeps release the GIL, as the
  driver's waits do;
* a ``SimCopyStream`` runs queued copies in order on its own thread (the copy engine);
* ``SimEvent`` has CUDA's record / query / synchronize semantics, on any stream;
* costs a GPU does not have: backing a new allocation costs the host its page zeroing
  (in the allocate stage, see the README's ``gpu_sim.py`` figures), which ``cudaMalloc``
  does not (the CuPy backend allocates with it directly, no pool); the copy engine is a
  host thread whose memcpy takes a host core, where a GPU's DMA engine takes none. With
  ``keep_bytes=False`` the device pays neither: its memory is never backed, a copy
  takes its modelled time without moving a byte (the ring invariant is still checked),
  and device memory reads back zeros, so nothing that reads it back can be trusted
  (checks of units that straddle two staging pieces included). That is for benchmarks
  of the pipeline's shape (``bench/gpu_sim.py``), never for tests of its bytes;
* ``cudaMalloc`` and ``cudaFree`` (``allocate``/``allocate_block``, and closing a
  buffer of its own or freeing a block) are what they are on a GPU: a device-wide
  synchronisation, which waits until every copy queued on any stream of the device has
  completed, so a free during another load's copies stalls the thread that frees
  (``SimDevice.syncs`` counts them, and the time they waited). Loads take their memory
  from the device's arena (``arena.py``), which keeps it across loads;
* not modelled at all: device memory bandwidth, PCIe sharing between devices and
  ``cudaMalloc``'s own latency beyond that wait;
* the device checks the ring invariant itself: refilling a staging slot whose last copy
  (on whichever stream) has not completed raises ``RingViolation`` naming the slot
  (``begin_write``), and every copy fingerprints its source when it is issued and again
  when it runs, so a write into a busy slot that skipped ``begin_write`` is caught too. A
  violation is sticky: every later ``copy_async`` and ``synchronize`` of that stream
  raises it, so it fails the load.
"""

from __future__ import annotations

import mmap
import os
import random
import threading
import time
import weakref
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from types import ModuleType
from typing import Any

import numpy

from aiogguf.errors import ConfigError, GGUFError, LoadError
from aiogguf.io._devices import base
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
from aiogguf.io._devices.sim_memory import BackedBlock, SimMemoryCache, SimMemoryStats
from aiogguf.io.buffers import HostBuffer, back_pages, held_by_views, sealed_memfd
from aiogguf.io.files import merge_range
from aiogguf.io.ggml_types import GGMLType, ggml_type_by_name
from aiogguf.io.workers import at_load_priority

__all__ = [
    "SIM_COPY_BYTES_PER_S",
    "SIM_COPY_LATENCY_US",
    "SIM_MEMORY_CACHE_BYTES",
    "SIM_PIN_S_PER_GIB",
    "RingViolation",
    "SimBlock",
    "SimCopyStream",
    "SimDevice",
    "SimDeviceBuffer",
    "SimEvent",
    "SimMemoryCache",
    "SimMemoryStats",
    "SimStagingSlot",
    "SimSyncs",
    "SimUsage",
]

# Fresh device memory holds this byte, so a range that no copy reached stands out.
POISON_BYTE = 0xA5

# The costs of an NVIDIA H200 (``base``: the config's defaults for a simulated device).
SIM_PIN_S_PER_GIB = base.SIM_PIN_S_PER_GIB
SIM_COPY_BYTES_PER_S = base.SIM_COPY_BYTES_PER_S
SIM_COPY_LATENCY_US = base.SIM_COPY_LATENCY_US
# Idle device memory a simulated device keeps for reuse, at most: it is host RAM.
SIM_MEMORY_CACHE_BYTES = 4 * 1024**3


class RingViolation(GGUFError):
    """A staging slot was written while a copy out of it was still in flight.

    Raised by the simulated device only: it means the upload ring is broken (a bug),
    never that the file is bad. Not a ``LoadError``, so no I/O fallback can swallow it.
    """

    def __init__(self, device: str, slot: int, problem: str) -> None:
        self.device = device
        self.slot = slot
        self.problem = problem
        super().__init__(f"device {device}: staging slot {slot}: {problem}")


@dataclass(frozen=True, slots=True)
class SimSyncs:
    """The device-wide synchronisations (``cudaMalloc``, ``cudaFree``) so far, and how
    long their callers waited in them."""

    count: int
    wait_s: float


@dataclass(frozen=True, slots=True)
class SimUsage:
    """What a simulated device holds right now."""

    buffers: int
    buffer_bytes: int
    slots: int
    streams: int


class SimDevice:
    """A simulated GPU named ``name`` (default ``g<index>``); buffer types ``name``,
    ``name_Host`` (pinned host) and ``name_Split`` (row split)."""

    backend = "sim"

    def __init__(
        self,
        name: str,
        *,
        kind: DeviceKind | str = DeviceKind.GPU,
        free: int = 24 * 1024**3,
        total: int | None = None,
        device_id: str | None = None,
        unsupported: Iterable[str] = (),
        host_pointer: bool = False,
        async_copies: bool = True,
        events: bool = True,
        pinned_host: bool = True,
        split_buffer: bool = True,
        mmap: bool = True,
        extra_buffer_types: Sequence[str] = (),
        bandwidth: int | None = SIM_COPY_BYTES_PER_S,
        copy_latency_us: float = SIM_COPY_LATENCY_US,
        pin_s_per_gib: float = SIM_PIN_S_PER_GIB,
        max_delay_ms: float = 0.0,
        seed: int | None = None,
        memory_cache_bytes: int = SIM_MEMORY_CACHE_BYTES,
        keep_bytes: bool = True,
    ) -> None:
        if kind == DeviceKind.CPU:
            raise ConfigError("device.kind", None, "a simulated device cannot be the CPU")
        self.name = name
        self.kind: DeviceKind = DeviceKind(kind)
        self.device_id = device_id
        self.free = free
        self.total: int = total if total is not None else free
        self.caps: DeviceCaps = DeviceCaps(
            host_pointer=host_pointer, async_copies=async_copies, events=events, mmap=mmap
        )
        unsupported_types: set[int] = set()
        for type_name in unsupported:
            try:
                unsupported_types.add(ggml_type_by_name(type_name).id)
            except KeyError:
                raise ConfigError(
                    "device.unsupported", None, f"{type_name!r} is not a ggml type name"
                ) from None
        self.unsupported: frozenset[int] = frozenset(unsupported_types)
        # An accelerator computes in host memory (llama.cpp's BLAS/AMX devices).
        self.buffer_type: BufferType = BufferType(
            name, name, BufferRole.DEFAULT, host=kind == "accel"
        )
        self.host_buffer_type: BufferType | None = (
            BufferType(f"{name}_Host", name, BufferRole.HOST, host=True) if pinned_host else None
        )
        self.split_buffer_type: BufferType | None = (
            BufferType(f"{name}_Split", name, BufferRole.SPLIT, host=False, matrices_only=True)
            if split_buffer
            else None
        )
        self.extra_buffer_types: tuple[BufferType, ...] = tuple(
            BufferType(f"{name}_{suffix}", name, BufferRole.EXTRA, host=kind == "accel")
            for suffix in extra_buffer_types
        )
        self.bandwidth = bandwidth
        self.copy_latency_us = copy_latency_us
        self.pin_s_per_gib = pin_s_per_gib
        self.max_delay_ms = max_delay_ms
        self.seed = seed
        self.keep_bytes = keep_bytes
        self._lock = threading.Lock()
        self._link_free_at = 0.0  # perf_counter time the last copy queued ends
        self._usage = SimUsage(0, 0, 0, 0)
        self._streams_opened = 0
        self._open_streams: weakref.WeakSet[SimCopyStream] = weakref.WeakSet()
        self._pin_lock = threading.Lock()  # a driver pins one buffer at a time
        self._syncs = SimSyncs(0, 0.0)
        self.memory_cache: SimMemoryCache = SimMemoryCache(name, memory_cache_bytes)

    def memory(self) -> tuple[int, int]:
        return self.free, self.total

    def supports(self, tensor_type: GGMLType) -> bool:
        return tensor_type.valid and tensor_type.id not in self.unsupported

    @property
    def live(self) -> SimUsage:
        """Buffers, slots and streams allocated and not yet closed."""
        with self._lock:
            return self._usage

    def _count(
        self, buffers: int = 0, buffer_bytes: int = 0, slots: int = 0, streams: int = 0
    ) -> None:
        with self._lock:
            u = self._usage
            self._usage = SimUsage(
                u.buffers + buffers,
                u.buffer_bytes + buffer_bytes,
                u.slots + slots,
                u.streams + streams,
            )

    @property
    def syncs(self) -> SimSyncs:
        """Device-wide synchronisations so far (allocations and frees)."""
        with self._lock:
            return self._syncs

    def synchronize_device(self) -> None:
        """Wait until every copy queued so far on any stream of the device has completed
        (what ``cudaMalloc`` and ``cudaFree`` do on a GPU; it blocks the calling thread)."""
        began = time.perf_counter()
        with self._lock:
            streams = list(self._open_streams)
        for stream in streams:
            stream._drain()
        waited = time.perf_counter() - began
        with self._lock:
            self._syncs = SimSyncs(self._syncs.count + 1, self._syncs.wait_s + waited)

    def allocate(self, nbytes: int) -> SimDeviceBuffer:
        """``nbytes`` of simulated device memory, poisoned, freed (a device-wide
        synchronisation) when it is closed. Blocking: waits for every stream's copies,
        and memory the cache cannot supply is backed before this returns.

        Raises ``LoadError`` when the device's ``total`` would be exceeded."""
        self._reserve(nbytes)
        try:
            return SimDeviceBuffer(self, nbytes)
        except BaseException:
            self._count(buffers=-1, buffer_bytes=-nbytes)
            raise

    def allocate_block(self, nbytes: int) -> SimBlock:
        """``nbytes`` of simulated device memory for the device's arena, backed (see
        ``allocate``). Raises ``LoadError`` when the device's ``total`` would be
        exceeded, or the host cannot back it."""
        self._reserve(nbytes)
        try:
            return SimBlock(self, nbytes)
        except BaseException:
            self._count(buffers=-1, buffer_bytes=-nbytes)
            raise

    def allocate_shareable(self, nbytes: int) -> SimDeviceBuffer:
        """``nbytes`` of simulated device memory that another process can map: a sealed
        memfd, backed now, handed out by ``SimDeviceBuffer.export`` (what a CUDA IPC
        handle is to a GPU). Freed when closed and no array views it; never cached.
        Raises ``LoadError`` when the device's ``total`` would be exceeded or the host
        cannot give the memory."""
        self._reserve(nbytes)
        try:
            fd = sealed_memfd(f"aiogguf-{self.name}", max(nbytes, 1))
        except MemoryError as exc:
            self._count(buffers=-1, buffer_bytes=-nbytes)
            raise LoadError(None, None, f"device {self.name}: {exc}") from exc
        try:
            mapping = mmap.mmap(fd, max(nbytes, 1), flags=mmap.MAP_SHARED)
            memory = numpy.frombuffer(mapping, dtype=numpy.uint8)
            back_pages(memory)
        except BaseException:
            os.close(fd)
            self._count(buffers=-1, buffer_bytes=-nbytes)
            raise
        # Counted free once the buffer is closed and its last view gone, as cudaFree.
        freed = weakref.finalize(memory, self._count, buffers=-1, buffer_bytes=-nbytes)
        freed.atexit = False
        buffer = SimDeviceBuffer(self, nbytes, memory=memory, released=_nothing)
        buffer._shared_fd = fd
        return buffer

    def map_shared(self, shared: SharedDeviceMemory) -> SimDeviceBuffer:
        """A buffer of this device over memory another process's ``export`` handed out
        (its memfd, already checked to hold ``shared.offset + shared.nbytes`` bytes and
        to be sealed), mapped copy-on-write: every byte reads as the exporter's, and a
        write stays in this process. The caller keeps the descriptor. Raises
        ``LoadError`` when the mapping is refused."""
        assert shared.fd is not None
        try:
            host = HostBuffer.map_private(shared.fd, shared.offset, shared.nbytes)
        except MemoryError as exc:
            raise LoadError(None, None, f"device {self.name}: {exc}") from exc
        buffer = SimDeviceBuffer(self, shared.nbytes, memory=host.as_array(), released=host.close)
        buffer.mark_written(0, shared.nbytes)  # the exporter's bytes, never poison
        return buffer

    def _reserve(self, nbytes: int) -> None:
        """``cudaMalloc``'s part: a device-wide synchronisation, then the accounting."""
        if nbytes < 0:
            raise ValueError(f"device {self.name}: cannot allocate {nbytes} bytes")
        self.synchronize_device()
        with self._lock:
            u = self._usage
            if u.buffer_bytes + nbytes > self.total:
                raise LoadError(
                    None,
                    None,
                    f"device {self.name}: out of memory: {nbytes} bytes requested, "
                    f"{self.total - u.buffer_bytes} of {self.total} free",
                )
            self._usage = SimUsage(u.buffers + 1, u.buffer_bytes + nbytes, u.slots, u.streams)

    def release_cached_memory(self) -> int:
        """Give the idle memory of the device's cache back to the OS; the bytes freed.
        Memory that arrays still view returns to the cache when they die (and stays
        there until the next call)."""
        return self.memory_cache.release()

    def open_copy_stream(self, *, asynchronous: bool) -> SimCopyStream:
        """A copy stream; ``asynchronous`` starts its copy-engine thread."""
        with self._lock:
            self._streams_opened += 1
            n = self._streams_opened
        seed = None if self.seed is None else self.seed * 1_000_003 + n
        stream = SimCopyStream(self, asynchronous=asynchronous, seed=seed)
        with self._lock:
            self._open_streams.add(stream)
        return stream

    def open_staging_slot(self, index: int, nbytes: int, alignment: int) -> SimStagingSlot:
        """A staging slot; takes as long as pinning ``nbytes`` takes on the modelled GPU
        (when the device has a pinned host buffer type), one pin at a time: the driver
        serialises them, so threads that pin side by side wait for each other."""
        slot = SimStagingSlot(self, index, nbytes, alignment)
        if self.host_buffer_type is not None and self.pin_s_per_gib:
            with self._pin_lock:
                time.sleep(nbytes / 1024**3 * self.pin_s_per_gib)
        return slot

    def new_event(self) -> SimEvent:
        return SimEvent()

    def __repr__(self) -> str:
        return f"SimDevice({self.name!r}, kind={self.kind!r}, free={self.free})"


# ---------------------------------------------------------------------------------------
# The behaviour: device memory, staging slots, the copy engine and its events.


def _check_range(what: str, offset: int, nbytes: int, size: int) -> None:
    if offset < 0 or nbytes < 0 or offset + nbytes > size:
        raise ValueError(f"{what}: range [{offset}, {offset + nbytes}) outside [0, {size})")


class SimBlock:
    """One simulated ``cudaMalloc`` that the device's arena keeps across loads: memory
    from the device's ``SimMemoryCache`` (none with ``keep_bytes=False``), lent to one
    load's ``SimDeviceBuffer`` at a time."""

    def __init__(self, owner: SimDevice, nbytes: int) -> None:
        self.device: str = owner.name
        self.nbytes = nbytes
        self._owner = owner
        self._memory: BackedBlock | None = (
            owner.memory_cache.take(nbytes) if owner.keep_bytes else None
        )
        self._freed = False

    def buffer(self, nbytes: int, released: Callable[[], None]) -> SimDeviceBuffer:
        if self._freed:
            raise LoadError(None, None, f"device {self.device}: block used after free")
        _check_range(f"device {self.device} block", 0, nbytes, self.nbytes)
        return SimDeviceBuffer(self._owner, nbytes, memory=self._memory, released=released)

    def fence(self) -> SimEvent:
        # No kernel runs on the simulated device's default stream: nothing to wait for.
        return SimEvent()

    def free(self) -> None:
        if self._freed:
            return
        self._freed = True
        self._owner.synchronize_device()
        memory, self._memory = self._memory, None
        if memory is not None:
            self._owner.memory_cache.give_back(memory)
        self._owner._count(buffers=-1, buffer_bytes=-self.nbytes)


def _nothing() -> None:
    pass


class SimDeviceBuffer:
    """Simulated device memory: a numpy array standing in for a device allocation.

    Allocated alone (``SimDevice.allocate``), the memory comes from the device's
    ``SimMemoryCache``, backed before the buffer exists, and goes back to it once the
    buffer is closed and no array views it. Over an arena's block (``SimBlock.buffer``),
    it is the block's memory, and ``released`` is called once the buffer is closed and
    no array views it.

    Bytes no copy has reached read as ``POISON_BYTE``, memory the cache reused included.
    The poison is laid lazily, on the first read of a range no copy wrote: a second pass
    over gigabytes up front would cost the host what ``cudaMalloc`` does not cost a GPU."""

    xp: ModuleType = numpy
    # The memfd of a shareable buffer (``SimDevice.allocate_shareable``): ``export``.
    _shared_fd: int | None = None

    def __init__(
        self,
        owner: SimDevice,
        nbytes: int,
        *,
        memory: BackedBlock | None = None,
        released: Callable[[], None] | None = None,
    ) -> None:
        self.device: str = owner.name
        self.nbytes = nbytes
        self._owner = owner
        self._own = released is None  # memory of its own, freed by close()
        data: numpy.ndarray[Any, numpy.dtype[numpy.uint8]]
        if released is not None:
            # A new array over the block for this buffer alone: its views (array(), the
            # copy engine's slices) have it as their base, so its death says that the
            # last of them is gone.
            if memory is not None:
                data = numpy.frombuffer(memory.data, dtype=numpy.uint8, count=nbytes)
            else:
                data = numpy.zeros(nbytes, dtype=numpy.uint8)
            on_release = weakref.finalize(data, released)
            on_release.atexit = False
        elif owner.keep_bytes:
            block = owner.memory_cache.take(nbytes)
            # A new array over the block's memory: its base is a memoryview, so no view
            # of it reaches past it to the block.
            data = numpy.frombuffer(block.data, dtype=numpy.uint8, count=nbytes)
            # Every view handed out (array(), the copy engine's slices) has ``data`` as
            # its base: the block goes back to the cache when the last of them dies,
            # never while someone can still read or write it.
            finalizer = weakref.finalize(data, owner.memory_cache.give_back, block)
            finalizer.atexit = False
        else:
            # No copy writes here: large zeroed memory costs nothing until it is read.
            data = numpy.zeros(nbytes, dtype=numpy.uint8)
        self._data: numpy.ndarray[Any, numpy.dtype[numpy.uint8]] | None = data
        self._lock = threading.Lock()
        self._filled: list[tuple[int, int]] = []  # sorted, disjoint: written or poisoned

    def mark_written(self, offset: int, nbytes: int) -> None:
        """Record that a copy wrote ``[offset, offset + nbytes)`` (the copy engine)."""
        with self._lock:
            self._filled = merge_range(self._filled, offset, offset + nbytes)

    def _poison_gaps(self, offset: int, nbytes: int) -> None:
        """Lay the poison in the parts of ``[offset, offset + nbytes)`` nothing wrote."""
        data = self._live()
        end = offset + nbytes
        with self._lock:
            pos = offset
            for lo, hi in self._filled:
                if hi <= pos:
                    continue
                if lo >= end:
                    break
                if lo > pos:
                    data[pos:lo] = POISON_BYTE
                pos = max(pos, hi)
            if pos < end:
                data[pos:end] = POISON_BYTE
            self._filled = merge_range(self._filled, offset, end)

    @property
    def closed(self) -> bool:
        return self._data is None

    def _live(self) -> numpy.ndarray[Any, numpy.dtype[numpy.uint8]]:
        data = self._data
        if data is None:
            raise LoadError(None, None, f"device {self.device}: buffer used after close")
        return data

    def array(self, offset: int, nbytes: int) -> Any:
        """A uint8 view of ``nbytes`` at ``offset``."""
        _check_range(f"device {self.device} buffer", offset, nbytes, self.nbytes)
        self._poison_gaps(offset, nbytes)
        return self._live()[offset : offset + nbytes]

    def to_host(self, offset: int, nbytes: int) -> memoryview:
        _check_range(f"device {self.device} buffer", offset, nbytes, self.nbytes)
        self._poison_gaps(offset, nbytes)
        return self._live()[offset : offset + nbytes].copy().data

    def export(self) -> SharedDeviceMemory:
        """Where another process finds this buffer's memory: its memfd (the buffer's
        own, valid while it is open). Raises ``LoadError`` for a buffer not allocated
        shareable, or closed."""
        self._live()
        if self._shared_fd is None:
            raise LoadError(
                None,
                None,
                f"device {self.device}: the buffer is not shareable (load with "
                "[load] shareable = true)",
            )
        return SharedDeviceMemory(self.device, self.nbytes, 0, fd=self._shared_fd)

    def close(self) -> None:
        # Views handed out by array() keep the memory alive and out of the cache; the
        # device's accounting is what "free" means here.
        with self._owner._lock:
            data, self._data = self._data, None
            if data is None:
                return
            fd, self._shared_fd = self._shared_fd, None
        if fd is not None:
            os.close(fd)  # the mappings (ours, other processes') keep the memory
        held_by_views(data)  # forgotten at once unless a view keeps it
        del data
        if self._own:
            self._owner.synchronize_device()  # cudaFree
            self._owner._count(buffers=-1, buffer_bytes=-self.nbytes)

    def __repr__(self) -> str:
        state = "closed" if self._data is None else "open"
        return f"SimDeviceBuffer({self.device!r}, {self.nbytes}, {state})"


# A copy's fingerprint reads this many of its bytes, evenly spread: a refill with other
# data changes some of them. A checksum of every byte would cost the host more CPU time
# than the copy itself (which a GPU does without the CPU), and zlib lets go of the GIL
# for more than 5 KiB.
_FINGERPRINT_BYTES = 4096


def _fingerprint(data: memoryview) -> int:
    """A checksum of a sample of ``data``'s bytes (and of its length)."""
    stride = max(len(data) // _FINGERPRINT_BYTES, 1)
    sample = numpy.frombuffer(data, dtype=numpy.uint8)[::stride]
    return zlib.crc32(sample.tobytes(), len(data))


class SimStagingSlot:
    """A staging slot in anonymous mapped memory, its view aligned to ``alignment``."""

    def __init__(self, owner: SimDevice, index: int, nbytes: int, alignment: int) -> None:
        self.index = index
        self.nbytes = nbytes
        self.device: str = owner.name
        self._owner = owner
        self._buffer: HostBuffer | None = HostBuffer(nbytes, alignment=alignment)
        # The stream and sequence number of the last copy issued out of this slot.
        self.pending: tuple[SimCopyStream, int] | None = None
        owner._count(slots=1)

    def view(self) -> memoryview:
        if self._buffer is None:
            raise LoadError(None, None, f"device {self.device}: slot {self.index} is closed")
        return self._buffer.memoryview

    def begin_write(self) -> None:
        if self.pending is not None:
            stream, seq = self.pending
            stream._check_slot_free(self, seq)

    def close(self) -> None:
        buffer, self._buffer = self._buffer, None
        if buffer is None:
            return
        self._owner._count(slots=-1)
        buffer.close()
        if not buffer.memory_released:
            # Someone kept a view of the slot past its fill: the memory is only freed
            # when that view dies, and whatever holds it could see reused bytes.
            raise LoadError(
                None,
                None,
                f"device {self.device}: staging slot {self.index} is still "
                "referenced after its last use (a fill kept a view of it)",
            )


class SimEvent:
    """CUDA event semantics: recorded on a ``SimCopyStream``, done once that stream's
    copies issued before the record have completed."""

    def __init__(self) -> None:
        self._stream: SimCopyStream | None = None
        self._target = 0  # never recorded: done, as in CUDA

    def record(self, stream: CopyStream) -> None:
        if not isinstance(stream, SimCopyStream):
            raise ValueError(f"cannot record a simulated event on {stream!r}")
        with stream._cond:
            self._stream, self._target = stream, stream._issued

    def query(self) -> bool:
        stream = self._stream
        if stream is None:
            return True
        with stream._cond:
            return stream._completed >= self._target

    def synchronize(self) -> None:
        stream = self._stream
        if stream is None:
            return
        with stream._cond:
            stream._cond.wait_for(lambda: stream._completed >= self._target)


@dataclass(frozen=True, slots=True)
class _Copy:
    seq: int
    dest: SimDeviceBuffer
    dest_offset: int
    slot: SimStagingSlot
    nbytes: int
    crc: int


class _StreamState(Enum):
    OPEN = "open"
    CLOSED = "closed"


class SimCopyStream:
    """One device's copy queue: copies run in issue order on the copy-engine thread."""

    def __init__(self, owner: SimDevice, *, asynchronous: bool, seed: int | None = None) -> None:
        self.device: str = owner.name
        self.asynchronous = asynchronous
        self._owner = owner
        self._rng = random.Random(seed)
        self._cond = threading.Condition()
        self._queue: deque[_Copy] = deque()
        self._issued = 0
        self._completed = 0
        self._error: BaseException | None = None
        self._closing = False
        self._state = _StreamState.OPEN
        self._sync_lock = threading.Lock()  # one synchronous copy at a time
        self.copies_done: int = 0
        owner._count(streams=1)
        self._thread: threading.Thread | None = None
        if asynchronous:
            self._thread = threading.Thread(
                target=self._run, name=f"aiogguf-sim-copy-{owner.name}", daemon=True
            )
            self._thread.start()

    # -- the protocol -------------------------------------------------------------------

    def copy_async(
        self, dest: DeviceBuffer, dest_offset: int, slot: StagingSlot, nbytes: int
    ) -> None:
        self._check_open()
        if not self.asynchronous:
            raise RuntimeError(f"device {self.device}: this stream takes synchronous copies only")
        sim_dest = self._check_copy(dest, dest_offset, nbytes)
        if not isinstance(slot, SimStagingSlot) or slot.device != self.device:
            raise ValueError(f"device {self.device}: slot {slot.index} belongs to another device")
        if nbytes > slot.nbytes:
            raise ValueError(f"device {self.device}: {nbytes} bytes > slot size {slot.nbytes}")
        crc = _fingerprint(slot.view()[:nbytes])
        with self._cond:
            self._raise_failure()
            self._issued += 1
            slot.pending = (self, self._issued)
            self._queue.append(_Copy(self._issued, sim_dest, dest_offset, slot, nbytes, crc))
            self._cond.notify_all()

    def copy_sync(self, dest: DeviceBuffer, dest_offset: int, src: memoryview) -> None:
        self._check_open()
        sim_dest = self._check_copy(dest, dest_offset, src.nbytes)
        with self._sync_lock:
            self._raise_failure()
            began = time.perf_counter()
            if self._owner.keep_bytes:
                sim_dest._live()[dest_offset : dest_offset + src.nbytes] = numpy.frombuffer(
                    src, dtype=numpy.uint8
                )
            sim_dest.mark_written(dest_offset, src.nbytes)
            self._sleep_rest(began, src.nbytes)
            self.copies_done += 1

    def synchronize(self) -> None:
        with self._cond:
            target = self._issued
            self._cond.wait_for(lambda: self._completed >= target)
            self._raise_failure()

    def close(self) -> None:
        if self._state is _StreamState.CLOSED:
            return
        self._state = _StreamState.CLOSED
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        with self._owner._lock:
            self._owner._open_streams.discard(self)
        self._owner._count(streams=-1)

    def _drain(self) -> None:
        """Wait until every copy issued so far has run (a device-wide synchronisation's
        part: failures stay with the stream's own ``synchronize``)."""
        with self._cond:
            target = self._issued
            self._cond.wait_for(lambda: self._completed >= target)

    # -- the invariant --------------------------------------------------------------------

    def _check_slot_free(self, slot: SimStagingSlot, seq: int) -> None:
        with self._cond:
            if seq > self._completed:
                violation = RingViolation(
                    self.device,
                    slot.index,
                    f"written while copy #{seq} out of it is still in flight "
                    f"(copies completed: up to #{self._completed})",
                )
                self._fail(violation)
                raise violation

    # -- internals ------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._state is not _StreamState.OPEN:
            raise RuntimeError(f"device {self.device}: copy stream used after close")

    def _check_copy(self, dest: DeviceBuffer, dest_offset: int, nbytes: int) -> SimDeviceBuffer:
        if not isinstance(dest, SimDeviceBuffer) or dest.device != self.device:
            raise ValueError(f"device {self.device}: cannot copy into {dest!r}")
        _check_range(f"copy into device {self.device} buffer", dest_offset, nbytes, dest.nbytes)
        return dest

    def _sleep_rest(self, began: float, nbytes: int) -> None:
        """Make a copy that began at ``began`` last as long as the modelled GPU's: the
        host copy already took part of that time (or more). Its bytes cross the device's
        one link after every copy queued before them on any of its streams: streams run
        side by side, but share the bandwidth."""
        owner = self._owner
        ready = began + owner.copy_latency_us / 1e6
        ready += self._rng.uniform(0.0, owner.max_delay_ms) / 1000.0
        end = ready
        if owner.bandwidth:
            with owner._lock:
                end = max(ready, owner._link_free_at) + nbytes / owner.bandwidth
                owner._link_free_at = end
        rest = end - time.perf_counter()
        if rest > 0:
            time.sleep(rest)

    def _fail(self, exc: BaseException) -> None:
        # Caller holds _cond. The first failure is the one reported.
        if self._error is None:
            self._error = exc

    def _raise_failure(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        # A GPU's copy engine takes no host core; this stand-in's memcpy does. At the
        # load threads' priority it at least does not take one from the event loop.
        at_load_priority()
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                op = self._queue[0]
            error = self._execute(op)
            with self._cond:
                self._queue.popleft()
                self._completed = op.seq
                self.copies_done += 1
                if error is not None:
                    self._fail(error)
                self._cond.notify_all()

    def _execute(self, op: _Copy) -> BaseException | None:
        """Run one copy; return what went wrong instead of raising (this is a thread)."""
        try:
            began = time.perf_counter()
            data = op.dest._data
            if data is None:
                return LoadError(
                    None, None, f"device {self.device}: copy #{op.seq} into a freed buffer"
                )
            src = op.slot.view()[: op.nbytes]
            try:
                if self._owner.keep_bytes:
                    # numpy lets go of the GIL while it copies: a copy that kept it would
                    # stall the event loop and the transfer threads for the whole copy,
                    # which a GPU's copy engine never does.
                    target = data[op.dest_offset : op.dest_offset + op.nbytes]
                    target[:] = numpy.frombuffer(src, dtype=numpy.uint8)
                    landed = target.data
                else:
                    landed = src  # looked at when the modelled copy ends: still the same?
                op.dest.mark_written(op.dest_offset, op.nbytes)
                self._sleep_rest(began, op.nbytes)
                changed = _fingerprint(landed) != op.crc
            finally:
                src.release()
            if changed:
                return RingViolation(
                    self.device,
                    op.slot.index,
                    f"copy #{op.seq} ({op.nbytes} bytes to offset {op.dest_offset}) read "
                    "bytes that changed after it was issued: the slot was overwritten "
                    "while the copy was in flight",
                )
        except Exception as exc:  # reported through synchronize(), never lost
            return exc
        return None
