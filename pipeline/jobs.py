"""Records of the streaming half of a load: allocate → read → upload → validate.

A destination buffer is an *image of the file ranges it holds* (design §2.1): every
tensor sits at a fixed offset from the start of its range's slot, so one read of any
size, spanning many tensors, lands every byte in its final place.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from aiogguf.fastinit import fast_init
from aiogguf.records import BufferPlan, FileRange

__all__ = ["BufferLayout", "RangeSlot", "ReadJob", "StageMeter", "StageTimes", "TensorSlot"]


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
        with self._lock:
            start = self._start if self._start is not None else 0.0
            return StageTimes(start, max(self._end, start), self._busy_s, self._items, self._nbytes)
