"""Records of the streaming half of a load: allocate → read → upload → validate.

A destination buffer is an *image of the file ranges it holds* (design §2.1): every
tensor sits at a fixed offset from the start of its range's slot, so one read of any
size, spanning many tensors, lands every byte in its final place.

The records come with the pure functions that make them from a plan, on the load's
thread: ``layout_buffers`` (each image), ``tensor_slots`` and ``TensorSpans`` (where
each tensor sits), ``split_jobs`` (the reads, cut in load order); and the one count of
each tensor's bytes still to come, ``TensorCountdown``.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

from aiogguf._fastinit import fast_init
from aiogguf._records import BufferPlan, FileRange, Plan, WeightIndex
from aiogguf.io.files import align_down, align_up
from aiogguf.io.workers import raise_if_stopped

__all__ = [
    "BufferLayout",
    "LandedWatcher",
    "Passed",
    "PieceSink",
    "RangeSlot",
    "ReadJob",
    "SlotFill",
    "StageMeter",
    "StageTimes",
    "TensorCountdown",
    "TensorSlot",
    "TensorSpans",
    "Watcher",
    "each_job",
    "each_piece",
    "job_bytes",
    "layout_buffers",
    "load_order",
    "read_jobs",
    "split_jobs",
    "tensor_slots",
]


@fast_init
@dataclass(frozen=True, slots=True)
class TensorSlot:
    """Where one tensor's bytes sit in its buffer image."""

    name: str
    buffer_index: int
    buffer_offset: int
    nbytes: int
    file_index: int
    file_offset: int


@fast_init
@dataclass(frozen=True, slots=True)
class RangeSlot:
    """One coalesced file range and the part of the buffer image that holds it.

    ``file_start``/``file_end`` are the range widened to the I/O alignment, so that an
    O_DIRECT read of the widened range lands at ``buffer_offset`` unchanged.
    """

    range: FileRange
    file_start: int
    file_end: int
    buffer_offset: int

    def buffer_offset_of(self, file_offset: int) -> int:
        return self.buffer_offset + (file_offset - self.file_start)


@dataclass(frozen=True, slots=True)
class BufferLayout:
    """The image layout of one planned buffer."""

    index: int
    plan: BufferPlan
    slots: tuple[RangeSlot, ...]
    nbytes: int  # size of the image, alignment slack included


@dataclass(frozen=True, slots=True)
class ReadJob:
    """One bounded read: ``nbytes`` of file ``file_index`` at ``file_offset`` into buffer
    ``buffer_index`` at ``buffer_offset``. ``useful_start``/``useful_end`` are the file
    bytes inside it that belong to tensors (a direct read also carries alignment slack).
    """

    seq: int
    buffer_index: int
    file_index: int
    file_offset: int
    nbytes: int
    buffer_offset: int
    useful_start: int
    useful_end: int
    lazy: bool = False


class PieceSink(Protocol):
    """Where a reader hands each piece of file bytes it has just landed (the engine
    wires the validate stage's piece checks here). Blocking, on a read or transfer
    thread, right after the piece's read."""

    def __call__(self, job: ReadJob, file_offset: int, piece: memoryview, /) -> None:
        """``piece``: the bytes of ``job``'s file from ``file_offset`` on, landed."""


class LandedWatcher(Protocol):
    """One of the things that look at a load's bytes as they land (the tensor checks,
    a manifest's block hashes, a llama manifest's tensor hashes, the ready stream's
    checked jobs). Each hook is None where it does not watch that way; the front
    composes the load's list, and the reader calls it, each hook in the list's order,
    on the thread that landed the bytes."""

    @property
    def piece(self) -> PieceSink | None:
        """Gets each landed piece of file bytes, right after its read."""
        ...

    @property
    def stream(self) -> PieceSink | None:
        """Gets a local file's buffered reads in parts small enough to be in the core's
        cache, in order within a job, each right after it landed (before ``piece``)."""
        ...

    @property
    def from_file(self) -> Callable[[ReadJob], None] | None:
        """Gets each job whose landed bytes are not the file's as a piece would show
        them (a mapped image, which it must not read; swapped bytes), once it landed."""
        ...

    @property
    def checked(self) -> Callable[[ReadJob], None] | None:
        """Told each host job whose every piece went to the ``piece`` hooks, once the
        last of them returned."""
        ...


