"""The validate stage: checks every loaded tensor by ggml's rules (``aiogguf._checks``),
each one of two ways, and collects the failures.

Tensors that land in host memory by ``preadv``/``O_DIRECT``, and every device tensor,
are checked piece by piece as they land (``Validation.check_piece``, the read side's
sink for landed pieces); the rest (mapped tensors, swapped bytes) are checked whole on
the check threads (``ValidationCollector``) once their bytes have all landed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from types import ModuleType, TracebackType
from typing import Any

import anyio
import numpy
from anyio.abc import TaskGroup

from aiogguf._checks import HOST_SLICE_BYTES, Bytes, PieceCheck, TensorChecker, precheck
from aiogguf._images import DeviceImage, HostImage, Image, MappedImage
from aiogguf._jobs import (
    BufferLayout,
    Passed,
    ReadJob,
    StageMeter,
    StageTimes,
    TensorCountdown,
    TensorSlot,
)
from aiogguf._records import ModeTraits, WeightIndex
from aiogguf.errors import TensorFailure
from aiogguf.io.ggml_types import GGMLType
from aiogguf.io.source import ByteSource
from aiogguf.io.workers import LoadThreads, raise_if_stopped

__all__ = ["FileBytes", "Validation", "ValidationCollector"]

# ---------------------------------------------------------------------------------------
# The async collector of whole-tensor checks.

# One worker-thread call checks at most this many bytes, so a cancelled load waits for at
# most one such slice per worker (the threads must not outlive the buffers they read).
CALL_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class FileBytes:
    """A tensor's bytes to check, read from its file rather than from memory mapping it.

    Why: in modes ``mmap``/``mlock`` the tensors *are* mappings of the file (private, but a
    page nobody wrote is still the file's). If the file is truncated while a check scans
    such a mapping, the CPU's load from a page that the truncation cut off raises SIGBUS,
    and the process dies (CPython cannot resume after it). No test beforehand closes that
    gap: ``MADV_POPULATE_READ`` or an ``fstat`` says only that the pages were there a moment
    ago. ``preadv`` reads the same page cache, so it sees the same bytes; a truncation turns
    into a short read there, that is a ``LoadError`` naming the file and offset. The pieces
    land in a per-thread scratch buffer of ``HOST_SLICE_BYTES`` that stays in the CPU cache,
    which measured as the cheapest piece size (smaller ones pay per call, larger ones spill
    the cache). Read leases (``F_SETLEASE``) were rejected: only the file's owner may take
    one, a writer that already has the file open prevents it, and breaking it sends SIGIO,
    whose default action also ends the process.
    """

    file: ByteSource
    offset: int
    nbytes: int


# Per-thread scratch for ``FileBytes`` pieces (a thread checks one piece at a time).
_piece_local = threading.local()


def _piece_scratch() -> numpy.ndarray[Any, Any]:
    scratch: numpy.ndarray[Any, Any] | None = getattr(_piece_local, "buffer", None)
    if scratch is None:
        scratch = _piece_local.buffer = numpy.empty(HOST_SLICE_BYTES, dtype=numpy.uint8)
    return scratch


def _file_pieces(file: ByteSource, at: int, nbytes: int) -> Iterator[Bytes]:
    """Blocking: ``file``'s bytes ``[at, at + nbytes)``, read piece by piece into this
    thread's scratch (``HOST_SLICE_BYTES`` at most each; a piece is valid until the
    next is asked for). Raises ``LoadError`` if the file ends early or a read fails."""
    scratch = _piece_scratch()
    for lo in range(at, at + nbytes, HOST_SLICE_BYTES):
        raise_if_stopped()  # a call reads up to CALL_BYTES: from a slow disk, seconds
        piece = scratch[: min(HOST_SLICE_BYTES, at + nbytes - lo)]
        file.read_into(piece.data, lo)
        yield piece


def _update_from_file(checker: TensorChecker, source: FileBytes, start: int, nbytes: int) -> None:
    """Feed ``checker`` the tensor's bytes ``[start, start + nbytes)``, read piece by piece
    from the file. Raises ``LoadError`` if the file ends early or a read fails."""
    for piece in _file_pieces(source.file, source.offset + start, nbytes):
        checker.update(piece)


class _CollectorState(Enum):
    NEW = "new"
    OPEN = "open"
    CLOSED = "closed"


class ValidationCollector:
    """Checks whole tensors on the load's check threads as they are submitted; collects
    every failure.

    Usage::

        async with ValidationCollector(workers, threads=check_threads) as collector:
            await collector.submit(name, type, data)   # as each tensor lands
        collector.failures                              # every bad tensor

    ``submit`` returns as soon as the check is started; it waits only while
    ``max_in_flight`` checks are already running, which pushes back on the reader and
    bounds the memory the checks pin. Leaving the block waits for every check.
    """

    def __init__(
        self,
        workers: int = 2,
        *,
        max_in_flight: int | None = None,
        xp: ModuleType = numpy,
        call_bytes: int = CALL_BYTES,
        threads: LoadThreads,
        meter: StageMeter | None = None,
        passed: Passed | None = None,
    ) -> None:
        """Set up a collector; checks start once its ``async with`` block is entered.

        ``workers``: threads checking at once (``pipeline.validate_workers``).
        ``max_in_flight``: checks submitted and not yet done before ``submit`` waits;
            default ``2 * workers``.
        ``xp``: default array module of submitted data.
        ``call_bytes``: bytes one worker-thread call checks (bounds cancellation latency).
        ``threads``: the load's entered check threads (``workers`` only sets the
            default of ``max_in_flight``).
        ``meter``: also counts each worker-thread call there (the load's validate stage).
        ``passed``: told each tensor whose check has passed, as it does (loop's thread).

        Raises ``ValueError`` if ``workers`` or ``max_in_flight`` is below 1.
        """
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        max_in_flight = 2 * workers if max_in_flight is None else max_in_flight
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        self._threads = threads
        self._slots = anyio.Semaphore(max_in_flight)
        self._xp = xp
        self._call_bytes = call_bytes
        self._meter = meter
        self._passed = passed
        self._task_group: TaskGroup | None = None
        self._state = _CollectorState.NEW
        self._submitted = 0
        self._results: dict[int, TensorFailure] = {}
        self.bytes_checked: int = 0
        self.busy_s: float = 0.0  # seconds spent in checks (includes waiting for a worker)

    async def __aenter__(self) -> ValidationCollector:
        if self._state is not _CollectorState.NEW:
            raise RuntimeError("a ValidationCollector can be entered only once")
        task_group = anyio.create_task_group()
        await task_group.__aenter__()
        self._task_group = task_group
        self._state = _CollectorState.OPEN
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._task_group is not None
        try:
            return await self._task_group.__aexit__(exc_type, exc, tb)
        finally:
            self._state = _CollectorState.CLOSED
            self._task_group = None

    async def submit(
        self, name: str, type: GGMLType, data: Bytes | FileBytes, *, xp: ModuleType | None = None
    ) -> None:
        """Start checking tensor ``name``; wait only while too many checks are in flight.

        ``data`` (a 1-D uint8 array, or ``FileBytes`` to read it from its file) must stay
        valid and unchanged until the collector's block is left. A ``LoadError`` from
        reading ``FileBytes`` ends the collector's block with that error.

        Raises ``RuntimeError`` outside the collector's ``async with`` block.
        """
        if self._state is not _CollectorState.OPEN or self._task_group is None:
            raise RuntimeError(f"submit('{name}') outside 'async with ValidationCollector'")
        await self._slots.acquire()
        seq = self._submitted
        self._submitted += 1
        self._task_group.start_soon(self._check, seq, name, type, data, xp or self._xp)

    async def _check(
        self, seq: int, name: str, type: GGMLType, data: Bytes | FileBytes, xp: ModuleType
    ) -> None:
        try:
            nbytes = data.nbytes if isinstance(data, FileBytes) else int(data.shape[0])
            failure = precheck(name, type, nbytes)
            if failure is None:
                checker = TensorChecker(name, type, xp=xp)
                unit = max(type.block_bytes, 1)
                step = max(self._call_bytes // unit, 1) * unit
                for start in range(0, nbytes, step):
                    n = min(step, nbytes - start)
                    began = time.perf_counter()
                    metered = self._meter.clock() if self._meter is not None else 0.0
                    if isinstance(data, FileBytes):
                        await self._threads.run_sync(_update_from_file, checker, data, start, n)
                    elif xp is numpy:
                        await self._threads.run_sync(checker.update, data[start : start + step])
                    else:
                        chunk = data[start : start + step]
                        await self._threads.run_sync(_update_on_its_device, checker, chunk)
                    self.busy_s += time.perf_counter() - began
                    self.bytes_checked += n
                    if self._meter is not None:
                        self._meter.add(metered, self._meter.clock(), nbytes=n)
                failure = checker.finish()
            if failure is not None:
                self._results[seq] = failure
            elif self._passed is not None:
                self._passed((name,))
        finally:
            self._slots.release()

    @property
    def submitted(self) -> int:
        """Tensors submitted so far."""
        return self._submitted

    @property
    def failures(self) -> tuple[TensorFailure, ...]:
        """Every failure found so far, in submission order."""
        return tuple(self._results[seq] for seq in sorted(self._results))


def _update_on_its_device(checker: TensorChecker, chunk: Bytes) -> None:
    """Blocking: ``checker.update(chunk)`` with the chunk's device current. A check thread
    has no device of its own (CuPy makes device 0 current), and CuPy refuses to run a
    kernel on an array of another device."""
    with chunk.device:  # a cupy.cuda.Device
        checker.update(chunk)


# ---------------------------------------------------------------------------------------
# The one door the engine uses.


def _file_fetch(file: ByteSource, offset: int) -> Callable[[int, int], Bytes]:
    """A ``PieceCheck.finish_from`` fetch of a tensor's bytes from ``offset`` of
    ``file`` (``HOST_SLICE_BYTES`` at most: one piece of ``_file_pieces``, valid until
    the thread's next read). The fetch raises ``LoadError`` if the file ends early."""

    def fetch(lo: int, hi: int) -> Bytes:
        (piece,) = _file_pieces(file, offset + lo, hi - lo)
        return piece

    return fetch


def _tensor_data(slot: TensorSlot, image: Image | None) -> tuple[Bytes, ModuleType]:
    """A landed tensor's bytes where they live, and their array module."""
    if isinstance(image, DeviceImage):
        return image.buffer.array(slot.buffer_offset, slot.nbytes), image.buffer.xp
    assert isinstance(image, HostImage | MappedImage)
    return numpy.frombuffer(image.tensor_bytes(slot), dtype=numpy.uint8), numpy


class Validation:
    """One load's tensor checks (design §1.7), whichever way each tensor is checked.

    Tensors read by ``preadv``/``O_DIRECT`` into host memory (modes ``none``,
    ``direct``) and every device tensor (its pieces pass through a staging slot in every
    mode) are checked piece by piece as they land: the read and transfer threads call
    ``check_piece``. The few units that straddled two jobs are checked once the tensor
    is complete: for a host tensor by the thread that checked its last job
    (``job_checked``), for a device tensor by ``tensors_ready`` on a check thread, once
    its copies have completed. Every other tensor (mapped, or with bytes swapped after
    the read) is checked whole by ``tensors_ready``, on the check threads, while the
    load goes on; a mapped one through reads of its file (``FileBytes`` says why),
    unless a manifest's hashing reads that file anyway (``mapped_pieces``): then it
    hands its reads to ``check_piece``. ``failures`` lists every bad tensor in index
    order; ``times`` is the stage's work, both ways together.

    Usage: ``async with Validation(...) as v:`` around the tasks that call it; leaving
    the block waits for every check started.
    """

    def __init__(
        self,
        index: WeightIndex,
        layouts: Sequence[BufferLayout],
        slots: Mapping[str, TensorSlot],
        countdown: TensorCountdown,
        images: Sequence[Image | None],
        files: Sequence[ByteSource],
        *,
        mode: ModeTraits,
        enabled: bool,
        swapped: bool,
        mapped_pieces: bool = False,
        workers: int,
        threads: LoadThreads,
        clock: Callable[[], float],
        passed: Passed | None = None,
    ) -> None:
        """Plan the checks of one load.

        index, layouts, slots: the load's tensors and where they sit.
        ``countdown``: the load's count of each tensor's bytes still to come (where the
            host tensors checked by pieces are counted as their jobs are checked).
        ``images``: the load's images, indexed by buffer (filled in as allocated).
        ``files``: the load's open files (mapped tensors are checked through them).
        ``mode``: the resolved load mode's traits (host tensors that are copies are
            checked by pieces as they land).
        ``enabled``: ``load.check_tensors``; when False nothing is checked.
        ``swapped``: whether bytes are swapped after the read (no piece checks then).
        ``mapped_pieces``: mapped tensors are checked piece by piece too: something
            that reads their file anyway (the manifest's hashing) calls ``check_piece``
            with what it read, and the units it did not cover are read back at the end.
        ``workers``: checks of whole tensors in flight at once, times two.
        ``threads``: the load's check threads.
        ``clock``: seconds since the load began.
        ``passed``: told the tensors given to ``tensors_ready`` once their checks have
            passed (a tensor that fails is never told).
        """
        self.enabled = enabled
        self._index = index
        self._slots = slots
        self._spans = countdown.spans
        self._countdown = countdown
        self._images = images
        self._files = files
        self._meter = StageMeter(clock)
        self._passed = passed
        self._collector = ValidationCollector(
            workers, threads=threads, meter=self._meter, passed=passed
        )
        self._threads = threads
        host_read = mode.copies or mapped_pieces
        self._pieces = {
            name: PieceCheck(name, index[name].type, index[name].nbytes, offset=index[name].offset)
            for layout in layouts
            if enabled and not swapped and not layout.plan.lazy
            if host_read or not layout.plan.host
            for name in layout.plan.tensors
        }
        self._piece_failures: list[TensorFailure] = []
        # Host tensors checked by pieces: their bytes whose job has not been checked yet
        # are counted down by ``countdown``; whether each one finished on a reader thread
        # (``job_checked``) passed is written under ``_landing``; the loop reads
        # ``_finished`` only for tensors whose last job's landing it has been told of,
        # which comes after the write.
        self._landing = threading.Lock()
        countdown.count_checks(self._pieces)
        self._finished: dict[str, bool] = {}
        # Whether some tensor is checked whole (the collector's task group is entered
        # only then: a load checked piece by piece has no use for it).
        self._whole = enabled and any(
            name not in self._pieces
            for layout in layouts
            if not layout.plan.lazy
            for name in layout.plan.tensors
        )

    @property
    def by_pieces(self) -> bool:
        """Whether some tensor is checked piece by piece (readers must call
        ``check_piece``)."""
        return bool(self._pieces)

    async def __aenter__(self) -> Validation:
        if self._whole:  # else nothing is ever submitted
            await self._collector.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        if not self._whole:
            return None
        return await self._collector.__aexit__(exc_type, exc, tb)

    def check_piece(self, job: ReadJob, file_offset: int, piece: memoryview) -> None:
        """Blocking, on a read or transfer thread: check the tensors' bytes in
        ``piece``, the bytes of ``job``'s file from ``file_offset`` that just landed."""
        # Timed without a context manager: this runs once per read call.
        clock = self._meter.clock
        began = clock()
        data = numpy.frombuffer(piece, dtype=numpy.uint8)
        end = file_offset + len(data)
        pieces = self._pieces
        for lo, hi, name in self._spans.overlapping(
            job.buffer_index, job.file_index, file_offset, end
        ):
            check = pieces[name]
            check.check_piece(data[lo - file_offset : hi - file_offset], lo - check.offset)
        self._meter.add(began, clock(), nbytes=len(data))

    def job_checked(self, job: ReadJob) -> None:
        """Blocking, on the thread that checked the last piece of host job ``job``:
        finish the check of each tensor whose bytes all lie in jobs checked by now.

        The thread that checks a tensor's last bytes finishes it there, in the core's
        cache, instead of the loop sending it to a check thread and awaiting the call:
        that round trip, once per batch of landed jobs, cost the loop a wake-up and two
        hand-offs of the GIL, each of which can wait a switch interval behind a busy
        thread. Every ``check_piece`` call for ``job`` must have returned."""
        names = self._countdown.checked(job)
        if not names:
            return
        done = [self._pieces[name] for name in names]
        failures = self._finish_all(done)
        bad = {f.name for f in failures}
        with self._landing:
            self._piece_failures.extend(failures)
            for check in done:
                self._finished[check.name] = check.name not in bad

    async def tensors_ready(self, names: Sequence[str]) -> None:
        """Every byte of each tensor of ``names`` has landed: finish its check, or start
        one. A piece-checked tensor's reader thread has finished it (``job_checked``);
        the others (device tensors) are finished in one call on a check thread (a call
        per tensor would make the loop's round trips the check's cost); whole-tensor
        checks wait only while too many are in flight."""
        finished = self._finished
        finishing = [
            check
            for name in names
            if (check := self._pieces.get(name)) is not None and name not in finished
        ]
        if finishing:
            # Their pieces were checked as they landed: only the units that straddled
            # two jobs are left.
            failures = await self._threads.run_sync(self._finish_all, finishing)
            with self._landing:
                self._piece_failures.extend(failures)
            if self._passed is not None:
                bad = {f.name for f in failures}
                self._passed([c.name for c in finishing if c.name not in bad])
        if self._passed is not None and (passed := [name for name in names if finished.get(name)]):
            self._passed(passed)
        if not self.enabled:
            if self._passed is not None:
                self._passed(names)
            return
        for name in names:
            if name in self._pieces:
                continue
            entry = self._index[name]
            slot = self._slots[name]
            image = self._images[slot.buffer_index]
            if isinstance(image, MappedImage):
                source = FileBytes(self._files[entry.file_index], entry.offset, entry.nbytes)
                await self._collector.submit(name, entry.type, source)
            else:
                data, xp = _tensor_data(slot, image)
                await self._collector.submit(name, entry.type, data, xp=xp)

    def _finish_all(self, checks: Sequence[PieceCheck]) -> list[TensorFailure]:
        """Blocking: ``_finish`` each check; the failures found."""
        return [failure for check in checks if (failure := self._finish(check)) is not None]

    def _finish(self, check: PieceCheck) -> TensorFailure | None:
        """Blocking: the units of a tensor no piece covered, read from where it lives
        (a device tensor: a few small copies back to the host)."""
        with self._meter.span():
            slot = self._slots[check.name]
            image = self._images[slot.buffer_index]
            if isinstance(image, DeviceImage):
                buffer = image.buffer

                def fetch(lo: int, hi: int) -> numpy.ndarray[Any, numpy.dtype[numpy.uint8]]:
                    return numpy.frombuffer(
                        buffer.to_host(slot.buffer_offset + lo, hi - lo), numpy.uint8
                    )

                return check.finish_from(fetch)
            if isinstance(image, MappedImage):
                # Through reads of the file, never the mapping (``FileBytes`` says why).
                entry = self._index[check.name]
                return check.finish_from(_file_fetch(self._files[entry.file_index], entry.offset))
            data, _ = _tensor_data(slot, image)
            return check.finish(data)

    @property
    def checked(self) -> int:
        """Tensors checked (0 when checks are off)."""
        return self._collector.submitted + len(self._pieces) if self.enabled else 0

    @property
    def failures(self) -> tuple[TensorFailure, ...]:
        """Every bad tensor, whichever way it was checked, in index order."""
        found = [*self._collector.failures, *self._piece_failures]
        if not found:
            return ()
        order = {t.name: i for i, t in enumerate(self._index.tensors)}
        return tuple(sorted(found, key=lambda f: order[f.name]))

    def times(self) -> StageTimes:
        """The stage's work so far: wall and busy time, tensors and bytes checked."""
        times = self._meter.times()
        return StageTimes(times.start_s, times.end_s, times.busy_s, self.checked, times.nbytes)
