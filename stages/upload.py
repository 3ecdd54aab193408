"""The upload stage: file bytes into device memory through pinned staging slots.

Device-bound jobs never cross the event loop one by one. ``transfer`` hands the whole
list to the load's transfer threads; each thread runs the llama.cpp ``load_all_data``
loop on its own (design §1.6):

1. take the next job from the shared queue (load order);
2. take the next staging slot of the job's device from the thread's lease (leased
   when the thread first meets the device: ``staging_buffers`` slots, pinned where the
   pool has none idle, so one is filled while the other is copied out of), and wait
   until the event recorded behind the slot's last copy has completed — the *only*
   wait on the device: it sits before a slot is reused, never after a copy is issued;
3. run the caller's ``fill`` on the slot (it reads the file straight into it and
   checks each piece as it lands, on this thread);
4. queue one async host-to-device copy into the device image at the job's buffer offset
   on the thread's own stream, record the slot's event behind it, and tell the loop,
   without waiting for it, that the job landed;
5. a job's copy is known to have completed when its slot's event is found done (step
   2, as the slot comes round again) or when the stream is synchronized at the end:
   the loop is told then (``copied``), with the next report, so that a device tensor
   can be handed on before the last copy of the load has completed.

Slots come from the device's process-wide ``StagingPool``: pinned once, reused by every
later load, shared by loads that run side by side. A thread gives its slots back only
after its stream has synchronized, so a leased slot is always free to fill. A device
without async copies, events or a pinned host buffer type gets synchronous copies
instead (llama.cpp's upload-backend negotiation).

Device buffers come from the device's process-wide ``DeviceArena``: a block of device
memory the last load gave back when one fits (no ``cudaMalloc``, a device-wide
synchronisation), else a new allocation. Each stream records an event behind its last
copy, and the buffers it wrote into carry it back to the arena: the memory is handed to
another load only once those copies have completed.

Ownership: device buffers returned by ``allocate()`` belong to the ``Uploader`` until it
exits. If its ``async with`` block exits cleanly, they pass to the caller, who must
``close()`` them (the model does; the memory goes back to the arena). If the block
raises or is cancelled, the ``Uploader`` closes every one of them before re-raising.
Streams never outlive the ``transfer`` call that opened them; slots go back to their
pool.
"""

from __future__ import annotations

import contextlib
import threading
import time
import traceback
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from functools import partial
from types import TracebackType

import anyio

from aiogguf._config import Config
from aiogguf._jobs import ReadJob, SlotFill
from aiogguf.io._devices.arena import ArenaGrant, device_arena
from aiogguf.io._devices.base import (
    CopyEvent,
    CopyStream,
    Device,
    DeviceBuffer,
    ShareableTarget,
    UploadTarget,
)
from aiogguf.io._devices.pool import PooledSlot, SlotLease, StagingPool, staging_pool
from aiogguf.io.workers import LoadThreads

__all__ = ["Copied", "DeviceUploadStats", "Landed", "Uploader", "UploaderState"]

Landed = Callable[[ReadJob], None]
"""Told on the loop's thread that a job's copy was queued."""

Copied = Callable[[Sequence[ReadJob]], None]
"""Told on the loop's thread that these jobs' copies have completed."""


@dataclass(frozen=True, slots=True)
class DeviceUploadStats:
    """What one device's uploads did during one load."""

    device: str
    asynchronous: bool
    slots: int  # staging slots the load leased
    slot_bytes: int
    pinned_bytes_allocated: int  # what this load pinned: 0 when the pool had the slots
    bytes_copied: int
    copies: int
    slot_waits: int  # times a slot's last copy had not completed when it was reused
    wait_s: float  # time spent in those waits
    fill_s: float  # time spent in the caller's fills
    device_bytes_allocated: int = 0  # what this load allocated: 0 when the arena had it


class UploaderState(Enum):
    """Where an ``Uploader`` is in its life: made, open, closing, closed."""

    NEW = "new"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