@dataclass(frozen=True, slots=True)
class Watcher:
    """A ``LandedWatcher`` made of the hooks it has."""

    piece: PieceSink | None = None
    stream: PieceSink | None = None
    from_file: Callable[[ReadJob], None] | None = None
    checked: Callable[[ReadJob], None] | None = None


def each_piece(sinks: Sequence[PieceSink]) -> PieceSink | None:
    """One piece sink that hands each piece to every one of ``sinks`` in order (None:
    no sink; the one sink itself: no call more per piece)."""
    if len(sinks) <= 1:
        return sinks[0] if sinks else None

    def sink(job: ReadJob, file_offset: int, piece: memoryview) -> None:
        for each in sinks:
            each(job, file_offset, piece)

    return sink


def each_job(calls: Sequence[Callable[[ReadJob], None]]) -> Callable[[ReadJob], None] | None:
    """As ``each_piece``, for the hooks told of a whole job."""
    if len(calls) <= 1:
        return calls[0] if calls else None

    def call(job: ReadJob) -> None:
        for each in calls:
            each(job)

    return call


class SlotFill(Protocol):
    """Fills a staging slot with one device job's bytes (the engine wires the read
    stage's ``Reader.fill_slot`` here). Blocking, on a transfer thread."""

    def __call__(self, job: ReadJob, slot: memoryview, /) -> None:
        """Write ``job``'s ``nbytes`` into ``slot`` (and hand them to the piece sink)."""


Passed = Callable[[Sequence[str]], None]
"""Told, on the loop's thread, the tensors that are ready to hand on: every byte landed
and every check passed (the engine wires ``aiogguf._core.ready``'s record here)."""


@dataclass(frozen=True, slots=True)
class StageTimes:
    """What one stage did: ``start_s``/``end_s`` are its first start and last end in
    seconds since the load began, ``busy_s`` sums its workers' working time (above the
    wall time when workers overlap), ``items`` and ``nbytes`` what it got through."""

    start_s: float = 0.0
    end_s: float = 0.0
    busy_s: float = 0.0
    items: int = 0
    nbytes: int = 0

    @property
    def wall_s(self) -> float:
        return self.end_s - self.start_s


class StageMeter:
    """Collects a ``StageTimes`` from spans of work that any thread may add."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock  # seconds since the load began
        self._lock = threading.Lock()
        self._start: float | None = None
        self._end = 0.0
        self._busy_s = 0.0
        self._items = 0
        self._nbytes = 0

    def add(self, start: float, end: float, *, items: int = 0, nbytes: int = 0) -> None:
        """Count one span of work, ``start`` to ``end`` on the meter's clock."""
        with self._lock:
            self._start = start if self._start is None else min(self._start, start)
            self._end = max(self._end, end)
            self._busy_s += end - start
            self._items += items
            self._nbytes += nbytes

    @contextmanager
    def span(self, *, items: int = 0, nbytes: int = 0) -> Iterator[None]:
        """Count the work done inside the ``with`` block (when it ends without error)."""
        start = self.clock()
        yield
        self.add(start, self.clock(), items=items, nbytes=nbytes)

    def times(self) -> StageTimes:
        """The spans added so far, as one ``StageTimes``."""
        with self._lock:
            start = self._start if self._start is not None else 0.0
            return StageTimes(start, max(self._end, start), self._busy_s, self._items, self._nbytes)


# ---------------------------------------------------------------------------------------
# Laying out the images, and cutting the reads into jobs (pure: made on the load's thread).


