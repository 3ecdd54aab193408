"""Images: the allocated buffers of a load, each the image of the file ranges it holds.

A host image is page-aligned anonymous memory (modes ``none``/``direct``) or mappings of
exactly its file ranges (``mmap``/``mlock``); a device image is device memory that the
upload stage copies into. The allocate stage makes them; the load's ``LoadResources``
owns them (the stages see them read-only) until the model takes them.

``tensor_chunks`` reads a tensor's bytes back from wherever they landed, in bounded
pieces (the integrity checks, once the reads are done).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterator, Sequence
from typing import Final

from aiogguf._jobs import BufferLayout, ReadJob, TensorSlot
from aiogguf.io._devices.base import DeviceBuffer
from aiogguf.io.buffers import HostBuffer
from aiogguf.io.mapping import FileMapping
from aiogguf.io.source import ByteSource
from aiogguf.io.workers import raise_if_stopped

__all__ = [
    "BACK_BYTES",
    "CHUNK_BYTES",
    "DeviceImage",
    "HostImage",
    "Image",
    "MappedImage",
    "tensor_chunks",
]

# ``tensor_chunks`` hands a tensor's bytes over in pieces this big: each stays in the
# CPU's cache between its copy (from a device or the file) and its use.
CHUNK_BYTES: Final = 1 << 20
# ``HostImage.back`` backs an image's pages this many at a time: each call lets the GIL
# go, and getting it back beside a server's busy thread waits up to a switch interval,
# so one call per 256 MiB rather than per job (docs/performance.md, the convoy).
BACK_BYTES: Final = 256 << 20


class HostImage:
    """A planned host buffer in page-aligned anonymous memory (modes ``none``/``direct``)."""

    host = True

    def __init__(self, layout: BufferLayout, buffer: HostBuffer) -> None:
        self.layout = layout
        self.buffer = buffer
        self._claimed: set[int] = set()  # ``BACK_BYTES`` units backed or being backed
        self._backed: set[int] = set()  # of those, the ones whose backing has returned
        self._claim_lock = threading.Lock()

    def dest(self, job: ReadJob) -> memoryview:
        """Where ``job``'s bytes land."""
        return self.buffer.memoryview[job.buffer_offset : job.buffer_offset + job.nbytes]

    def back(self, job: ReadJob) -> bool:
        """Back the pages under ``job`` with memory before its read lands there
        (``HostBuffer.populate``), a ``BACK_BYTES`` unit of the image at a time: the
        first job to reach a unit backs all of it. Whether every page under ``job`` is
        backed now: not when another reader is still backing one of its units, and then
        the job's read faults in the pages it lands on (the caller reads in short calls:
        ``Reader``)."""
        first = job.buffer_offset // BACK_BYTES
        last = (job.buffer_offset + max(job.nbytes, 1) - 1) // BACK_BYTES
        with self._claim_lock:
            mine = [unit for unit in range(first, last + 1) if unit not in self._claimed]
            self._claimed.update(mine)
            busy = any(
                unit not in mine and unit not in self._backed for unit in range(first, last + 1)
            )
        for unit in mine:
            raise_if_stopped()
            self.buffer.populate(unit * BACK_BYTES, (unit + 1) * BACK_BYTES)
            self._backed.add(unit)  # atomic, as is every set add
        return not busy

    def tensor_bytes(self, slot: TensorSlot) -> memoryview:
        """A tensor's bytes: a view of the buffer at its offset."""
        return self.buffer.memoryview[slot.buffer_offset : slot.buffer_offset + slot.nbytes]

    def close(self) -> None:
        """Free the buffer."""
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
        """The mapping whose range holds ``file_offset`` of file ``file_index``."""
        entries = self._starts[file_index]
        i = bisect.bisect_right(entries, file_offset, key=lambda e: e[0]) - 1
        return entries[i][1]

    def tensor_bytes(self, slot: TensorSlot) -> memoryview:
        """A tensor's bytes: a view of the mapping that holds them."""
        mapping = self.mapping_at(slot.file_index, slot.file_offset)
        return mapping.view(slot.file_offset, slot.nbytes)

    def close(self) -> None:
        """Unmap every mapping."""
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


def tensor_chunks(
    slot: TensorSlot | None,
    images: Sequence[Image | None],
    file: ByteSource,
    offset: int,
    nbytes: int,
) -> Iterator[memoryview]:
    """Blocking: a tensor's landed bytes, in order, in pieces of ``CHUNK_BYTES`` at most:
    views of its host image; copies back from its device; else (mapped, or ``slot``
    None: not loaded, or its bytes landed swapped) its ``nbytes`` read from ``file`` at
    ``offset``, never through a mapping (a file cut short during the load would kill the
    process: ``stages.validate.FileBytes``). A piece read from the file is valid until
    the next is asked for. Raises ``LoadError`` if the file ends early or a read fails;
    stops between pieces when the load is stopped (``raise_if_stopped``)."""
    image = images[slot.buffer_index] if slot is not None else None
    if slot is not None and isinstance(image, HostImage):
        data = image.tensor_bytes(slot)
        for lo in range(0, len(data), CHUNK_BYTES):
            raise_if_stopped()
            yield data[lo : lo + CHUNK_BYTES]
        return
    if slot is not None and isinstance(image, DeviceImage):
        for lo in range(0, slot.nbytes, CHUNK_BYTES):
            raise_if_stopped()
            n = min(CHUNK_BYTES, slot.nbytes - lo)
            yield memoryview(image.buffer.to_host(slot.buffer_offset + lo, n))
        return
    scratch = memoryview(bytearray(min(CHUNK_BYTES, nbytes)))
    for lo in range(0, nbytes, CHUNK_BYTES):
        raise_if_stopped()
        part = scratch[: min(CHUNK_BYTES, nbytes - lo)]
        file.read_into(part, offset + lo)
        yield part
