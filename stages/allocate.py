"""The allocate stage: lay out one buffer per planned group and hand out read jobs.

Each planned buffer becomes an image of the file ranges it holds (design §2.1). Host
buffers are page-aligned anonymous memory (``none``, ``direct``) or mappings of exactly
the group's ranges (``mmap``, ``mlock``); device buffers come from the device backend.
Work is emitted in load order: device-bound buffers first, ranges holding the biggest
tensors first; host buffers after, in file order (sequential reads are the fastest).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from aiogguf.images import HostImage, MappedImage
from aiogguf.io.buffers import PAGE_BYTES, HostBuffer
from aiogguf.io.files import DataFile, align_down, align_up
from aiogguf.io.mapping import FileMapping
from aiogguf.jobs import BufferLayout, RangeSlot, ReadJob, TensorSlot
from aiogguf.records import Plan, WeightIndex

__all__ = [
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