def layout_buffers(plan: Plan, alignment: int) -> tuple[BufferLayout, ...]:
    """The image layout of every planned buffer. Each range gets a slot widened to
    ``alignment`` at both ends, placed at an aligned offset of the buffer."""
    layouts: list[BufferLayout] = []
    for index, buffer in enumerate(plan.buffers):
        slots: list[RangeSlot] = []
        cursor = 0
        for r in buffer.ranges:
            start, end = align_down(r.start, alignment), align_up(r.end, alignment)
            slots.append(RangeSlot(r, start, end, cursor))
            cursor += end - start
        layouts.append(BufferLayout(index, buffer, tuple(slots), cursor))
    return tuple(layouts)


def tensor_slots(index: WeightIndex, layouts: Sequence[BufferLayout]) -> dict[str, TensorSlot]:
    """Where each tensor sits in its buffer image."""
    slots: dict[str, TensorSlot] = {}
    for layout in layouts:
        for rs in layout.slots:
            for name in rs.range.tensors:
                entry = index[name]
                slots[name] = TensorSlot(
                    name=name,
                    buffer_index=layout.index,
                    buffer_offset=rs.buffer_offset_of(entry.offset),
                    nbytes=entry.nbytes,
                    file_index=entry.file_index,
                    file_offset=entry.offset,
                )
    return slots


class TensorSpans:
    """Each loaded buffer's tensors by file offset, for finding the tensors a read
    touched. Built once, read-only afterwards: any thread may use it."""

    def __init__(self, index: WeightIndex, layouts: Sequence[BufferLayout]) -> None:
        self._spans: dict[tuple[int, int], list[tuple[int, int, str]]] = {}
        for layout in layouts:
            if layout.plan.lazy:
                continue
            for rs in layout.slots:
                spans = self._spans.setdefault((layout.index, rs.range.file_index), [])
                spans.extend((index[n].offset, index[n].end, n) for n in rs.range.tensors)
        for spans in self._spans.values():
            spans.sort()
        # The spans' starts apart: a bisect without a key function (a read's every
        # piece looks its tensors up here).
        self._starts = {key: [s[0] for s in spans] for key, spans in self._spans.items()}

    def sizes(self) -> dict[str, int]:
        """Each loaded tensor's bytes, by name."""
        return {name: end - start for spans in self._spans.values() for start, end, name in spans}

    def overlapping(
        self, buffer_index: int, file_index: int, start: int, end: int
    ) -> Iterator[tuple[int, int, str]]:
        """``(lo, hi, name)``: the part ``[lo, hi)`` of each tensor inside ``[start, end)``."""
        key = (buffer_index, file_index)
        spans = self._spans.get(key)
        if spans is None:
            return
        i = max(bisect.bisect_right(self._starts[key], start) - 1, 0)
        n = len(spans)
        while i < n:
            t_start, t_end, name = spans[i]
            if t_start >= end:
                return
            lo, hi = max(t_start, start), min(t_end, end)
            if lo < hi:
                yield lo, hi, name
            i += 1


