"""The read stage: bring each job's file bytes to where they belong.

The unit of I/O is a coalesced file range cut into jobs of at most ``chunk_size``.
Per mode (design §1.5):

- ``none``: ``preadv`` straight into the destination buffer image;
- ``direct``: ``O_DIRECT`` reads of aligned chunks into the (page-aligned) image;
- ``mmap``/``mlock``: the mapping is the buffer; each job's pages are made resident by
  the kernel in one call (``MADV_POPULATE_READ``), so that "loaded" means resident;
  ``mlock`` locks them instead, which reads them in too (one pass, not two). A lock the
  kernel refuses (``RLIMIT_MEMLOCK``) leaves the rest of the load unlocked, and says so
  once (``lock_refusal``);
- device-bound jobs: the same reads, into a staging slot: ``fill_slot`` is what the
  upload stage's transfer threads run (this stage knows nothing of devices).

The stage owns the load's descriptors (``open_data_files``), the reader limit of each
disk (``find_disks``) and the byte order of what lands (``ByteSwap``). ``Reader`` reads
one job at a time and blocks (it runs on the load's threads); ``HostReads`` runs the
host jobs on the reader threads: ``start`` hands them all out at once and returns, and
the loop awaits them in ``finish``.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import anyio
import numpy as np
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from aiogguf._config import Config, LoadMode
from aiogguf._images import BACK_BYTES, HostImage, Image, MappedImage
from aiogguf._jobs import (
    BufferLayout,
    LandedWatcher,
    PieceSink,
    ReadJob,
    StageTimes,
    each_job,
    each_piece,
    job_bytes,
)
from aiogguf._records import ModeTraits, Plan, WeightIndex
from aiogguf.errors import BigEndianError, shown_path
from aiogguf.io.byteswap import can_convert, to_native
from aiogguf.io.files import DataFile, FileAdvice, open_file
from aiogguf.io.mapping import FileMapping
from aiogguf.io.opener import OpenFiles
from aiogguf.io.source import ByteSource, DirectSource
from aiogguf.io.workers import Call, LoadThreads, raise_if_stopped

__all__ = [
    "CHECK_PIECE_BYTES",
    "ByteSwap",
    "Disks",
    "FileStats",
    "HostReads",
    "ReadOptions",
    "Reader",
    "ThreadPlan",
    "direct_refusals",
    "find_disks",
    "most_readers",
    "open_data_files",
    "plan_threads",
]


# With checks on, buffered reads land in pieces this large, each checked right after its
# read. Every piece costs the GIL a read call and a numpy call per tensor in it, and the
# GIL a load holds per GB caps its rate whatever its thread count (README, Performance:
# the GIL budget), so a piece is a whole default job: the checks' reductions read only
# a column of each block, at memory speed, and need no cache to keep up with the disk.
# Bounded still, so that a stop reaches a reader of a slow disk within a second.
CHECK_PIECE_BYTES = 64 << 20
# With a stream (a manifest's block hashes), a local file's buffered piece lands in reads
# this large, each hashed right after it landed, while it is in the core's own cache
# rather than read back from memory (docs/performance.md has the figures).
STREAM_BYTES = 1 << 20
# A read into pages not backed yet (a unit of its image that another reader is still
# backing) faults each page in inside the call, and on a kernel without preemption a
# thread keeps its core for the whole call: the event loop, where the readers fill the
# cores, waits that long for one. Such a read goes in calls this large (a few ms each).
FAULTING_CALL_BYTES = 8 << 20


def open_data_files(
    index: WeightIndex,
    opened: OpenFiles,
    *,
    direct: bool,
    alignment: int,
    keep: Callable[[DataFile], None],
) -> None:
    """Blocking: open the load's files for reading, each handed to ``keep`` as soon as it
    opens, in order: its owner closes them, also those opened before a failure. The descriptors
    are those the parse stage read (``opened``), so the file that was parsed is the file
    that is read, whatever its name points at now. ``direct``: the mode opens with
    ``O_DIRECT``; a file that refuses it is read with mode ``none`` (``direct_refusals``
    words it)."""
    for parsed in index.files:
        f = open_file(parsed.path, direct=direct, alignment=alignment, fd=opened.open(parsed.path))
        keep(f)
        # Every mode reads each file front to back (O_DIRECT ignores the advice): the
        # kernel then reads ahead in larger steps, and a cold buffered load costs it
        # fewer, larger reads (the README's cold figures).
        f.fadvise(FileAdvice.SEQUENTIAL)


def direct_refusals(files: Sequence[ByteSource], *, direct: bool) -> list[str]:
    """The warnings for files that refused ``O_DIRECT`` (``direct``: the mode asked it)."""
    if not direct:
        return []
    return [
        f"{shown_path(f.path)}: {f.direct_refusal}; reading with mode 'none' instead"
        for f in files
        if not f.direct_ok
    ]


def disk_of(file: ByteSource, config: Config) -> str:
    """The disk a file is read from: a local file's ``[[pipeline.path]]`` prefix, else
    where the source says its reads queue (the filesystem device, the remote host)."""
    limit = config.pipeline.path_limit(file.path) if file.local else None
    if limit is not None:
        return limit.prefix
    return file.disk()


@dataclass(frozen=True, slots=True)
class Disks:
    """Per file of a load: the disk it is read from (``disk_of``) and that disk's reader
    limit (``[[pipeline.path]]``'s, else ``readers``; the disk's first file decides)."""

    names: tuple[str, ...]
    readers: tuple[int, ...]

    @property
    def total_readers(self) -> int:
        """Readers over every disk."""
        return sum(dict(zip(self.names, self.readers, strict=True)).values())

    @property
    def busiest(self) -> int:
        """The most readers one disk allows."""
        return max(self.readers, default=1)


def find_disks(files: Sequence[ByteSource], config: Config) -> Disks:
    """Blocking (a ``stat`` per local file): the disk of each file and its reader limit
    (a remote file's: ``remote_in_flight`` per host)."""
    pipeline = config.pipeline
    limits: dict[str, int] = {}
    names: list[str] = []
    for f in files:
        disk = disk_of(f, config)
        if disk not in limits:
            limits[disk] = (
                pipeline.readers_for(f.path, direct=f.direct_ok)
                if f.local
                else pipeline.remote_in_flight
            )
        names.append(disk)
    return Disks(tuple(names), tuple(limits[name] for name in names))


@dataclass(frozen=True, slots=True)
class ThreadPlan:
    """What ``readers`` decides for one load, decided once with its layout
    (``plan_threads``) and read by every stage: ``disks`` (each file's disk and its
    reader limit), ``readers`` (reader threads, over every disk), ``transfer_threads``
    (one pool that every device's jobs share: as many as the busiest disk allows
    readers, as a transfer thread reads as much as it copies), ``job_bytes`` (a host
    job's size: ``job_bytes``),
    ``check_threads`` (lent for the checks: 0 with checks off, where the readers'
    threads stand in) and ``checks_apart`` (a landed job is checked on a check thread
    while its reader reads the next, instead of by the reader in turn)."""

    disks: Disks
    readers: int
    transfer_threads: int
    job_bytes: int
    check_threads: int
    checks_apart: bool


def plan_threads(
    disks: Disks,
    layouts: Sequence[BufferLayout],
    config: Config,
    mode: ModeTraits,
    *,
    cores: int,
) -> ThreadPlan:
    """The thread plan of a load of ``layouts`` in ``mode`` from ``disks``, on a machine
    of ``cores`` usable cores."""
    pipeline, check = config.pipeline, config.load.check_tensors
    readers = disks.total_readers
    workers = pipeline.validate_workers
    return ThreadPlan(
        disks,
        readers,
        transfer_threads=disks.busiest,
        job_bytes=job_bytes(
            pipeline.chunk_size,
            layouts,
            readers,
            pipeline.alignment,
            # With checks on, a mapped tensor is checked once its job has landed: the
            # reads' own size lets the checks start sooner.
            mapped=mode.mapped and not check,
        ),
        check_threads=workers if check else 0,
        # Checks apart only where the check threads outnumber the readers and a core is
        # left for them: there they keep up; many readers check in parallel themselves.
        checks_apart=readers < min(cores, workers),
    )


def most_readers(config: Config) -> int:
    """The reader threads a load of ``config`` runs at most on one disk, known before its
    plan: only mode ``direct`` asks fewer by default (``auto`` never resolves to it)."""
    return config.pipeline.reader_count(direct=config.load.mode is LoadMode.DIRECT)


class ByteSwap:
    """Big-endian files (format §1.4): converts, in place, the elements of every tensor
    a landed job carries, before anyone else sees them."""

    def __init__(self, index: WeightIndex, layouts: Sequence[BufferLayout]) -> None:
        self._index = index
        self._layouts = layouts

    @staticmethod
    def raise_if_unconvertible(index: WeightIndex, plan: Plan) -> None:
        """Raise ``BigEndianError`` for the first tensor whose type has no one obvious
        byte order, before anything is read."""
        for t in plan.tensors:
            entry = index[t.name]
            if not can_convert(entry.type):
                raise BigEndianError(
                    index.files[entry.file_index].path,
                    entry.offset,
                    f"big-endian GGUF: byte order of type {entry.type.name} cannot be "
                    f"converted (tensor '{entry.name}')",
                )

    def __call__(self, job: ReadJob, view: memoryview) -> None:
        """Byte-swap the tensors' bytes of ``job`` in ``view`` (its ``nbytes`` from
        ``job.file_offset``)."""
        data = np.frombuffer(view, dtype=np.uint8)
        for rs in self._layouts[job.buffer_index].slots:
            r = rs.range
            if r.file_index != job.file_index or r.end <= job.useful_start:
                continue
            if r.start >= job.useful_end:
                break
            for name in r.tensors:
                entry = self._index[name]
                lo, hi = max(entry.offset, job.useful_start), min(entry.end, job.useful_end)
                if lo < hi:
                    to_native(
                        entry.type,
                        data[lo - job.file_offset : hi - job.file_offset],
                        path=self._index.files[entry.file_index].path,
                        name=name,
                    )


@dataclass(slots=True)
class FileStats:
    """Mutable per-file counters, updated on the event loop thread only."""

    nbytes: int = 0
    reads: int = 0
    busy_s: float = 0.0
    first_start: float | None = None
    last_end: float = 0.0


@dataclass(frozen=True, slots=True)
class ReadOptions:
    """How a load's reader treats what lands: ``swap`` (big-endian files) converts the
    bytes of a landed job in place before anyone else sees them; ``lock`` (mode
    ``mlock``) locks a mapped job's pages as it reads them in; ``spare_core``: a core
    the readers leave idle checks each landed job of a local file while its reader
    reads the next, instead of the reader checking in turn."""

    swap: Callable[[ReadJob, memoryview], None] | None = None
    lock: bool = False
    spare_core: bool = False


class Reader:
    """Executes one load's read jobs, one at a time, on the calling thread (``HostReads``
    runs the host ones; the upload stage's transfer threads call ``fill_slot``), and
    counts what landed. It reads each file through its ``ByteSource`` (``files``), and
    through its ``direct`` twin where the file's reads bypass the page cache.

    ``watchers`` look at the bytes as they land, each hook in the list's order
    (``LandedWatcher``): the ``piece`` hooks get each piece as soon as it has landed:
    buffered reads on the reader's own thread, right after its read; ``O_DIRECT`` reads
    (which land by DMA, not through the cache) and a local file's reads when
    ``options.spare_core`` once landed (``check_landed``), on a check thread, so that
    the disk gets its next read while the last one is checked. A piece holds at most
    the file's ``piece_bytes`` (default ``CHECK_PIECE_BYTES``). The ``from_file`` hooks
    get each job whose landed bytes are not the file's bytes as a piece would show them
    (mapped images, which they must not read; swapped bytes), once it landed, on the
    thread that landed it. The ``stream`` hooks get a local file's buffered reads,
    checked on the reader's thread in reads of ``STREAM_BYTES``, each right after it
    landed, before the piece that holds it goes to the ``piece`` hooks. The ``checked``
    hooks are told each host job whose every piece went to the ``piece`` hooks, on the
    thread that checked it, once the last of them has returned.

    A local file's job has its pages in a host image backed with memory in one call
    before its read (``HostImage.back``) rather than faulted in one by one by the read
    itself (a job whose pages another reader is still backing is read in calls of at
    most ``FAULTING_CALL_BYTES``); a remote file's request would wait for the backing,
    where its faults overlap the network's waits. ``options``: ``ReadOptions``."""

    def __init__(
        self,
        files: Sequence[ByteSource],
        images: Sequence[Image | None],
        watchers: Sequence[LandedWatcher] = (),
        *,
        clock: Callable[[], float],
        options: ReadOptions = ReadOptions(),
    ) -> None:
        self._files = files
        self._images = images
        # Each hook of the watchers made one call (no loop per piece for one watcher).
        self._pieces = each_piece([w.piece for w in watchers if w.piece is not None])
        self._file_check = each_job([w.from_file for w in watchers if w.from_file is not None])
        self._checked = each_job([w.checked for w in watchers if w.checked is not None])
        stream = each_piece([w.stream for w in watchers if w.stream is not None])
        # Per file, fixed now: a file that stops taking O_DIRECT reads later still
        # counts as read direct (the engine warns of it).
        self._direct: list[DirectSource | None] = [f.direct for f in files]
        self._piece_bytes = [f.piece_bytes or CHECK_PIECE_BYTES for f in files]
        self._back_first = [f.local for f in files]
        self._apart = [f.local and options.spare_core for f in files]
        # A remote file's reads are its requests, which stay whole.
        self._stream = [stream if f.local else None for f in files]
        self._clock = clock
        self._swap = options.swap
        self._lock = options.lock
        self.lock_refusal: str | None = None  # the kernel's first refusal to lock
        self.stats: list[FileStats] = [FileStats() for _ in files]

    @property
    def direct(self) -> Sequence[bool]:
        """Per file: whether reads really bypass the page cache."""
        return [d is not None for d in self._direct]

    def times(self, fill_s: float = 0.0) -> StageTimes:
        """The stage's times over every file; ``fill_s``: time the transfer threads
        spent reading into staging slots (their jobs count here with no busy time)."""
        started = [s.first_start for s in self.stats if s.first_start is not None]
        start = min(started, default=0.0)
        return StageTimes(
            start_s=start,
            end_s=max((s.last_end for s in self.stats), default=start),
            busy_s=sum(s.busy_s for s in self.stats) + fill_s,
            items=sum(s.reads for s in self.stats),
            nbytes=sum(s.nbytes for s in self.stats),
        )

    def count(self, job: ReadJob, start: float, end: float) -> None:
        """Add a landed job to its file's counters (on the loop's thread)."""
        stats = self.stats[job.file_index]
        stats.nbytes += job.useful_end - job.useful_start
        stats.reads += 1
        stats.busy_s += end - start
        self.started(job.file_index, start)
        stats.last_end = max(stats.last_end, end)

    def started(self, file_index: int, when: float) -> None:
        """Reading the file began at ``when`` at the latest (the transfer threads, which
        read and check device jobs before they count as landed, say so up front)."""
        stats = self.stats[file_index]
        stats.first_start = when if stats.first_start is None else min(stats.first_start, when)

    def read(self, job: ReadJob) -> None:
        """Blocking: read host job ``job`` into its image (and check it, unless its file
        is checked apart)."""
        image = self._images[job.buffer_index]
        if isinstance(image, MappedImage):
            mapping = image.mapping_at(job.file_index, job.useful_start)
            if not self._resident_locked(mapping, job, image):
                mapping.touch(job.useful_start, job.useful_end)
            if self._swap is not None:
                self._swap(job, mapping.view(job.file_offset, job.nbytes))
            if self._file_check is not None:
                self._file_check(job)
            return
        assert isinstance(image, HostImage)
        dest = image.dest(job)
        backed = not self._back_first[job.file_index] or image.back(job)
        call = None if backed else FAULTING_CALL_BYTES
        if self._pieces is not None and not self.checks_apart(job.file_index):
            self._check_pieces(job, dest, read=True, call=call)
            self._host_job_checked(job)
            return
        self._read_into(job, dest, call=call)
        if self._swap is not None:
            self._swap(job, dest)
            if self._file_check is not None:
                self._file_check(job)
        if self._pieces is not None and not self.checks_apart(job.file_index):
            self._check_pieces(job, dest, read=False)
            self._host_job_checked(job)

    def check_landed(self, job: ReadJob) -> None:
        """Blocking: check a landed host job of a file checked apart."""
        image = self._images[job.buffer_index]
        assert isinstance(image, HostImage)
        self._check_pieces(job, image.dest(job), read=False)
        self._host_job_checked(job)

    def _host_job_checked(self, job: ReadJob) -> None:
        if self._checked is not None:
            self._checked(job)

    def checks_apart(self, file_index: int) -> bool:
        """Whether the file's jobs are checked on the check threads, after the read."""
        return self._pieces is not None and (
            self._direct[file_index] is not None or self._apart[file_index]
        )

    def _resident_locked(self, mapping: FileMapping, job: ReadJob, image: MappedImage) -> bool:
        """Mode ``mlock``: lock the job's pages and read them in; False when they are not
        locked (another mode, a lazy range, or the kernel refused)."""
        if not self._lock or self.lock_refusal is not None or image.layout.plan.lazy:
            return False
        if mapping.is_locked(job.useful_start, job.useful_end):
            # Locked on fault when it was mapped (``allocate.lock_on_fault``): each page
            # the populate faults in is locked.
            mapping.touch(job.useful_start, job.useful_end)
            return True
        result = mapping.lock(job.useful_start, job.useful_end)
        if not result.ok and self.lock_refusal is None:
            self.lock_refusal = result.problem
        return result.ok

    def _check_pieces(
        self, job: ReadJob, dest: memoryview, read: bool, *, call: int | None = None
    ) -> None:
        """Check ``job`` in ``dest`` (its ``nbytes`` from ``job.file_offset``) piece by
        piece: bounded, and each piece on the thread that read it, right after it is
        read (``read``: buffered reads of the job, piece by piece) or as it is (landed).

        Each check starts at the previous piece: the units that straddle the two are
        whole by then (a unit is scanned once, however many pieces cover it). Only the
        units that straddle two jobs are left for the end of the tensor, which for a
        device tensor means copying them back from the device."""
        assert self._pieces is not None
        useful = dest[job.useful_start - job.file_offset : job.useful_end - job.file_offset]
        previous, step = 0, self._piece_bytes[job.file_index]
        stream = self._stream[job.file_index] if read else None
        for lo in range(0, len(useful), step):
            raise_if_stopped()  # a job of a slow disk is cut short, piece by piece
            hi = min(lo + step, len(useful))
            if stream is not None:
                self._read_streamed(job, useful, lo, hi, stream)
            elif read:
                self._read_calls(job.file_index, useful[lo:hi], job.useful_start + lo, call)
            self._pieces(job, job.useful_start + previous, useful[previous:hi])
            previous = lo

    def _read_streamed(
        self, job: ReadJob, useful: memoryview, lo: int, hi: int, stream: PieceSink
    ) -> None:
        """Read ``useful[lo:hi]`` in reads of ``STREAM_BYTES``, each handed to ``stream``
        right after it landed, while its bytes are still in the CPU's cache."""
        file = self._files[job.file_index]
        for at in range(lo, hi, STREAM_BYTES):
            part = useful[at : min(at + STREAM_BYTES, hi)]
            file.read_into(part, job.useful_start + at)
            stream(job, job.useful_start + at, part)

    def _read_into(self, job: ReadJob, dest: memoryview, *, call: int | None = None) -> None:
        direct = self._direct[job.file_index]
        if direct is not None:
            direct.read_direct_into(dest, job.file_offset, job.nbytes, need_end=job.useful_end)
        else:
            # Only the useful bytes: in a direct load whose file fell back to buffered
            # reads the job still spans the aligned slot, which may pass the file's end.
            lo, hi = job.useful_start - job.file_offset, job.useful_end - job.file_offset
            self._read_calls(job.file_index, dest[lo:hi], job.useful_start, call)

    def _read_calls(self, file_index: int, view: memoryview, offset: int, call: int | None) -> None:
        """Fill ``view`` from ``offset`` of the file: in its source's own calls, or
        (``call``, a local file's) in read calls of at most ``call`` bytes."""
        source = self._files[file_index]
        if call is not None:
            source.read_into(view, offset, max_call=call)  # one pass through its lock
        else:
            source.read_into(view, offset)

    def fill_slot(self, job: ReadJob, slot: memoryview) -> None:
        """Read ``job`` into a staging slot (``slot`` is ``job.nbytes`` long), in the
        file's native byte order, and check it: buffered reads piece by piece as they
        land (a slot is bigger than the CPU's cache), ``O_DIRECT`` reads once the slot is
        full. Runs on a transfer thread, before the slot's copy is queued."""
        if self._pieces is not None and not self._direct[job.file_index]:
            self._check_pieces(job, slot, read=True)
            return
        self._read_into(job, slot)
        if self._swap is not None:
            self._swap(job, slot)
            if self._file_check is not None:
                self._file_check(job)
        if self._pieces is not None:
            self._check_pieces(job, slot, read=False)


class HostReads:
    """The host jobs of one load, read by the load's reader threads (``threads``), each
    job by ``reader``; ``check_threads`` check the files checked apart.

    ``start`` hands every job to the threads at once; ``finish`` waits for them on the
    loop; ``abandon`` stops and waits for them, for a load that fails before ``finish``.
    """

    def __init__(
        self,
        reader: Reader,
        *,
        clock: Callable[[], float],
        threads: LoadThreads,
        check_threads: LoadThreads,
    ) -> None:
        self._reader = reader
        self._clock = clock
        self._threads = threads
        self._check_threads = check_threads
        # What ``start`` started, for ``finish`` (and ``abandon``) to wait for.
        self._calls: list[Call[None]] = []
        self._feeds: list[_Feed] = []
        self._landed: Callable[[ReadJob], None] | None = None
        # Files checked apart: their landed jobs, on the way to the check threads.
        self._to_check: dict[
            int, tuple[MemoryObjectSendStream[ReadJob], MemoryObjectReceiveStream[ReadJob]]
        ] = {}
        self._waited = False

    def start(
        self,
        jobs: Sequence[Sequence[ReadJob]],
        disks: Disks,
        *,
        verify: Sequence[Callable[[], None] | None],
        landed: Callable[[ReadJob], None],
    ) -> None:
        """Hand every host job (``jobs``, per file) to the reader threads and return:
        the reads start at once, while the loop goes on setting up the rest of the load;
        ``finish`` waits for them.

        Each disk allows ``disks.readers`` at once: that many threads each read the
        disk's files in order, taking a file's next job as soon as they are done with
        the last, with no loop round trip between jobs. ``landed(job)`` runs on the
        loop's thread once the job's bytes are there (and checked, for checks apart): a
        callback, not a stream with a task of its own, as it is a step of every job.
        ``verify[i]`` runs on the thread that leaves file ``i`` last, after every job of
        it was read (the check that the file did not change meanwhile: no extra trip
        through the loop for it).
        """
        assert self._landed is None, "host reads start once"
        self._landed = landed
        by_disk: dict[str, list[int]] = {}
        for file_index, disk in enumerate(disks.names):
            by_disk.setdefault(disk, []).append(file_index)
        for file_indices in by_disk.values():
            readers = disks.readers[file_indices[0]]
            feeds: list[tuple[_Feed, Callable[[], None] | None]] = []
            for i in file_indices:
                feed = _Feed(jobs[i], readers)
                self._feeds.append(feed)
                feeds.append((feed, verify[i]))
                if self._reader.checks_apart(i):
                    # Checked on the check threads while the readers go on: the landed
                    # jobs wait for them in a stream with room for all, so no reader
                    # waits.
                    self._to_check[i] = anyio.create_memory_object_stream(max(len(jobs[i]), 1))
            for _ in range(readers):
                self._calls.append(self._threads.submit(self._serve_disk, feeds))

    async def finish(self) -> None:
        """Wait for every read ``start`` started and for the checks apart: every job has
        been handed to ``landed`` when it returns. A failure or cancellation stops the
        reads (each thread ends after the job it is reading) and still waits for them:
        they write into the load's memory."""
        assert self._landed is not None, "finish() before start()"
        if not self._to_check:
            await self._wait_reads()
            return
        async with anyio.create_task_group() as tg:
            for _, to_check in self._to_check.values():
                async with to_check:
                    for _ in range(self._check_threads.count):
                        tg.start_soon(self._check_apart, to_check.clone())
            try:
                await self._wait_reads()
            finally:
                for out, _ in self._to_check.values():
                    out.close()  # the check tasks end once they have checked the rest

    def _serve_disk(self, feeds: Sequence[tuple[_Feed, Callable[[], None] | None]]) -> None:
        """Blocking, one reader thread of a disk: read the jobs of each of its files in
        turn; the last reader to leave a file's feed runs the file's ``verify``. A
        failure stops every feed of the load: the other readers end after their job."""
        try:
            for feed, verify in feeds:
                self._serve_feed(feed, verify)
        except BaseException:
            self.stop()
            raise

    def _serve_feed(self, feed: _Feed, verify: Callable[[], None] | None) -> None:
        reader, clock = self._reader, self._clock
        run: list[collections.deque[ReadJob]] = []
        try:
            while (job := feed.get(run)) is not None:
                start = clock()
                reader.read(job)
                self._threads.call_soon(self._on_landed, job, start, clock(), lazy=True)
        finally:
            last = feed.leave()
        if last and verify is not None and not feed.stopped:
            verify()

    def _on_landed(self, job: ReadJob, start: float, end: float) -> None:
        """On the loop's thread, scheduled by a reader (what it raises fails that
        reader's call)."""
        self._reader.count(job, start, end)
        apart = self._to_check.get(job.file_index)
        if apart is None:
            assert self._landed is not None
            self._landed(job)
            return
        # The stream has room for every job of the file; it is broken only once the load
        # is failing anyway.
        with contextlib.suppress(anyio.BrokenResourceError):
            apart[0].send_nowait(job)

    def stop(self) -> None:
        """From any thread: every reader ends after the job it is reading."""
        for feed in self._feeds:
            feed.stop()

    def _halt(self) -> None:
        """On the loop's thread, when the load is cancelled or has failed: ``stop``, and
        every reader leaves the job it is reading at its next piece
        (``raise_if_stopped``). Not for a reader's own failure (``stop``): the other
        readers' calls would then fail with ``Stopped`` before its error is seen."""
        self.stop()
        for call in self._calls:
            call.stopped = True

    async def _wait_reads(self) -> None:
        try:
            for call in self._calls:
                await self._threads.wait(call, on_cancel=self._halt)
        except BaseException:
            await self._stop_and_wait()
            raise
        self._waited = True
        self._calls = []  # each holds a bound method of this object: a reference cycle

    async def abandon(self) -> None:
        """Stop the reads ``start`` started and wait for them, unless ``finish`` already
        has (for a load that fails before it gets there), and close the streams. Raises
        nothing of theirs."""
        await self._stop_and_wait()
        # Whoever did not get to close them: the load ended before its streaming half.
        for send, receive in self._to_check.values():
            send.close()
            receive.close()

    async def _stop_and_wait(self) -> None:
        if self._waited:
            return
        self._waited = True
        self._halt()
        with anyio.CancelScope(shield=True):
            for call in self._calls:
                with contextlib.suppress(Exception):
                    await self._threads.wait(call)
        self._calls = []

    async def _check_apart(self, jobs: MemoryObjectReceiveStream[ReadJob]) -> None:
        """One check task of a file whose reads are checked apart (``O_DIRECT`` reads)."""
        assert self._landed is not None
        async with jobs:
            async for job in jobs:
                await self._check_threads.run_sync(self._reader.check_landed, job)
                self._landed(job)


class _Feed:
    """One file's jobs for its ``readers`` threads, all handed out at once, in runs: the
    consecutive jobs whose pages one ``BACK_BYTES`` unit of their image holds (its
    backing: ``HostImage.back``). A reader takes a whole run, job by job, before it
    takes the next: it backs each unit once, at its first job, and reads the rest into
    pages already backed, while another reader backs and reads another unit. (Handed
    out one job at a time, two readers would meet in every unit: one backing it while
    the other reads into it, faulting its pages in one by one, the two contending for
    them.)
    Once no run is left, a reader takes the last job of the longest run still being
    read, so that no reader idles while another has jobs queued. ``stop`` ends every
    reader after the job it is reading (cancellation, a failed reader)."""

    def __init__(self, jobs: Sequence[ReadJob], readers: int) -> None:
        runs: list[collections.deque[ReadJob]] = []
        last: tuple[int, int] | None = None
        for job in jobs:
            unit = (job.buffer_index, job.buffer_offset // BACK_BYTES)
            if unit != last:
                runs.append(collections.deque())
                last = unit
            runs[-1].append(job)
        self._runs = runs
        self._next_run = 0
        # The runs readers have taken, to take from the end of once none is left.
        self._taken: list[collections.deque[ReadJob]] = []
        self._readers = readers
        self._left = 0
        self._lock = threading.Lock()
        self.stopped = False

    def get(self, run: list[collections.deque[ReadJob]]) -> ReadJob | None:
        """The calling reader's next job (``run``: the reader's own holder of the run it
        reads, empty at first), or None once there is none or the feed stopped."""
        with self._lock:
            if self.stopped:
                return None
            if run and run[0]:
                return run[0].popleft()
            if self._next_run < len(self._runs):
                taken = self._runs[self._next_run]
                self._next_run += 1
                self._taken.append(taken)
                run[:] = [taken]
                return taken.popleft()
            longest = max(self._taken, key=len, default=None)
            return longest.pop() if longest else None

    def stop(self) -> None:
        """From any thread: every reader ends after its job."""
        self.stopped = True

    def leave(self) -> bool:
        """A reader is done with the feed: whether it is the last of them."""
        with self._lock:
            self._left += 1
            return self._left == self._readers
