"""Page-cache residency: how much of a file is in RAM (``mincore``), and dropping it.

Used by benchmarks (cold-cache runs) and tests (proof that ``O_DIRECT`` bypasses the
cache, that ``touch`` makes a range resident). Each call works through the file in
bounded windows (``WINDOW_BYTES`` of address space mapped at a time), never mapping
a whole multi-GiB model at once.

On filesystems whose pages cannot leave memory (tmpfs, ramfs) every byte is always
resident and ``drop_from_cache`` returns False.

Every ``OSError`` leaves this module as ``LoadError(path, offset, problem)``.
"""

from __future__ import annotations

import mmap
import os

import numpy as np

from aiogguf.errors import os_errors
from aiogguf.io import _libc
from aiogguf.io.buffers import PAGE_BYTES, buffer_address
from aiogguf.io.files import align_down, align_up

__all__ = ["WINDOW_BYTES", "drop_from_cache", "fadvise_dontneed", "resident_bytes"]

WINDOW_BYTES = 1 << 30


def fadvise_dontneed(target: str | os.PathLike[str] | int, start: int = 0, length: int = 0) -> None:
    """Ask the kernel to drop clean cached pages of ``[start, start + length)``.

    ``target`` is a path or an open descriptor; ``length=0`` means to the end of the file.
    Dirty pages stay (``fsync`` first to drop them too), and so do pages in a large
    folio (up to 2 MiB on ext4/xfs) that sticks out of the range: drop 2 MiB-aligned
    ranges, or the whole file, to be sure. Raises ``LoadError``.
    """
    if isinstance(target, int):
        _fadvise(target, str(target), start, length)
        return
    path = os.fspath(target)
    fd = _open(path)
    try:
        _fadvise(fd, path, start, length)
    finally:
        os.close(fd)


def resident_bytes(path: str | os.PathLike[str], start: int = 0, length: int | None = None) -> int:
    """Bytes of ``[start, start + length)`` (default: to EOF) that are in the page cache.

    A resident page counts only for the part of it inside the range. Raises ``LoadError``.
    """
    path = os.fspath(path)
    fd = _open(path)
    try:
        size = _size(fd, path)
        end = size if length is None else min(start + length, size)
        total = 0
        window_start = align_down(start, PAGE_BYTES)
        while window_start < end:
            window_end = min(window_start + WINDOW_BYTES, align_up(end, PAGE_BYTES), size)
            total += _resident_in_window(fd, path, window_start, window_end, start, end)
            window_start = window_end
        return total
    finally:
        os.close(fd)


def drop_from_cache(path: str | os.PathLike[str]) -> bool:
    """Evict the whole file from the page cache; True if no page of it is resident after.

    Writes back dirty pages first (``fsync``). Fails (False) on tmpfs, and for pages that
    are mapped or locked by some process. Raises ``LoadError`` if the file cannot be used.
    """
    path = os.fspath(path)
    fd = _open(path)
    try:
        with os_errors(path, None, "fsync failed"):
            os.fsync(fd)
        _fadvise(fd, path, 0, 0)
    finally:
        os.close(fd)
    return resident_bytes(path) == 0


def _resident_in_window(
    fd: int, path: str, window_start: int, window_end: int, start: int, end: int
) -> int:
    with os_errors(path, window_start, "mmap for mincore failed"):
        mapping = mmap.mmap(
            fd, window_end - window_start, mmap.MAP_SHARED, mmap.PROT_READ, offset=window_start
        )
    try:
        with os_errors(path, window_start, "mincore failed"):
            vector = _libc.mincore(buffer_address(mapping), window_end - window_start)
    finally:
        mapping.close()
    resident = np.frombuffer(vector, dtype=np.uint8) & 1
    page_starts = window_start + np.arange(len(resident), dtype=np.int64) * PAGE_BYTES
    overlap = np.minimum(page_starts + PAGE_BYTES, end) - np.maximum(page_starts, start)
    return int((np.clip(overlap, 0, None) * resident).sum())


def _open(path: str) -> int:
    with os_errors(path, None, "cannot open"):
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)


def _size(fd: int, path: str) -> int:
    with os_errors(path, None, "fstat failed"):
        return os.fstat(fd).st_size


def _fadvise(fd: int, path: str, start: int, length: int) -> None:
    with os_errors(path, start, "posix_fadvise(DONTNEED) failed"):
        os.posix_fadvise(fd, start, length, os.POSIX_FADV_DONTNEED)