class TensorCountdown:
    """Each loaded tensor's bytes still to come, counted once per load, from the
    layout's spans; the progress, the transfers and the checks count down here and are
    told which tensors a job completed.

    One count per tensor for its way into place, on the loop's thread only (no lock):
    a host tensor's bytes count once they landed (``landed``); a device tensor's once
    they landed, or, when the load follows its copies (``follow_copies``: a stream of
    ready tensors was asked for), once the copies that hold them have completed
    (``copied``). Apart from it, the bytes of the host tensors checked by pieces on the
    reader threads (``count_checks``) count once their job's pieces have been checked
    (``checked``, on those threads, under this record's own lock): a job's check comes
    before its landing, so that count reaches zero first."""

    def __init__(self, spans: TensorSpans) -> None:
        self.spans = spans
        self._left = spans.sizes()
        self._follow_copies = False
        self._unchecked: dict[str, int] = {}
        self._checking = threading.Lock()

    def count_checks(self, names: Iterable[str]) -> None:
        """Count the checks of host tensors ``names`` (before the first read)."""
        sizes = self.spans.sizes()
        self._unchecked = {name: sizes[name] for name in names}

    def follow_copies(self) -> None:
        """Device tensors are in place once their copies have completed, not once they
        landed (before the first device job lands)."""
        self._follow_copies = True

    def landed(self, job: ReadJob, *, on_device: bool) -> list[str]:
        """On the loop's thread: the tensors whose last bytes ``job`` landed (none of a
        device job's when copies are followed)."""
        done: list[str] = []
        if on_device and self._follow_copies:
            return done
        left = self._left
        for lo, hi, name in self.spans.overlapping(
            job.buffer_index, job.file_index, job.useful_start, job.useful_end
        ):
            left[name] -= hi - lo
            if not left[name]:
                done.append(name)
        return done

    def copied(self, jobs: Sequence[ReadJob]) -> list[str]:
        """On the loop's thread, copies followed: the tensors whose last copy ``jobs``
        completed."""
        done: list[str] = []
        left = self._left
        for job in jobs:
            for lo, hi, name in self.spans.overlapping(
                job.buffer_index, job.file_index, job.useful_start, job.useful_end
            ):
                left[name] -= hi - lo
                if not left[name]:
                    done.append(name)
        return done

    def checked(self, job: ReadJob) -> list[str]:
        """From any thread, once every piece of host job ``job`` has been checked: the
        tensors counted by ``count_checks`` whose last bytes it held."""
        done: list[str] = []
        unchecked = self._unchecked
        with self._checking:
            for lo, hi, name in self.spans.overlapping(
                job.buffer_index, job.file_index, job.useful_start, job.useful_end
            ):
                left = unchecked.get(name)
                if left is None:
                    continue  # checked whole, or on a device
                left -= hi - lo
                unchecked[name] = left
                if not left:
                    done.append(name)
        return done


def _biggest_tensor(index: WeightIndex, rs: RangeSlot) -> int:
    return max((index[name].nbytes for name in rs.range.tensors), default=0)


def load_order(
    index: WeightIndex, layouts: Sequence[BufferLayout]
) -> list[tuple[BufferLayout, RangeSlot]]:
    """Ranges in the order they are read: staged (device) ranges first, biggest tensor
    first; then host ranges in file order; lazy ranges last (they are only mapped)."""
    staged = [(lay, rs) for lay in layouts if not lay.plan.host for rs in lay.slots]
    host = [(lay, rs) for lay in layouts if lay.plan.host and not lay.plan.lazy for rs in lay.slots]
    lazy = [(lay, rs) for lay in layouts if lay.plan.host and lay.plan.lazy for rs in lay.slots]
    staged.sort(key=lambda item: -_biggest_tensor(index, item[1]))
    host.sort(key=lambda item: (item[1].range.file_index, item[1].range.start))
    return staged + host + lazy


def read_jobs(
    ordered: Sequence[tuple[BufferLayout, RangeSlot]],
    chunk_bytes: int,
    *,
    aligned: bool,
    blocks: Sequence[tuple[int, int]] | None = None,
    alignment: int = 1,
) -> Iterator[ReadJob]:
    """Split every range into reads of at most ``chunk_bytes``.

    ``aligned`` reads cover the widened slot (O_DIRECT needs aligned offsets and
    lengths); unaligned reads cover exactly the range's bytes. ``blocks`` (per file:
    where its data section starts, and a block size): a job that does not reach its
    range's end ends its useful bytes at a block boundary, where one fits, so that a
    hash block lies inside one job's useful bytes; an aligned read then reaches to the
    ``alignment`` unit around the boundary, which the next job's read starts at too
    (the two write the same file bytes there; each counts its own side).
    """
    seq = 0
    for layout, rs in ordered:
        r = rs.range
        start, end = (rs.file_start, rs.file_end) if aligned else (r.start, r.end)
        grid = blocks[r.file_index] if blocks is not None else None
        useful, offset = r.start, start
        while useful < r.end:
            raise_if_stopped()  # once per job (a model of hundreds of GiB has 10^4)
            cut = min(offset + chunk_bytes, end)
            if grid is not None and cut < end:
                cut = _to_block(useful, cut, grid, alignment if aligned else 1)
            stop = min(align_up(cut, alignment), end) if aligned else cut
            yield ReadJob(
                seq=seq,
                buffer_index=layout.index,
                file_index=r.file_index,
                file_offset=offset,
                nbytes=stop - offset,
                buffer_offset=rs.buffer_offset_of(offset),
                useful_start=useful,
                useful_end=min(cut, r.end),
                lazy=layout.plan.lazy,
            )
            seq += 1
            useful = cut
            offset = align_down(cut, alignment) if aligned else cut


