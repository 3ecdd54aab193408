"""The allocate stage: lay out one buffer per planned group and hand out read jobs.

Each planned buffer becomes an image of the file ranges it holds (design §2.1). Host
buffers are page-aligned anonymous memory (``none``, ``direct``) or mappings of exactly
the group's ranges (``mmap``, ``mlock``); device buffers come from the device backend.
Work is emitted in load order: device-bound buffers first, ranges holding the biggest
tensors first; host buffers after, in file order (sequential reads are the fastest).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence

from aiogguf.io.buffers import PAGE_BYTES, HostBuffer
from aiogguf.io.devices.base import DeviceBuffer
from aiogguf.io.files import DataFile, align_down, align_up
from aiogguf.io.mapping import FileMapping
from aiogguf.jobs import BufferLayout, RangeSlot, ReadJob, TensorSlot
from aiogguf.records import Plan, WeightIndex

__all__ = [
    "DeviceImage",
    "HostImage",
    "Image",
    "MappedImage",
    "allocate_host",
    "allocate_mapped",
    "layout_buffers",
    "load_order",
    "read_jobs",
    "tensor_slots",
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


# --- images: the allocated buffers -------------------------------------------------------


class HostImage:
    """A planned host buffer in page-aligned anonymous memory (modes ``none``/``direct``)."""

    host = True

    def __init__(self, layout: BufferLayout, buffer: HostBuffer) -> None:
        self.layout = layout
        self.buffer = buffer

    def dest(self, job: ReadJob) -> memoryview:
        """Where ``job``'s bytes land."""
        return self.buffer.memoryview[job.buffer_offset : job.buffer_offset + job.nbytes]

    def prefault(self, job: ReadJob) -> None:
        """Blocking: back ``job``'s destination with memory before the read comes."""
        self.buffer.prefault(job.buffer_offset, job.buffer_offset + job.nbytes)

    def tensor_bytes(self, slot: TensorSlot) -> memoryview:
        return self.buffer.memoryview[slot.buffer_offset : slot.buffer_offset + slot.nbytes]

    def close(self) -> None:
        self.buffer.close()


class MappedImage:
    """A planned host buffer made of mappings of exactly the group's file ranges
    (modes ``mmap``/``mlock``): the page cache is the buffer, nothing is copied."""

    host = True

    def __init__(self, layout: BufferLayout, mappings: Sequence[FileMapping]) -> None:
        self.layout = layout
        self.mappings = tuple(mappings)
        # (file, range start) → mapping, for finding a tensor's mapping by its offset.
        self._starts: dict[int, list[tuple[int, FileMapping]]] = {}
        for rs, mapping in zip(layout.slots, self.mappings, strict=True):
            self._starts.setdefault(rs.range.file_index, []).append((rs.range.start, mapping))
        for entries in self._starts.values():
            entries.sort(key=lambda e: e[0])

    def mapping_at(self, file_index: int, file_offset: int) -> FileMapping:
        entries = self._starts[file_index]
        i = bisect.bisect_right(entries, file_offset, key=lambda e: e[0]) - 1
        return entries[i][1]

    def tensor_bytes(self, slot: TensorSlot) -> memoryview:
        mapping = self.mapping_at(slot.file_index, slot.file_offset)
        return mapping.view(slot.file_offset, slot.nbytes)

    def close(self) -> None:
        for mapping in self.mappings:
            mapping.close()


class DeviceImage:
    """A planned buffer in device memory; bytes arrive through the upload stage."""

    host = False

    def __init__(self, layout: BufferLayout, buffer: DeviceBuffer) -> None:
        self.layout = layout
        self.buffer = buffer

    def close(self) -> None:
        self.buffer.close()


Image = HostImage | MappedImage | DeviceImage


def allocate_host(layout: BufferLayout, alignment: int = PAGE_BYTES) -> HostImage:
    """Blocking: memory for a whole buffer image, aligned to a page and to ``alignment``
    (``O_DIRECT`` reads land in it)."""
    return HostImage(layout, HostBuffer(max(layout.nbytes, 1), alignment=alignment))


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
            r = rs.range
            mapping = FileMapping(files[r.file_index], r.start, r.end, writable=writable)
            mappings.append(mapping)
    except BaseException:
        for mapping in mappings:
            mapping.close()
        raise
    return MappedImage(layout, mappings)
