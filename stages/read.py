"""The read stage: bring each job's file bytes to where they belong.

The unit of I/O is a coalesced file range cut into jobs of at most ``chunk_size``.
Per mode (design §1.5):

- ``none``: ``preadv`` straight into the destination buffer image;
- ``direct``: ``O_DIRECT`` reads of aligned chunks into the (page-aligned) image;
- ``mmap``/``mlock``: the mapping is the buffer; pages are touched so that "loaded"
  means resident (``mlock`` also locks them, tensor by tensor, in the engine);
- device-bound jobs: the same reads, into a staging slot: ``fill_slot`` is what the
  upload stage's transfer threads run (this stage knows nothing of devices).

Every call here blocks and runs on one of the load's threads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import anyio

from aiogguf.images import HostImage, Image, MappedImage
from aiogguf.io.files import MAX_CALL_BYTES, DataFile
from aiogguf.io.workers import LoadThreads
from aiogguf.jobs import ReadJob

__all__ = ["FileStats", "Reader"]


@dataclass(slots=True)
class FileStats:
    """Mutable per-file counters, updated on the event loop thread only."""

    nbytes: int = 0
    reads: int = 0
    busy_s: float = 0.0
    first_start: float | None = None
    last_end: float = 0.0


class Reader:
    """Executes read jobs for one load. ``swap`` (big-endian files) converts the bytes of
    a landed job in place before anyone else sees them; ``shared`` bounds the reads in
    flight across every load that shares it; ``check(job, file_offset, piece)`` validates
    each piece of a host buffer as soon as it has landed: buffered reads on the reader's
    own thread, while the piece is still in the CPU's cache; ``O_DIRECT`` reads (which
    land by DMA, not through the cache) on ``check_threads`` after the read has given
    back its slot, so that the disk gets its next read while the last one is checked."""

    def __init__(
        self,
        files: Sequence[DataFile],
        images: Sequence[Image | None],
        limiters: Sequence[anyio.CapacityLimiter],
        *,
        direct: Sequence[bool],
        clock: Callable[[], float],
        swap: Callable[[ReadJob, memoryview], None] | None = None,
        shared: anyio.CapacityLimiter | None = None,
        check: Callable[[ReadJob, int, memoryview], None] | None = None,
        threads: LoadThreads,
        check_threads: LoadThreads,
    ) -> None:
        self._files = files
        self._images = images
        self._limiters = limiters
        self._direct = direct
        self._clock = clock
        self._swap = swap
        self._shared = shared
        self._check = check
        self._threads = threads
        self._check_threads = check_threads
        self.stats = [FileStats() for _ in files]

    @property
    def direct(self) -> Sequence[bool]:
        """Per file: whether reads really bypass the page cache."""
        return self._direct

    async def read(self, job: ReadJob) -> None:
        """Land ``job`` in its host buffer; returns when its bytes are there."""
        if self._shared is None:
            await self._read(job)
        else:
            # Loads running side by side (a server) share one budget of reads in flight.
            async with self._shared:
                await self._read(job)

    async def _read(self, job: ReadJob) -> None:
        image = self._images[job.buffer_index]
        assert isinstance(image, HostImage | MappedImage)
        start = self._clock()
        async with self._limiters[job.file_index]:
            await self._threads.run_sync(self._host_read, job, image)
        if self.checks_apart(job.file_index) and isinstance(image, HostImage):
            await self._check_threads.run_sync(self.check_landed, job, image.dest(job))
        self.count(job, start, self._clock())

    def count(self, job: ReadJob, start: float, end: float) -> None:
        """Add a landed job to its file's counters (on the loop's thread)."""
        stats = self.stats[job.file_index]
        stats.nbytes += job.useful_end - job.useful_start
        stats.reads += 1
        stats.busy_s += end - start
        stats.first_start = start if stats.first_start is None else min(stats.first_start, start)
        stats.last_end = max(stats.last_end, end)

    def _host_read(self, job: ReadJob, image: HostImage | MappedImage) -> None:
        if isinstance(image, MappedImage):
            mapping = image.mapping_at(job.file_index, job.useful_start)
            mapping.touch(job.useful_start, job.useful_end)
            if self._swap is not None:
                self._swap(job, mapping.view(job.file_offset, job.nbytes))
            return
        dest = image.dest(job)
        if self._check is not None and not self._direct[job.file_index]:
            # Piece by piece: each piece is checked right after it lands, still hot.
            useful = dest[job.useful_start - job.file_offset : job.useful_end - job.file_offset]
            for lo in range(0, len(useful), MAX_CALL_BYTES):
                piece = useful[lo : lo + MAX_CALL_BYTES]
                self._files[job.file_index].read_into(piece, job.useful_start + lo)
                self._check(job, job.useful_start + lo, piece)
            return
        self._read_into(job, dest)
        if self._swap is not None:
            self._swap(job, dest)
        if self._check is not None and not self.checks_apart(job.file_index):
            self.check_landed(job, dest)

    def checks_apart(self, file_index: int) -> bool:
        """Whether the file's jobs are checked on the check threads, after the read."""
        return self._check is not None and self._direct[file_index]

    def check_landed(self, job: ReadJob, dest: memoryview) -> None:
        """Check a landed job (``dest`` holds its ``nbytes`` from ``job.file_offset``) in
        pieces: bounded scratch, and each piece still in the CPU cache."""
        assert self._check is not None
        useful = dest[job.useful_start - job.file_offset : job.useful_end - job.file_offset]
        for lo in range(0, len(useful), MAX_CALL_BYTES):
            self._check(job, job.useful_start + lo, useful[lo : lo + MAX_CALL_BYTES])

    def _read_into(self, job: ReadJob, dest: memoryview) -> None:
        file = self._files[job.file_index]
        if self._direct[job.file_index]:
            file.read_direct_into(dest, job.file_offset, job.nbytes, need_end=job.useful_end)
        else:
            # Only the useful bytes: in a direct load whose file fell back to buffered
            # reads the job still spans the aligned slot, which may pass the file's end.
            lo, hi = job.useful_start - job.file_offset, job.useful_end - job.file_offset
            file.read_into(dest[lo:hi], job.useful_start)

    def fill_slot(self, job: ReadJob, slot: memoryview) -> None:
        """Read ``job`` into a staging slot (``slot`` is ``job.nbytes`` long), in the
        file's native byte order. Runs on a transfer thread."""
        self._read_into(job, slot)
        if self._swap is not None:
            self._swap(job, slot)
