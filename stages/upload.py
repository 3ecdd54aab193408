"""The upload stage: file bytes into device memory through a ring of staging slots.

Per device, one copy stream and a ring of ``pipeline.staging_buffers`` page-aligned slots
(pinned where the device has a pinned host buffer type) of ``staging_bytes(mode)`` bytes
plus ``2 × alignment`` each. For one job (design §1.6, llama.cpp's ``load_all_data``):

1. take the least recently used free slot of the destination's device;
2. wait until the event recorded behind the slot's previous copy has completed — the
   *only* wait on the device: it sits before a slot is reused, never after a copy is
   issued, so up to ``staging_buffers - 1`` copies stay in flight;
3. run the caller's ``fill`` on the slot (it reads the file straight into it);
4. queue one async host-to-device copy of the whole chunk into the device image at the
   job's buffer offset, and record the slot's event behind it.

Steps 2-4 run in one worker thread call (bounded: one chunk's copy, one chunk's read),
so the event loop never blocks. A device without async copies, events or a pinned host
buffer type gets a synchronous copy instead (llama.cpp's upload-backend negotiation).

Ownership: device buffers returned by ``allocate()`` belong to the ``Uploader`` until it
exits. If its ``async with`` block exits cleanly and every copy completed, they pass to
the caller, who must ``close()`` them (the model does). If the block raises, is
cancelled, or a copy failed, the ``Uploader`` closes every one of them before re-raising.
Staging slots, streams and copy threads never outlive the ``Uploader``.
"""

from __future__ import annotations

import contextlib
import mmap
import time
import traceback
import warnings
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from types import TracebackType

import anyio
import anyio.to_thread

from aiogguf.config import Config
from aiogguf.io.devices.base import (
    CopyEvent,
    CopyStream,
    Device,
    DeviceBuffer,
    StagingSlot,
    UploadTarget,
)
from aiogguf.jobs import ReadJob

__all__ = ["DeviceUploadStats", "Fill", "Uploader", "UploaderState"]

Fill = Callable[[memoryview], None]
"""Writes a job's bytes into the view it is given (runs in a worker thread)."""


@dataclass(frozen=True, slots=True)
class DeviceUploadStats:
    """What one device's ring did during a load."""

    device: str
    asynchronous: bool
    slots: int
    slot_bytes: int
    bytes_copied: int
    copies: int
    slot_waits: int  # times a slot's previous copy had not completed when it was reused
    wait_s: float  # time spent in those waits
    fill_s: float  # time spent in the caller's fills


class UploaderState(Enum):
    NEW = "new"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


class _Ring:
    """One device's stream, slots and events. Opened lazily, in a worker thread, and
    resumably: what exists is recorded at once, so a cancelled opening leaks nothing."""

    def __init__(self, target: UploadTarget, n_slots: int, slot_bytes: int, alignment: int):
        self.target = target
        self.device = target.name
        caps = target.caps
        self.asynchronous = (
            caps.async_copies and caps.events and target.host_buffer_type is not None
        )
        self.n_slots = n_slots
        self.slot_bytes = slot_bytes
        self.alignment = alignment
        self.stream: CopyStream | None = None
        self.slots: list[StagingSlot] = []
        self.events: list[CopyEvent] = []
        self.lock = anyio.Lock()
        self.free: deque[int] = deque(range(n_slots))
        self.free_count = anyio.Semaphore(n_slots)
        self.bytes_copied = 0
        self.copies = 0
        self.slot_waits = 0
        self.wait_s = 0.0
        self.fill_s = 0.0

    @property
    def opened(self) -> bool:
        return len(self.events) == self.n_slots

    def open(self) -> None:
        """Blocking: create whatever is missing (stream, then slots, then events)."""
        if self.stream is None:
            self.stream = self.target.open_copy_stream(asynchronous=self.asynchronous)
        while len(self.slots) < self.n_slots:
            self.slots.append(
                self.stream.open_slot(len(self.slots), self.slot_bytes, self.alignment)
            )
        while len(self.events) < self.n_slots:
            self.events.append(self.stream.new_event())

    def close(self) -> None:
        """Blocking: free the slots, then close the stream (joins its copy thread).
        Call only after the stream was synchronized."""
        first: Exception | None = None
        while self.slots:
            try:
                self.slots.pop().close()
            except Exception as exc:  # keep freeing; report the first failure
                first = first or exc
        self.events.clear()
        if self.stream is not None:
            try:
                self.stream.close()
            except Exception as exc:
                first = first or exc
        if first is not None:
            raise first

    def stats(self) -> DeviceUploadStats:
        return DeviceUploadStats(
            device=self.device,
            asynchronous=self.asynchronous,
            slots=self.n_slots,
            slot_bytes=self.slot_bytes,
            bytes_copied=self.bytes_copied,
            copies=self.copies,
            slot_waits=self.slot_waits,
            wait_s=self.wait_s,
            fill_s=self.fill_s,
        )


