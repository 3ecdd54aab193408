"""The allocate stage: lay out one buffer per planned group and hand out read jobs.

Each planned buffer becomes an image of the file ranges it holds (design §2.1). Host
buffers are page-aligned anonymous memory (``none``, ``direct``) or mappings of exactly
the group's ranges (``mmap``, ``mlock``), allocated in one blocking call with the plan
(``allocate_host_images``); device buffers come from the device backend (``Allocation``).
Work is emitted in load order: device-bound ranges first, those holding the biggest
tensors first; host ranges after, in file order (sequential reads are the fastest).
The stage also owns the advice its mappings get (``advise``); in mode ``mlock`` the read
stage locks them as it makes them resident.
"""

from __future__ import annotations

import bisect
from collections.abc import Awaitable, Callable, Iterator, Sequence

import anyio

from aiogguf.config import HugePages
from aiogguf.images import DeviceImage, HostImage, Image, MappedImage
from aiogguf.io.buffers import HUGE_PAGE_BYTES, PAGE_BYTES, HostBuffer, huge_pages_pay
from aiogguf.io.devices.base import DeviceBuffer
from aiogguf.io.files import DataFile, align_down, align_up
from aiogguf.io.mapping import FileMapping, MapAdvice, numa_nodes
from aiogguf.io.workers import raise_if_stopped
from aiogguf.jobs import BufferLayout, RangeSlot, ReadJob, StageMeter, StageTimes, TensorSlot
from aiogguf.records import Plan, WeightIndex

__all__ = [
    "Allocation",
    "TensorSpans",
    "advise",
    "allocate_host",
    "allocate_host_images",
    "allocate_mapped",
    "close_images",
    "job_bytes",
    "layout_buffers",
    "load_order",
    "read_jobs",
    "split_jobs",
    "tensor_slots",
    "wants_huge_pages",
]


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
) -> Iterator[ReadJob]:
    """Split every range into reads of at most ``chunk_bytes``.

    ``aligned`` reads cover the widened slot (O_DIRECT needs aligned offsets and
    lengths); unaligned reads cover exactly the range's bytes.
    """
    seq = 0
    for layout, rs in ordered:
        r = rs.range
        start, end = (rs.file_start, rs.file_end) if aligned else (r.start, r.end)
        offset = start
        while offset < end:
            raise_if_stopped()  # once per job (a model of hundreds of GiB has 10^4)
            n = min(chunk_bytes, end - offset)
            yield ReadJob(
                seq=seq,
                buffer_index=layout.index,
                file_index=r.file_index,
                file_offset=offset,
                nbytes=n,
                buffer_offset=rs.buffer_offset_of(offset),
                useful_start=max(offset, r.start),
                useful_end=min(offset + n, r.end),
                lazy=layout.plan.lazy,
            )
            seq += 1
            offset += n


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
) -> tuple[list[list[ReadJob]], list[ReadJob]]:
    """Host jobs per file (at most ``host_bytes``: ``job_bytes``), and device jobs (at
    most ``chunk_bytes`` and ``slot_bytes``: each fills one staging slot), each in load
    order. Lazy ranges are only mapped, never read."""
    ordered = [item for item in load_order(index, layouts) if not item[0].plan.lazy]
    staged = [item for item in ordered if not item[0].plan.host]
    hosted = [item for item in ordered if item[0].plan.host]
    device_jobs: list[ReadJob] = []
    if staged:
        assert slot_bytes is not None, "device buffers need a staging slot size"
        device_jobs = list(read_jobs(staged, min(chunk_bytes, slot_bytes), aligned=aligned))
    per_file: list[list[ReadJob]] = [[] for _ in index.files]
    for job in read_jobs(hosted, host_bytes, aligned=aligned):
        per_file[job.file_index].append(job)
    return per_file, device_jobs


# Smaller images stay in 4 KiB pages: the faults huge pages save them are few, and the
# image's last huge page, rounded up, is a larger share of it.
HUGE_IMAGE_MIN_BYTES = 16 * HUGE_PAGE_BYTES


def wants_huge_pages(setting: HugePages, nbytes: int) -> bool:
    """Whether a host image of ``nbytes`` asks for huge pages under ``huge_pages =
    setting`` (``"auto"``, ``"on"``, ``"off"``; the kernel may still give 4 KiB
    pages)."""
    if setting == "off" or nbytes < HUGE_IMAGE_MIN_BYTES:
        return False
    return setting == "on" or huge_pages_pay()


def allocate_host(
    layout: BufferLayout, alignment: int = PAGE_BYTES, *, huge_pages: HugePages = "off"
) -> HostImage:
    """Blocking: memory for a whole buffer image, aligned to a page and to ``alignment``
    (``O_DIRECT`` reads land in it), in huge pages where ``huge_pages`` (the config's
    setting) asks for them (``wants_huge_pages``)."""
    nbytes = max(layout.nbytes, 1)
    huge = wants_huge_pages(huge_pages, nbytes)
    return HostImage(layout, HostBuffer(nbytes, alignment=alignment, huge_pages=huge))


def allocate_mapped(
    layout: BufferLayout,
    files: Sequence[DataFile],
    *,
    writable: bool,
) -> MappedImage:
    """Blocking: map each of the group's ranges, and nothing else of the file."""
    mappings: list[FileMapping] = []
    try:
        for rs in layout.slots:
            raise_if_stopped()
            r = rs.range
            mapping = FileMapping(files[r.file_index], r.start, r.end, writable=writable)
            mappings.append(mapping)
    except BaseException:
        for mapping in mappings:
            mapping.close()
        raise
    return MappedImage(layout, mappings)


