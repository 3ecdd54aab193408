"""The simulated device's memory: freed blocks kept for later allocations, as CuPy's
memory pool keeps them (``SimMemoryCache``), and how new memory is backed (``_back``)."""

from __future__ import annotations

import contextlib
import mmap
import threading
import time
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy

from aiogguf.errors import LoadError
from aiogguf.io import _libc
from aiogguf.io.buffers import PAGE_BYTES, back_pages

__all__ = ["BackedBlock", "SimMemoryCache", "SimMemoryStats"]

# A block of host memory that stands in for device memory.
BackedBlock: TypeAlias = "numpy.ndarray[Any, numpy.dtype[numpy.uint8]]"


@dataclass(frozen=True, slots=True)
class SimMemoryStats:
    """What a simulated device's memory cache holds now, and what it did so far."""

    cached_blocks: int  # idle allocations kept for reuse
    cached_bytes: int
    backed: int  # allocations that needed new memory
    backed_bytes: int
    backed_s: float  # time spent backing new memory (on the allocating threads)
    reused: int  # allocations served from the cache


class SimMemoryCache:
    """The freed device memory of one simulated device, kept for later allocations, as
    CuPy's memory pool keeps freed blocks.

    ``take`` hands out the smallest idle block that holds the request and is at most
    twice its size (a big block is not spent on a small request); otherwise it backs
    new memory on the calling thread, outside the lock (``_back``). ``give_back`` keeps
    a block while the idle bytes stay within ``cap_bytes``, dropping the oldest idle
    blocks to make room; a block larger than the cap is dropped. ``release`` drops every
    idle block. Thread-safe.
    """

    def __init__(self, device: str, cap_bytes: int) -> None:
        if cap_bytes < 0:
            raise ValueError(f"device {device}: memory cache cap must be >= 0, got {cap_bytes}")
        self.device = device
        self.cap_bytes = cap_bytes
        # Reentrant: give_back runs from a finalizer, which a garbage collection can
        # start on a thread that already holds the lock.
        self._lock = threading.RLock()
        self._idle: list[BackedBlock] = []  # oldest first
        self._backed = 0
        self._backed_bytes = 0
        self._backed_s = 0.0
        self._reused = 0

    def take(self, nbytes: int) -> BackedBlock:
        """A backed block of at least ``nbytes``. Raises ``LoadError`` when the host
        cannot allocate the memory."""
        with self._lock:
            fitting = [
                i for i, b in enumerate(self._idle) if nbytes <= b.size <= max(2 * nbytes, 1)
            ]
            if fitting:
                # By position: ``list.remove`` would compare the arrays element by element.
                best = self._idle.pop(min(fitting, key=lambda i: self._idle[i].size))
                self._reused += 1
                return best
        began = time.perf_counter()
        try:
            block = _back(max(nbytes, 1))
        except MemoryError as exc:
            raise LoadError(
                None, None, f"device {self.device}: cannot back {nbytes} bytes: {exc}"
            ) from exc
        with self._lock:
            self._backed += 1
            self._backed_bytes += block.size
            self._backed_s += time.perf_counter() - began
        return block

    def give_back(self, block: BackedBlock) -> None:
        """Keep ``block`` for a later ``take`` (nothing may view it any more)."""
        with self._lock:
            if block.size > self.cap_bytes:
                return
            held = sum(b.size for b in self._idle)
            while self._idle and held + block.size > self.cap_bytes:
                held -= self._idle.pop(0).size
            self._idle.append(block)

    def release(self) -> int:
        """Drop every idle block (its memory goes back to the OS); the bytes freed."""
        with self._lock:
            freed = sum(b.size for b in self._idle)
            self._idle.clear()
        return freed

    def stats(self) -> SimMemoryStats:
        with self._lock:
            return SimMemoryStats(
                cached_blocks=len(self._idle),
                cached_bytes=sum(b.size for b in self._idle),
                backed=self._backed,
                backed_bytes=self._backed_bytes,
                backed_s=self._backed_s,
                reused=self._reused,
            )


def _back(nbytes: int) -> BackedBlock:
    """``nbytes`` of host memory with every page backed, so that no copy into it faults.

    One ``MADV_POPULATE_WRITE`` call backs them all, the GIL let go. Transparent huge
    pages are refused first (numpy asks for them): on a VM, how long backing them takes
    swings several-fold from one process to the next, and the sim would then measure
    that swing instead of the offload. The memory is a numpy allocation, not an
    ``mmap`` of the loader's own (``HostBuffer``): it stands in for device memory, not
    for the load's host memory."""
    block = numpy.empty(nbytes, dtype=numpy.uint8)
    address = block.ctypes.data
    start = -(-address // PAGE_BYTES) * PAGE_BYTES
    end = (address + nbytes) // PAGE_BYTES * PAGE_BYTES
    if end > start:
        with contextlib.suppress(OSError):  # a hint: backing goes on without it
            _libc.madvise(start, end - start, mmap.MADV_NOHUGEPAGE)
        back_pages(block[start - address : end - address])
    return block