@dataclass(frozen=True, slots=True)
class _Staged:
    waited: bool
    wait_s: float
    fill_s: float


class Uploader:
    """Uploads of one load, to every device at once: one ring and stream per device.

    ``devices``: the load's devices by name (only those that take uploads are used).
    ``mode``: the load mode, which sizes the slots (``config.pipeline.staging_bytes``).
    ``limiter``: bounds the worker threads of fills, waits and allocations (default:
    one per staging slot of every upload device).
    ``_unsafe_skip_slot_wait``: test only — reuse slots without waiting for their copy,
    to prove that the simulated device catches a broken ring.

    Use as ``async with Uploader(...) as up:``; see the module docstring for who owns
    the device buffers.
    """

    def __init__(
        self,
        devices: Mapping[str, Device],
        config: Config,
        mode: str,
        *,
        limiter: anyio.CapacityLimiter | None = None,
        _unsafe_skip_slot_wait: bool = False,
    ) -> None:
        self._devices = dict(devices)
        pipeline = config.pipeline
        self.staging_bytes: int = pipeline.staging_bytes(mode)
        self._alignment = max(pipeline.alignment, mmap.PAGESIZE)
        self._n_slots = pipeline.staging_buffers
        self._slot_bytes = self.staging_bytes + 2 * self._alignment
        n_targets = sum(isinstance(d, UploadTarget) for d in self._devices.values())
        self._limiter = limiter or anyio.CapacityLimiter(max(2, self._n_slots * max(n_targets, 1)))
        self._skip_wait = _unsafe_skip_slot_wait
        self._rings: dict[str, _Ring] = {}
        self._buffers: list[DeviceBuffer] = []
        self.state = UploaderState.NEW

    # -- lifecycle --------------------------------------------------------------------

    async def __aenter__(self) -> Uploader:
        if self.state is not UploaderState.NEW:
            raise RuntimeError(f"Uploader cannot be entered in state {self.state.value}")
        self.state = UploaderState.OPEN
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.state = UploaderState.CLOSING
        failure: BaseException | None = None
        # Cleanup must finish even when we are being cancelled: in-flight copies read
        # from the slots we are about to free and write into buffers we may free.
        with anyio.CancelScope(shield=True):
            for ring in self._rings.values():
                if ring.stream is not None:
                    try:
                        await anyio.to_thread.run_sync(ring.stream.synchronize)
                    except Exception as err:
                        failure = failure or err
            for ring in self._rings.values():
                try:
                    await anyio.to_thread.run_sync(ring.close)
                except Exception as err:
                    failure = failure or err
            buffers, self._buffers = self._buffers, []
            if exc is not None or failure is not None:
                try:
                    await anyio.to_thread.run_sync(_close_all, buffers)
                except Exception as err:
                    failure = failure or err
        self.state = UploaderState.CLOSED
        if failure is None or failure is exc:
            return
        if exc is not None:
            exc.add_note(f"while closing the uploader: {failure!r}")
            return
        raise failure

    def __del__(self) -> None:
        if getattr(self, "state", None) is UploaderState.OPEN:
            warnings.warn(
                "Uploader garbage-collected while open: slots and copy threads leaked",
                ResourceWarning,
                stacklevel=1,
            )

    def _check_open(self) -> None:
        if self.state is not UploaderState.OPEN:
            raise RuntimeError(f"Uploader is {self.state.value}; use it inside 'async with'")

    # -- the interface ------------------------------------------------------------------

    async def allocate(self, device: str, nbytes: int) -> DeviceBuffer:
        """Device memory for one planned buffer (allocated in a worker thread).

        Raises ``LoadError`` when the device cannot allocate it, ``ValueError`` when
        ``device`` is not a device that takes uploads."""
        self._check_open()
        target = self._target(device)

        def allocate_and_keep() -> DeviceBuffer:
            buffer = target.allocate(nbytes)
            # Recorded in the thread: a cancelled await cannot lose the buffer.
            self._buffers.append(buffer)
            return buffer

        return await anyio.to_thread.run_sync(allocate_and_keep, limiter=self._limiter)

    async def write(self, job: ReadJob, dest: DeviceBuffer, fill: Fill) -> None:
        """Fill a staging slot with ``job``'s bytes and queue their copy into ``dest`` at
        ``job.buffer_offset``. Returns once the copy is issued (synchronous devices: done).

        Raises ``ValueError`` for a job larger than ``staging_bytes`` or outside ``dest``,
        whatever ``fill`` raises, ``LoadError`` when the device fails, and the simulated
        device's ``RingViolation`` when the ring is broken."""
        self._check_open()
        if job.nbytes > self.staging_bytes:
            raise ValueError(
                f"job {job.seq}: {job.nbytes} bytes > staging slot size {self.staging_bytes}"
            )
        if job.buffer_offset < 0 or job.buffer_offset + job.nbytes > dest.nbytes:
            raise ValueError(
                f"job {job.seq}: bytes [{job.buffer_offset}, {job.buffer_offset + job.nbytes})"
                f" fall outside the {dest.nbytes}-byte buffer on {dest.device}"
            )
        if job.nbytes == 0:
            return
        ring = await self._ring(dest.device)
        await ring.free_count.acquire()
        index = ring.free.popleft()
        try:
            staged = await anyio.to_thread.run_sync(
                self._stage, ring, index, job, dest, fill, limiter=self._limiter
            )
        finally:
            ring.free.append(index)
            ring.free_count.release()
        ring.bytes_copied += job.nbytes
        ring.copies += 1
        ring.slot_waits += staged.waited
        ring.wait_s += staged.wait_s
        ring.fill_s += staged.fill_s

    async def drain(self, device: str | None = None) -> None:
        """Wait until every copy issued so far (to ``device``, or to every device) has
        completed. Raises the first copy failure, as ``write`` does."""
        self._check_open()
        rings = list(self._rings.values())
        if device is not None:
            rings = [r for r in rings if r.device == device]
        # One device after another: each waits for copies already running concurrently.
        for ring in rings:
            if ring.stream is not None:
                await anyio.to_thread.run_sync(ring.stream.synchronize, limiter=self._limiter)

    @property
    def stats(self) -> dict[str, DeviceUploadStats]:
        """Per device (that received a write): bytes, copies, waits and their time."""
        return {name: ring.stats() for name, ring in self._rings.items()}

    # -- internals ----------------------------------------------------------------------

    def _target(self, name: str) -> UploadTarget:
        device = self._devices.get(name)
        if device is None:
            raise ValueError(f"no device named {name!r} in this load")
        if not isinstance(device, UploadTarget):
            raise ValueError(f"device {name!r} ({device.backend}) does not take uploads")
        return device

    async def _ring(self, name: str) -> _Ring:
        ring = self._rings.get(name)
        if ring is None:
            ring = _Ring(self._target(name), self._n_slots, self._slot_bytes, self._alignment)
            self._rings[name] = ring
        if not ring.opened:
            async with ring.lock:
                if not ring.opened:
                    await anyio.to_thread.run_sync(ring.open, limiter=self._limiter)
        return ring

    def _stage(
        self, ring: _Ring, index: int, job: ReadJob, dest: DeviceBuffer, fill: Fill
    ) -> _Staged:
        """Blocking, one worker thread call: wait for the slot, fill it, issue its copy."""
        assert ring.stream is not None
        slot, event = ring.slots[index], ring.events[index]
        waited, wait_s = False, 0.0
        if ring.asynchronous and not self._skip_wait and not event.query():
            waited = True
            start = time.perf_counter()
            event.synchronize()
            wait_s = time.perf_counter() - start
        slot.begin_write()
        start = time.perf_counter()
        part = slot.view()[: job.nbytes]
        try:
            fill(part)
        except BaseException as exc:
            # The fill's frames hold views of the slot (``slot[:n]`` in a reader); the
            # error keeps them alive, and a slot with live views cannot be freed. The
            # stack trace stays; only the frames' locals go.
            traceback.clear_frames(exc.__traceback__)
            raise
        finally:
            # A view derived from ``part`` (numpy.frombuffer) lives on its own; the slot
            # refuses to close while one does, which fails the load at exit.
            with contextlib.suppress(BufferError):
                part.release()
        fill_s = time.perf_counter() - start
        if ring.asynchronous:
            ring.stream.copy_async(dest, job.buffer_offset, slot, job.nbytes)
            event.record()
        else:
            src = slot.view()[: job.nbytes]
            try:
                ring.stream.copy_sync(dest, job.buffer_offset, src)
            finally:
                src.release()
        return _Staged(waited, wait_s, fill_s)


def _close_all(buffers: list[DeviceBuffer]) -> None:
    first: Exception | None = None
    for buffer in buffers:
        try:
            buffer.close()
        except Exception as exc:  # free the rest; report the first failure
            first = first or exc
    if first is not None:
        raise first