def allocate_host_images(
    layouts: Sequence[BufferLayout],
    files: Sequence[DataFile],
    into: list[Image | None],
    *,
    mapped: bool,
    writable: bool,
    alignment: int,
    prefetch: bool,
    lock: bool = False,
    huge_pages: HugePages = "off",
) -> None:
    """Blocking: every host buffer's image, put in ``into`` (indexed by buffer, as long as
    ``layouts``) as soon as it exists, so that the caller frees it if a later one fails.

    ``mapped``: host buffers are mappings of the file (else anonymous memory, aligned to
    ``alignment``); ``writable``: the bytes are swapped in place (such buffers are copies,
    but for lazy ranges); ``prefetch`` asks the kernel to read mapped ranges ahead;
    ``lock`` (mode ``mlock``): the loaded mapped ranges lock their pages as the readers
    fault them in (``lock_on_fault``); ``huge_pages``: the config's setting for anonymous
    images (``allocate_host``)."""
    into[:] = [None] * len(layouts)
    for layout in layouts:
        raise_if_stopped()
        if not layout.plan.host:
            continue
        if mapped and (layout.plan.lazy or not writable):
            # Big-endian files are copied even in the mapped modes (lazy ranges stay
            # mapped: nothing reads them during the load): swapping in place writes
            # every page of a private mapping, so a mapping would save no memory, and
            # the swap's own writes would be exposed to SIGBUS if the file were cut.
            image = allocate_mapped(layout, files, writable=writable)
            into[layout.index] = image
            advise(image, numa=numa_nodes() > 1, prefetch=prefetch)
            if lock and not layout.plan.lazy:
                lock_on_fault(image)
        else:
            into[layout.index] = allocate_host(layout, alignment, huge_pages=huge_pages)


class Allocation:
    """The images of one load: host ones allocated before it starts
    (``allocate_host_images``, with the plan), device ones by ``run``; the transfers
    into buffer ``k`` await ``ready(k)``, so they start as soon as it exists while later
    ones are still being allocated. ``images`` (indexed by buffer, shared
    with the engine, which frees what is left in it if the load fails: ``close_images``)
    holds them until ``take()``."""

    def __init__(
        self,
        layouts: Sequence[BufferLayout],
        images: list[Image | None],
        *,
        clock: Callable[[], float],
        host_times: StageTimes | None = None,
    ) -> None:
        """``images``: the host images, shared (the caller frees what is left in it if
        the load fails); ``host_times``: when they were allocated."""
        self.layouts = layouts
        self.images = images
        self._ready = {lay.index: anyio.Event() for lay in layouts if not lay.plan.host}
        self._meter = StageMeter(clock)
        if host_times is not None:
            self._meter.add(
                host_times.start_s,
                host_times.end_s,
                items=host_times.items,
                nbytes=host_times.nbytes,
            )

    async def run(self, allocate_device: Callable[[str, int], Awaitable[DeviceBuffer]]) -> None:
        """Allocate every device buffer with ``allocate_device(device, nbytes)``."""
        for layout in self.layouts:
            if layout.plan.host:
                continue
            with self._meter.span(items=1, nbytes=layout.nbytes):
                buffer = await allocate_device(layout.plan.device, max(layout.nbytes, 1))
                self.images[layout.index] = DeviceImage(layout, buffer)
            self._ready[layout.index].set()

    async def ready(self, k: int) -> Image:
        """Buffer ``k``'s image, once it exists."""
        if (event := self._ready.get(k)) is not None:
            await event.wait()
        image = self.images[k]
        assert image is not None
        return image

    def take(self) -> list[Image | None]:
        """Hand every image to the caller (the model): nothing is left to close."""
        images = list(self.images)
        self.images[:] = [None] * len(self.images)
        return images

    def times(self) -> StageTimes:
        return self._meter.times()


def close_images(images: list[Image | None]) -> None:
    """Blocking: free every image still in ``images`` (a failed load's)."""
    for i, image in enumerate(images):
        if image is not None:
            image.close()
            images[i] = None


def lock_on_fault(image: MappedImage) -> None:
    """Blocking: have each of the image's ranges lock its pages as they are faulted in
    (``mlock2(MLOCK_ONFAULT)``): the readers then populate jobs side by side, as in mode
    ``mmap``, where an ``mlock`` per job would take the process's memory map for writing
    and wait for every populate under way. Where the kernel cannot, or refuses (over
    ``RLIMIT_MEMLOCK``), nothing is locked here: the readers lock job by job, as far as
    the limit allows, and say what they could not."""
    for rs, mapping in zip(image.layout.slots, image.mappings, strict=True):
        try:
            if not mapping.lock(rs.range.start, rs.range.end, on_fault=True):
                return
        except OSError:
            return  # no mlock2 here


def advise(image: MappedImage, *, numa: bool, prefetch: bool) -> None:
    """Blocking: advise the kernel on a new mapping. Lazy ranges are read on demand
    (random); on a NUMA machine nothing is prefetched, so pages land on the node that
    first touches them."""
    random = image.layout.plan.lazy or numa
    if not random and not prefetch:
        return
    advice = MapAdvice.RANDOM if random else MapAdvice.WILLNEED
    for rs, mapping in zip(image.layout.slots, image.mappings, strict=True):
        mapping.advise(advice, rs.range.start, rs.range.end)