@dataclass(slots=True)
class _DeviceCounts:
    """One device's counters, summed over the transfer threads (under ``Uploader._lock``)."""

    asynchronous: bool
    slots: int = 0
    pinned_bytes: int = 0
    device_bytes: int = 0
    bytes_copied: int = 0
    copies: int = 0
    slot_waits: int = 0
    wait_s: float = 0.0
    fill_s: float = 0.0


class _TransferLane:
    """One transfer thread's way to one device: its stream, its leased slots (used
    round robin) and its counts. Only its own thread touches it."""

    def __init__(
        self,
        device: str,
        pool: StagingPool,
        stream: CopyStream,
        lease: SlotLease,
        *,
        asynchronous: bool,
        skip_wait: bool = False,
    ) -> None:
        self.device = device
        self.pool = pool
        self.stream = stream
        self.done: CopyEvent | None = None  # recorded behind the last copy, at close
        self.lease = lease
        self.asynchronous = asynchronous
        self._skip_wait = skip_wait  # test only: see ``Uploader``
        self._next = 0  # the slot to use next
        # The job whose copy each slot last carried, until it is known to have completed;
        # then it moves to ``copied`` (which ``Uploader._work`` hands to the loop).
        self._carried: list[ReadJob | None] = [None] * len(lease.slots)
        self.copied: list[ReadJob] = []
        self.copies = 0
        self.bytes_copied = 0
        self.slot_waits = 0
        self.wait_s = 0.0
        self.fill_s = 0.0

    @classmethod
    def open(
        cls,
        target: UploadTarget,
        device: str,
        *,
        slots: int,
        slot_bytes: int,
        alignment: int,
        pool_cap: int,
        stop: threading.Event,
        skip_wait: bool,
    ) -> _TransferLane | None:
        """Lease the slots and open the stream; None when stopped while waiting for a
        slot."""
        asynchronous = _asynchronous(target)
        pool = staging_pool(target)
        lease = pool.lease(slots, slot_bytes, alignment, cap_bytes=pool_cap, stopped=stop.is_set)
        if not lease.slots:
            return None
        try:
            stream = target.open_copy_stream(asynchronous=asynchronous)
        except BaseException:
            pool.give_back(lease)
            raise
        return cls(device, pool, stream, lease, asynchronous=asynchronous, skip_wait=skip_wait)

    def _next_slot(self) -> tuple[int, PooledSlot]:
        """The slot for the next job, round robin, once its last copy has completed."""
        slots = self.lease.slots
        at = self._next
        pooled = slots[at]
        self._next = (at + 1) % len(slots)
        if self._skip_wait:
            return at, pooled  # its last copy may be in flight: told at ``close``
        if not self.asynchronous or pooled.event.query():
            self._completed(at)
            return at, pooled
        self.slot_waits += 1
        start = time.perf_counter()
        pooled.event.synchronize()
        self.wait_s += time.perf_counter() - start
        self._completed(at)
        return at, pooled

    def _completed(self, at: int) -> None:
        """Slot ``at``'s last copy has completed."""
        job = self._carried[at]
        if job is not None:
            self._carried[at] = None
            self.copied.append(job)

    def stage(self, job: ReadJob, dest: DeviceBuffer, fill: SlotFill) -> None:
        """Wait for a slot, fill it, issue its copy."""
        at, pooled = self._next_slot()
        slot = pooled.slot
        slot.begin_write()
        start = time.perf_counter()
        part = slot.view()[: job.nbytes]
        try:
            fill(job, part)
        except BaseException as exc:
            # The fill's frames hold views of the slot (``slot[:n]`` in a reader); the
            # error keeps them alive, and a slot with live views cannot be freed. The
            # stack trace stays; only the frames' locals go.
            traceback.clear_frames(exc.__traceback__)
            raise
        finally:
            # A view derived from ``part`` (numpy.frombuffer) lives on its own; the slot
            # then refuses to be freed, which the pool reports when it frees it.
            with contextlib.suppress(BufferError):
                part.release()
        self.fill_s += time.perf_counter() - start
        if self.asynchronous:
            self.stream.copy_async(dest, job.buffer_offset, slot, job.nbytes)
            pooled.event.record(self.stream)
            self._carried[at] = job
        else:
            src = slot.view()[: job.nbytes]
            try:
                self.stream.copy_sync(dest, job.buffer_offset, src)
            finally:
                src.release()
            self.copied.append(job)
        self.copies += 1
        self.bytes_copied += job.nbytes

    def close(self) -> BaseException | None:
        """Wait for every copy, close the stream, give the slots back; the first
        failure, returned so that the caller closes its other lanes too."""
        first: BaseException | None = None
        try:
            if self.asynchronous and self.copies:
                # What the buffers this stream wrote into carry back to the arena.
                done = self.pool.target.new_event()
                done.record(self.stream)
                self.done = done
            self.stream.synchronize()
            self.copied.extend(job for job in self._carried if job is not None)
            self._carried = [None] * len(self._carried)
        except BaseException as exc:
            first = exc
        try:
            self.stream.close()
        except BaseException as exc:
            first = first or exc
        self.pool.give_back(self.lease)
        return first


