"""The allocate stage: the memory of each buffer image laid out by ``aiogguf._jobs``.

Each planned buffer becomes an image of the file ranges it holds (design §2.1). Host
buffers are page-aligned anonymous memory (``none``, ``direct``) or mappings of exactly
the group's ranges (``mmap``, ``mlock``), allocated in one blocking call with the plan
(``allocate_host_images``); device buffers come from the device backend (``Allocation``).
The stage also owns the advice its mappings get (``advise``); in mode ``mlock`` the read
stage locks them as it makes them resident.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import anyio

from aiogguf._config import HugePages
from aiogguf._images import DeviceImage, HostImage, Image, MappedImage
from aiogguf._jobs import BufferLayout, StageMeter, StageTimes
from aiogguf.io._devices.base import DeviceBuffer
from aiogguf.io.buffers import HUGE_PAGE_BYTES, PAGE_BYTES, HostBuffer, huge_pages_pay
from aiogguf.io.files import DataFile
from aiogguf.io.mapping import FileMapping, MapAdvice, numa_nodes
from aiogguf.io.workers import raise_if_stopped

__all__ = [
    "Allocation",
    "advise",
    "allocate_host",
    "allocate_host_images",
    "allocate_mapped",
    "close_images",
    "wants_huge_pages",
]


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
    layout: BufferLayout,
    alignment: int = PAGE_BYTES,
    *,
    huge_pages: HugePages = "off",
    shareable: bool = False,
) -> HostImage:
    """Blocking: memory for a whole buffer image, aligned to a page and to ``alignment``
    (``O_DIRECT`` reads land in it), in huge pages where ``huge_pages`` (the config's
    setting) asks for them (``wants_huge_pages``); ``shareable``: in a memfd another
    process can map (``HostBuffer``)."""
    nbytes = max(layout.nbytes, 1)
    huge = wants_huge_pages(huge_pages, nbytes)
    buffer = HostBuffer(nbytes, alignment=alignment, huge_pages=huge, shareable=shareable)
    return HostImage(layout, buffer)


def allocate_mapped(
    layout: BufferLayout,
    files: Sequence[DataFile],
    *,
    writable: bool,
    shareable: bool = False,
) -> MappedImage:
    """Blocking: map each of the group's ranges, and nothing else of the file;
    ``shareable``: each mapping keeps a descriptor of its file, for another process to
    map it by."""
    mappings: list[FileMapping] = []
    try:
        for rs in layout.slots:
            raise_if_stopped()
            r = rs.range
            mapping = FileMapping(
                files[r.file_index], r.start, r.end, writable=writable, keep_descriptor=shareable
            )
            mappings.append(mapping)
    except BaseException:
        for mapping in mappings:
            mapping.close()
        raise
    return MappedImage(layout, mappings)


def allocate_host_images(
    layouts: Sequence[BufferLayout],
    files: Sequence[DataFile],
    place: Callable[[int, Image], None],
    *,
    mapped: bool,
    writable: bool,
    alignment: int,
    prefetch: bool,
    lock: bool = False,
    huge_pages: HugePages = "off",
    shareable: bool = False,
) -> None:
    """Blocking: every host buffer's image, handed to ``place(buffer index, image)`` as
    soon as it exists, so that its owner frees it if a later one fails.

    ``mapped``: host buffers are mappings of the file (else anonymous memory, aligned to
    ``alignment``); ``writable``: the bytes are swapped in place (such buffers are copies,
    but for lazy ranges); ``prefetch`` asks the kernel to read mapped ranges ahead;
    ``lock`` (mode ``mlock``): the loaded mapped ranges lock their pages as the readers
    fault them in (``lock_on_fault``); ``huge_pages``: the config's setting for anonymous
    images (``allocate_host``); ``shareable``: images another process can map (the
    config's ``[load] shareable``: memfds, and mappings that keep their file's
    descriptor)."""
    for layout in layouts:
        raise_if_stopped()
        if not layout.plan.host:
            continue
        if mapped and (layout.plan.lazy or not writable):
            # Big-endian files are copied even in the mapped modes (lazy ranges stay
            # mapped: nothing reads them during the load): swapping in place writes
            # every page of a private mapping, so a mapping would save no memory, and
            # the swap's own writes would be exposed to SIGBUS if the file were cut.
            image = allocate_mapped(layout, files, writable=writable, shareable=shareable)
            place(layout.index, image)
            advise(image, numa=numa_nodes() > 1, prefetch=prefetch)
            if lock and not layout.plan.lazy:
                lock_on_fault(image)
        else:
            host = allocate_host(layout, alignment, huge_pages=huge_pages, shareable=shareable)
            place(layout.index, host)


class Allocation:
    """The images of one load: host ones allocated before it starts
    (``allocate_host_images``, with the plan), device ones by ``run``, in order;
    ``ready(k)`` waits for buffer ``k``'s. The engine awaits ``ready`` for every device
    job's buffer before it hands the device jobs to the upload stage in one call, so the
    transfers start once all device buffers exist (the host reads run meanwhile). The
    images belong to their owner (the load's ``LoadResources``, which frees what is left
    if the load fails): this stage sees them read-only (``images``, indexed by buffer)
    and hands it each new one (``place``)."""

    def __init__(
        self,
        layouts: Sequence[BufferLayout],
        images: Sequence[Image | None],
        place: Callable[[int, Image], None],
        *,
        clock: Callable[[], float],
        host_times: StageTimes | None = None,
    ) -> None:
        """``images``: the load's images, the host ones there already; ``host_times``:
        when those were allocated."""
        self.layouts = layouts
        self._images = images
        self._place = place
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
                self._place(layout.index, DeviceImage(layout, buffer))
            self._ready[layout.index].set()

    async def ready(self, k: int) -> Image:
        """Buffer ``k``'s image, once it exists."""
        if (event := self._ready.get(k)) is not None:
            await event.wait()
        image = self._images[k]
        assert image is not None
        return image

    def times(self) -> StageTimes:
        """The stage's times so far."""
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
