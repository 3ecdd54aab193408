"""Records of the streaming half of a load: allocate → read → upload → validate.

A destination buffer is an *image of the file ranges it holds* (design §2.1): every
tensor sits at a fixed offset from the start of its range's slot, so one read of any
size, spanning many tensors, lands every byte in its final place.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiogguf.records import BufferPlan, FileRange

__all__ = ["BufferLayout", "RangeSlot", "ReadJob", "TensorSlot"]


@dataclass(frozen=True, slots=True)
class TensorSlot:
    """Where one tensor's bytes sit in its buffer image."""

    name: str
    buffer_index: int
    buffer_offset: int
    nbytes: int
    file_index: int
    file_offset: int


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