def _to_block(useful: int, cut: int, grid: tuple[int, int], alignment: int) -> int:
    """``cut`` moved down to the last block boundary of ``grid`` after ``useful``
    whose read, rounded up to ``alignment``, still ends by ``cut``; unchanged when
    none does."""
    data_start, block_bytes = grid
    if cut <= data_start:
        return cut
    boundary = cut - (cut - data_start) % block_bytes
    while boundary > useful and align_up(boundary, alignment) > cut:
        boundary -= block_bytes
    return boundary if boundary > useful else cut


# Jobs smaller than this are not worth a reader of their own.
MIN_SPREAD_BYTES = 1 << 20
# A mapped job is one call that makes its pages resident, whose cost is mostly per call
# when the file is cached: fewer, larger calls (still several per GiB, for progress).
MIN_MAPPED_JOB_BYTES = 256 << 20


def job_bytes(
    chunk_bytes: int,
    layouts: Sequence[BufferLayout],
    readers: int,
    alignment: int,
    *,
    mapped: bool = False,
) -> int:
    """How big a host job is: ``chunk_bytes`` (``mapped``: at least
    ``MIN_MAPPED_JOB_BYTES``), or less for a model too small to give every reader a job
    of that size, so that its readers share it (down to ``MIN_SPREAD_BYTES``); a
    multiple of ``alignment``."""
    if mapped:
        chunk_bytes = max(chunk_bytes, MIN_MAPPED_JOB_BYTES)
    host = sum(lay.nbytes for lay in layouts if lay.plan.host and not lay.plan.lazy)
    spread = max(-(-host // max(readers, 1)), MIN_SPREAD_BYTES)
    return align_up(min(chunk_bytes, spread), alignment)


def split_jobs(
    index: WeightIndex,
    layouts: Sequence[BufferLayout],
    chunk_bytes: int,
    *,
    host_bytes: int,
    slot_bytes: int | None,
    aligned: bool,
    blocks: Sequence[tuple[int, int]] | None = None,
    alignment: int = 1,
) -> tuple[list[list[ReadJob]], list[ReadJob]]:
    """Host jobs per file (at most ``host_bytes``: ``job_bytes``), and device jobs (at
    most ``chunk_bytes`` and ``slot_bytes``: each fills one staging slot), each in load
    order, cut at ``blocks``' boundaries where given (``read_jobs``). Lazy ranges are
    only mapped, never read."""
    ordered = [item for item in load_order(index, layouts) if not item[0].plan.lazy]
    staged = [item for item in ordered if not item[0].plan.host]
    hosted = [item for item in ordered if item[0].plan.host]
    device_jobs: list[ReadJob] = []
    if staged:
        assert slot_bytes is not None, "device buffers need a staging slot size"
        device_jobs = list(
            read_jobs(
                staged,
                min(chunk_bytes, slot_bytes),
                aligned=aligned,
                blocks=blocks,
                alignment=alignment,
            )
        )
    per_file: list[list[ReadJob]] = [[] for _ in index.files]
    host_jobs = read_jobs(hosted, host_bytes, aligned=aligned, blocks=blocks, alignment=alignment)
    for job in host_jobs:
        per_file[job.file_index].append(job)
    return per_file, device_jobs
