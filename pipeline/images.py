"""Images: the allocated buffers of a load, each the image of the file ranges it holds.

A host image is page-aligned anonymous memory (modes ``none``/``direct``) or mappings of
exactly its file ranges (``mmap``/``mlock``); a device image is device memory that the
upload stage copies into. The allocate stage makes them; the load's ``LoadResources``
owns them (the stages see them read-only) until the model takes them.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from aiogguf.io.buffers import HostBuffer
from aiogguf.io.devices.base import DeviceBuffer
from aiogguf.io.mapping import FileMapping
from aiogguf.jobs import BufferLayout, ReadJob, TensorSlot

__all__ = ["DeviceImage", "HostImage", "Image", "MappedImage"]


class HostImage:
    """A planned host buffer in page-aligned anonymous memory (modes ``none``/``direct``)."""

    host = True

    def __init__(self, layout: BufferLayout, buffer: HostBuffer) -> None:
        self.layout = layout
        self.buffer = buffer

    def dest(self, job: ReadJob) -> memoryview:
        """Where ``job``'s bytes land."""
        return self.buffer.memoryview[job.buffer_offset : job.buffer_offset + job.nbytes]

    def back(self, job: ReadJob) -> None:
        """Back ``job``'s pages with memory in one call, before its read lands there
        (``HostBuffer.populate``)."""
        self.buffer.populate(job.buffer_offset, job.buffer_offset + job.nbytes)

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
        self.mappings: tuple[FileMapping, ...] = tuple(mappings)
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