class Uploader:
    """Uploads of one load, to every device at once.

    ``devices``: the load's devices by name (only those that take uploads are used).
    ``threads``: the load's transfer threads (entered by the caller); ``transfer`` keeps
    each of them busy with one long call.
    ``_unsafe_skip_slot_wait``: test only — reuse slots without waiting for their copy,
    to prove that the simulated device catches a broken ring.

    Use as ``async with Uploader(...) as up:``; see the module docstring for who owns
    the device buffers.
    """

    def __init__(
        self,
        devices: Mapping[str, Device],
        config: Config,
        *,
        threads: LoadThreads,
        _unsafe_skip_slot_wait: bool = False,
    ) -> None:
        self._devices = dict(devices)
        pipeline = config.pipeline
        self.slot_bytes: int = pipeline.staging_bytes()
        self._alignment = pipeline.alignment
        self._per_thread = pipeline.staging_buffers
        self._pool_cap = pipeline.staging_pool_size
        self._threads = threads
        self._skip_wait = _unsafe_skip_slot_wait
        self._grants: list[ArenaGrant] = []
        # ``[load] shareable``: buffers another process can map; a device whose arena's
        # memory is private allocates them apart (``ShareableTarget``), and they are the
        # load's own (freed with a failed load's grants, never given to the arena).
        self._shareable = config.load.shareable
        self._own: list[DeviceBuffer] = []
        self._done: dict[str, list[CopyEvent]] = {}  # per device: each stream's last copy
        self._counts: dict[str, _DeviceCounts] = {}
        self._lock = threading.Lock()
        # Allocations and frees of device memory: not on the transfer threads, which may
        # be busy with another device's jobs.
        self._device_thread = LoadThreads(1, name="aiogguf-device")
        self.state: UploaderState = UploaderState.NEW

    # -- lifecycle --------------------------------------------------------------------

    async def __aenter__(self) -> Uploader:
        if self.state is not UploaderState.NEW:
            raise RuntimeError(f"Uploader cannot be entered in state {self.state.value}")
        await self._device_thread.__aenter__()
        self.state = UploaderState.OPEN
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.state = UploaderState.CLOSING
        grants, self._grants = self._grants, []
        own, self._own = self._own, []
        with self._lock:
            for grant in grants:
                grant.used_by(self._done.get(grant.buffer.device, ()))
        try:
            if exc is not None:
                # Given back even while being cancelled: nobody else will.
                with anyio.CancelScope(shield=True):
                    await self._device_thread.run_sync(_close_all, [g.buffer for g in grants] + own)
        except Exception as err:
            if exc is not None:
                exc.add_note(f"while freeing device buffers: {err!r}")
        finally:
            self.state = UploaderState.CLOSED
            await self._device_thread.__aexit__(None, None, None)

    def __del__(self) -> None:
        if getattr(self, "state", None) is UploaderState.OPEN and self._grants:
            warnings.warn(
                "Uploader garbage-collected while open: device buffers leaked",
                ResourceWarning,
                stacklevel=1,
            )

    def _check_open(self) -> None:
        if self.state is not UploaderState.OPEN:
            raise RuntimeError(f"Uploader is {self.state.value}; use it inside 'async with'")

    # -- the interface ------------------------------------------------------------------

    async def allocate(self, device: str, nbytes: int) -> DeviceBuffer:
        """Device memory for one planned buffer, from the device's arena (in a worker
        thread).

        Raises ``LoadError`` when the device cannot allocate it, ``ValueError`` when
        ``device`` is not a device that takes uploads."""
        self._check_open()
        target = self._target(device)

        def allocate_and_keep() -> DeviceBuffer:
            # The device gets its pool now even if no copy reaches it: the pool is how
            # ``release_device_memory`` finds a device's cached memory.
            staging_pool(target)
            if self._shareable and isinstance(target, ShareableTarget):
                buffer = target.allocate_shareable(nbytes)
                self._own.append(buffer)
                with self._lock:
                    _counts_of(self._counts, device, target).device_bytes += nbytes
                return buffer
            grant = device_arena(target).take(nbytes)
            # Recorded in the thread: a cancelled await cannot lose the buffer.
            self._grants.append(grant)
            with self._lock:
                _counts_of(self._counts, device, target).device_bytes += grant.allocated_bytes
            return grant.buffer

        return await self._device_thread.run_sync(allocate_and_keep)

    async def transfer(
        self,
        jobs: Sequence[tuple[ReadJob, DeviceBuffer]],
        fill: SlotFill,
        *,
        landed: Landed | None = None,
        copied: Copied | None = None,
    ) -> None:
        """Fill and copy every ``(job, destination)``, in order of the sequence as far as
        threads take jobs; returns once every copy has completed. ``landed``: told each job
        once its copy is queued; ``copied``: each job once its copy has completed.

        Raises ``ValueError`` for a job larger than ``slot_bytes`` or outside its
        destination, whatever ``fill`` raises, ``LoadError`` when a device
        fails, and the simulated device's ``RingViolation`` when the ring is broken."""
        self._check_open()
        for device in {dest.device for _, dest in jobs}:
            self._target(device)  # once per device: a protocol check is slow
        for job, dest in jobs:
            _check_job(job, dest, self.slot_bytes)
        queue = deque(job_dest for job_dest in jobs if job_dest[0].nbytes)
        if not queue:
            return
        stop = threading.Event()
        failures: list[Exception] = []
        work = partial(self._work, queue, fill, landed, copied, stop)

        async def run_thread() -> None:
            try:
                await self._threads.run_sync(work, on_cancel=stop.set)
            except Exception as exc:  # the others stop at their next job (``_work``)
                failures.append(exc)

        async with anyio.create_task_group() as tg:
            for _ in range(min(self._threads.count, len(queue))):
                tg.start_soon(run_thread)
        if failures:
            # One clear error, as the load's caller gets it; what the other threads
            # raised on their way out rides along.
            for other in failures[1:]:
                failures[0].add_note(f"also: {type(other).__name__}: {other}")
            raise failures[0]

    @property
    def stats(self) -> tuple[DeviceUploadStats, ...]:
        """Per device that received a copy: slots, pinning, bytes, copies, waits."""
        with self._lock:
            return tuple(
                DeviceUploadStats(
                    device=name,
                    asynchronous=t.asynchronous,
                    slots=t.slots,
                    slot_bytes=self.slot_bytes,
                    pinned_bytes_allocated=t.pinned_bytes,
                    device_bytes_allocated=t.device_bytes,
                    bytes_copied=t.bytes_copied,
                    copies=t.copies,
                    slot_waits=t.slot_waits,
                    wait_s=t.wait_s,
                    fill_s=t.fill_s,
                )
                for name, t in self._counts.items()
            )

    # -- the transfer threads -----------------------------------------------------------

    def _work(
        self,
        queue: deque[tuple[ReadJob, DeviceBuffer]],
        fill: SlotFill,
        landed: Landed | None,
        copied: Copied | None,
        stop: threading.Event,
    ) -> None:
        """One transfer thread: jobs from ``queue`` until it is empty or ``stop`` is set."""
        lanes: dict[str, _TransferLane] = {}
        try:
            while not stop.is_set():
                try:
                    job, dest = queue.popleft()  # atomic: threads share the queue
                except IndexError:
                    break
                lane = lanes.get(dest.device)
                if lane is None:
                    lane = _TransferLane.open(
                        self._target(dest.device),
                        dest.device,
                        slots=self._per_thread,
                        slot_bytes=self.slot_bytes,
                        alignment=self._alignment,
                        pool_cap=self._pool_cap,
                        stop=stop,
                        skip_wait=self._skip_wait,
                    )
                    if lane is None:
                        break  # stopped while waiting for a slot
                    lanes[dest.device] = lane
                lane.stage(job, dest, fill)
                if landed is not None:
                    self._threads.call_soon(landed, job, lazy=True)
                if copied is not None and lane.copied:
                    done, lane.copied = lane.copied, []
                    self._threads.call_soon(copied, done, lazy=True)
        except BaseException:
            stop.set()  # the other threads stop taking jobs: the load has failed
            raise
        finally:
            self._close_lanes(lanes.values())
        if copied is not None:  # the lanes' streams have synchronized
            done = [job for lane in lanes.values() for job in lane.copied]
            if done:
                self._threads.call_soon(copied, done, lazy=True)

    def _close_lanes(self, lanes: Iterable[_TransferLane]) -> None:
        """Wait for every copy of the lanes, close their streams, give their slots back,
        add their counts to the load's. Raises the first copy failure."""
        first: BaseException | None = None
        for lane in lanes:
            slots = len(lane.lease.slots)
            failure = lane.close()
            first = first or failure
            with self._lock:
                tally = _counts_of(self._counts, lane.device, lane.pool.target)
                if lane.done is not None:
                    self._done.setdefault(lane.device, []).append(lane.done)
                tally.slots += slots
                tally.pinned_bytes += lane.lease.pinned_bytes
                tally.bytes_copied += lane.bytes_copied
                tally.copies += lane.copies
                tally.slot_waits += lane.slot_waits
                tally.wait_s += lane.wait_s
                tally.fill_s += lane.fill_s
        if first is not None:
            raise first

    # -- internals ----------------------------------------------------------------------

    def _target(self, name: str) -> UploadTarget:
        device = self._devices.get(name)
        if device is None:
            raise ValueError(f"no device named {name!r} in this load")
        if not isinstance(device, UploadTarget):
            raise ValueError(f"device {name!r} ({device.backend}) does not take uploads")
        return device


def _counts_of(
    tallies: dict[str, _DeviceCounts], device: str, target: UploadTarget
) -> _DeviceCounts:
    """The device's counters in ``tallies`` (the caller holds the uploader's lock)."""
    tally = tallies.get(device)
    if tally is None:
        tally = tallies[device] = _DeviceCounts(_asynchronous(target))
    return tally


def _asynchronous(target: UploadTarget) -> bool:
    """Whether copies to ``target`` are queued (llama.cpp's upload-backend negotiation)."""
    caps = target.caps
    return caps.async_copies and caps.events and target.host_buffer_type is not None


def _check_job(job: ReadJob, dest: DeviceBuffer, slot_bytes: int) -> None:
    if job.nbytes > slot_bytes:
        raise ValueError(f"job {job.seq}: {job.nbytes} bytes > staging slot size {slot_bytes}")
    if job.buffer_offset < 0 or job.buffer_offset + job.nbytes > dest.nbytes:
        raise ValueError(
            f"job {job.seq}: bytes [{job.buffer_offset}, {job.buffer_offset + job.nbytes})"
            f" fall outside the {dest.nbytes}-byte buffer on {dest.device}"
        )


def _close_all(buffers: list[DeviceBuffer]) -> None:
    first: Exception | None = None
    for buffer in buffers:
        try:
            buffer.close()
        except Exception as exc:  # free the rest; report the first failure
            first = first or exc
    if first is not None:
        raise first
