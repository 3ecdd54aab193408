"""Memory mappings of one file range each: zero-copy tensors, madvise, touch, mlock.

A ``FileMapping`` maps exactly the pages of ``[file_start, file_end)`` (start rounded
down, end rounded up to a page, never past the end of the file), so tensors that live
elsewhere (offloaded to a GPU) never occupy host address space.

All methods are synchronous and block for at most the range they are given: the engine
calls ``touch``/``lock``/``advise`` one chunk or one tensor at a time from worker threads.
Calls that may take long (``touch``, ``lock``, ``advise``) go through ctypes, which
releases the GIL; ``mmap.madvise`` would hold it and stall the event loop.

Copy-on-write
-------------
Every mapping is private and writable (``MAP_PRIVATE``, ``PROT_READ | PROT_WRITE``): its
clean pages are the page cache's own, shared with every other mapping and reader of the
file, but a page written through it becomes the process's own copy, and the file never
changes. A write through any view (torch has no read-only tensor) then lands in that
copy instead of ending the process with SIGSEGV, as a write into a ``PROT_READ`` page
does. ``view`` still hands out read-only memoryviews (``writable=False``);
``private_view`` hands out writable ones, for consumers that need writable memory.

Three things follow from the mapping being private and writable:

- It reserves nothing (``MAP_NORESERVE``): a private writable mapping is otherwise
  charged in full against the commit limit, and the kernel refuses one larger than RAM
  plus swap (a model bigger than RAM maps, as with ``MAP_SHARED``). A written page is
  then taken when it is written. Where the kernel refuses it anyway (ENOMEM: strict
  overcommit, ``vm.overcommit_memory=2``, ignores ``MAP_NORESERVE``; ``RLIMIT_DATA``),
  the range is mapped shared and read-only instead: ``copy_on_write`` says which, and
  ``private_view`` refuses.
- ``lock`` does not use a plain ``mlock`` where it can help it: the kernel populates a
  locked private writable range by breaking copy-on-write, copying every page into
  memory of the process's own. It locks on fault (``mlock2(MLOCK_ONFAULT)``) and reads
  the pages in: they stay the page cache's, locked, until written.
- ``madvise(MADV_DONTNEED)`` drops the pages written, not only clean ones (the engine
  never asks for it).

Closing while views are alive
-----------------------------
``close()`` first unlocks everything this mapping locked, then unmaps. If memoryviews or
arrays from ``view()``/``as_array()`` are still alive, unmapping would leave them dangling,
so ``close()`` drops our references instead and the kernel mapping goes away with the last
view (``unmapped`` tells which happened). The object is CLOSED either way: every further
call raises ``ClosedResourceError``. The engine releases its views before closing, so in a
normal load the range is unmapped by ``close()`` itself.

Every ``OSError`` leaves this module as ``LoadError(path, offset, problem)``.
"""

from __future__ import annotations

import builtins
import contextlib
import enum
import errno
import functools
import mmap
import os
import platform
import resource
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from aiogguf._units import format_bytes
from aiogguf.errors import ClosedResourceError, LoadError, from_os_error, os_errors, shown_path
from aiogguf.io import _libc
from aiogguf.io.buffers import (
    PAGE_BYTES,
    Closeable,
    ResourceState,
    buffer_address,
    held_by_views,
)
from aiogguf.io.files import DataFile, align_down, align_up, merge_range, open_readable
from aiogguf.io.workers import raise_if_stopped

if TYPE_CHECKING:
    pass

__all__ = [
    "FileMapping",
    "LockResult",
    "MapAdvice",
    "may_lock_past_limit",
    "memlock_limit",
    "numa_nodes",
    "open_mapping",
]

_NODE_DIR = Path("/sys/devices/system/node")
# The most one MADV_POPULATE_READ asks for: from a disk of 100 MB/s, under a second.
POPULATE_CALL_BYTES = 64 << 20

# errno values with which mlock reports "over RLIMIT_MEMLOCK / not allowed to lock".
_MLOCK_LIMIT_ERRNOS = frozenset({errno.ENOMEM, errno.EPERM, errno.EAGAIN})

# Why ``FileMapping.private_view`` refuses a mapping that is not copy-on-write.
_READ_ONLY = (
    "mapped read-only: the kernel refused a copy-on-write mapping (ENOMEM: "
    "vm.overcommit_memory=2 charges one in full, or RLIMIT_DATA), and a write into a "
    'read-only page ends the process; load with mode="none" for writable memory'
)

# mmap(2)'s MAP_NORESERVE (<asm/mman.h>); Python's mmap module exports it from 3.13 only.
# Where the architecture is unknown it is 0: the mapping is then charged, and one the
# kernel refuses is mapped read-only (``_map_range``).
_MAP_NORESERVE: int = getattr(mmap, "MAP_NORESERVE", 0) or {
    "x86_64": 0x4000,
    "aarch64": 0x4000,
    "riscv64": 0x4000,
    "s390x": 0x4000,
    "ppc64le": 0x40,
}.get(platform.machine(), 0)


class MapAdvice(enum.Enum):
    """``madvise`` hints, by name."""

    NORMAL = mmap.MADV_NORMAL
    RANDOM = mmap.MADV_RANDOM
    SEQUENTIAL = mmap.MADV_SEQUENTIAL
    WILLNEED = mmap.MADV_WILLNEED
    DONTNEED = mmap.MADV_DONTNEED


@dataclass(frozen=True, slots=True)
class LockResult:
    """What one ``FileMapping.lock`` call achieved.

    ``ok`` False means the kernel refused (almost always ``RLIMIT_MEMLOCK``); ``problem``
    is then a ready-made warning naming the bytes asked, the limit and how to raise it.
    """

    ok: bool
    requested_bytes: int  # page-aligned size this call tried to lock
    locked_bytes: int  # bytes of this mapping locked after the call
    limit_bytes: int | None  # soft RLIMIT_MEMLOCK; None = unlimited
    problem: str | None = None

    def __bool__(self) -> bool:
        # So that ``if not mapping.lock(...)`` reads as it should.
        return self.ok


def memlock_limit() -> int | None:
    """The soft ``RLIMIT_MEMLOCK`` in bytes, or None when unlimited.

    (A process with ``CAP_IPC_LOCK``, e.g. root, may lock beyond it.)
    """
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def may_lock_past_limit() -> bool:
    """Whether this process may lock more than ``RLIMIT_MEMLOCK`` (it has
    ``CAP_IPC_LOCK``, as root usually does); False where that cannot be read."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_IPC_LOCK & 1)
    except (OSError, ValueError):
        pass
    return False


_CAP_IPC_LOCK = 14  # linux/capability.h


@functools.cache
def numa_nodes() -> int:
    """Number of NUMA nodes (``/sys/devices/system/node/node*``); 1 where unknown.
    Read once per process."""
    try:
        # listdir, not Path.glob: a glob compiles a pattern, which costs a first load
        # more than the scan.
        names = os.listdir(_NODE_DIR)
        count = sum(1 for name in names if name.startswith("node") and name[4:].isdigit())
    except OSError:
        return 1
    return max(count, 1)


def open_mapping(
    source: str | os.PathLike[str] | DataFile,
    file_start: int,
    file_end: int,
    *,
    writable: bool = False,
    populate: bool = False,
) -> FileMapping:
    """Map the file range ``[file_start, file_end)`` of ``source`` (a path or an open
    ``DataFile``, whose descriptor is then reused; the mapping outlives neither's need).

    The mapping is private copy-on-write either way (the module's docstring), zero-copy
    from the page cache until a page is written; the file never changes.
    ``writable=False``: ``view`` gives read-only memoryviews (and the mapping falls back
    to a shared read-only one where the kernel refuses a copy-on-write one);
    ``writable=True``: writable ones, for in-place byte swapping of big-endian files
    (the mapping is then reserved in full: every page will be written).
    ``populate=True`` reads the whole range in before returning (the effect of
    ``MAP_POPULATE``, done as ``touch()``: Python's ``mmap()`` holds the GIL through a
    ``MAP_POPULATE``, for as long as the whole range takes to read, which would stall the
    event loop; ``touch`` releases it). It blocks for the whole range: the engine uses it
    only for small ranges, and ``touch`` in chunks otherwise.

    Raises ``LoadError`` if the file cannot be opened or mapped or the range lies outside
    it; ``ValueError`` for an empty or reversed range.
    """
    return FileMapping(source, file_start, file_end, writable=writable, populate=populate)


class FileMapping(Closeable):
    """One mapped file range. Offsets in every method are absolute file offsets."""

    _fd: int | None = None  # the file's descriptor, kept with ``keep_descriptor``

    def __init__(
        self,
        source: str | os.PathLike[str] | DataFile,
        file_start: int,
        file_end: int,
        *,
        writable: bool = False,
        populate: bool = False,
        keep_descriptor: bool = False,
    ) -> None:
        self.path: str = source.path if isinstance(source, DataFile) else os.fspath(source)
        if not 0 <= file_start < file_end:
            raise ValueError(
                f"{self.path}: cannot map the empty or reversed range [{file_start}, {file_end})"
            )
        self.file_start = file_start
        self.file_end = file_end
        self.writable = writable
        self._lock = threading.Lock()
        self._locked: list[tuple[int, int]] = []  # merged, sorted file-offset intervals
        mapping, map_start, map_end, private, fd = _map_range(
            source, self.path, file_start, file_end, writable=writable, keep=keep_descriptor
        )
        # The file's descriptor, kept for a shareable load: another process maps the
        # file through it (``aiogguf.resident``).
        self._fd = fd
        # False only where the kernel refused a private writable mapping: the pages are
        # then the file's, read-only, and a write through any view is SIGSEGV.
        self.copy_on_write: bool = private
        self.map_start: int = map_start
        self.map_end: int = map_end
        self._mmap: mmap.mmap | None = mapping
        self._mmap_ref: weakref.ref[mmap.mmap] = weakref.ref(self._mmap)
        self._view: builtins.memoryview | None = builtins.memoryview(self._mmap)
        self.address: int = buffer_address(self._mmap)
        self._state = ResourceState.OPEN
        if populate:
            try:
                self.touch()
            except BaseException:
                self.close()
                raise

    def fileno(self) -> int:
        """The mapped file's descriptor, kept where the mapping was made with
        ``keep_descriptor`` (valid until ``close``). Raises ``ValueError`` for a mapping
        that kept none, ``ClosedResourceError`` after close."""
        if self._state is ResourceState.CLOSED:
            raise ClosedResourceError(repr(self))
        if self._fd is None:
            raise ValueError(f"{self!r} kept no descriptor of its file")
        return self._fd

    # -- lifecycle ---------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Mapped bytes: ``map_end - map_start``."""
        return self.map_end - self.map_start

    @property
    def unmapped(self) -> bool:
        """True once the kernel mapping is gone (after ``close`` and the last view)."""
        mapping = self._mmap_ref()
        return mapping is None or mapping.closed

    @property
    def locked_bytes(self) -> int:
        """Bytes of this mapping currently locked by ``lock``."""
        with self._lock:
            return sum(end - start for start, end in self._locked)

    def close(self) -> None:
        """Unlock, then unmap (now, or with the last live view); idempotent."""
        with self._lock:
            if self._state is ResourceState.CLOSED:
                return
            self._state = ResourceState.CLOSED
            mapping, view = self._mmap, self._view
            self._mmap = self._view = None
            locked, self._locked = self._locked, []
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
        assert mapping is not None
        assert view is not None
        for start, end in locked:
            # Unlock explicitly: if views keep the mapping alive, the pages must not stay
            # pinned. A failure is harmless (munmap unlocks too), so it is not raised.
            with contextlib.suppress(OSError):
                _libc.munlock(self.address + start - self.map_start, end - start)
        try:
            view.release()
            mapping.close()
        except BufferError:
            # Views alive: the mapping is unmapped when the last one is released.
            held_by_views(mapping)

    def __repr__(self) -> str:
        return (
            f"<FileMapping {self.path!r} [{self.file_start}, {self.file_end}) "
            f"state={self._state.value}>"
        )

    # -- access ------------------------------------------------------------------

    def _pages(self, file_start: int | None, file_end: int | None) -> tuple[int, int]:
        """Page-aligned file offsets covering the sub-range, clipped to the mapping."""
        start = self.file_start if file_start is None else file_start
        end = self.file_end if file_end is None else file_end
        if not self.map_start <= start <= end <= self.map_end:
            raise ValueError(
                f"{self.path}: range [{start}, {end}) is outside the mapped range "
                f"[{self.map_start}, {self.map_end})"
            )
        # Whole pages: the kernel maps the last partial page of the file whole too.
        return align_down(start, PAGE_BYTES), align_up(end, PAGE_BYTES)

    def _pin(self) -> npt.NDArray[np.uint8]:
        """An array over the whole mapping: while it lives, ``close`` cannot unmap.

        Taken before every raw-address (ctypes) call, so a concurrent ``close`` from
        another thread defers the unmap instead of pulling the pages out from under us.
        """
        with self._lock:
            mapping = self._mmap
            if mapping is None:
                raise ClosedResourceError(repr(self))
            return np.frombuffer(mapping, dtype=np.uint8)

    def view(self, file_offset: int, nbytes: int) -> builtins.memoryview:
        """A memoryview of ``nbytes`` at ``file_offset`` (read-only unless ``writable``).

        Raises ``ValueError`` if the bytes are not inside the mapping,
        ``ClosedResourceError`` after close.
        """
        view = self._slice(file_offset, nbytes)
        return view if self.writable else view.toreadonly()

    def private_view(self, file_offset: int, nbytes: int) -> builtins.memoryview:
        """A writable memoryview of ``nbytes`` at ``file_offset``: a page written through
        it becomes the process's own copy, the file and every other mapping of it keep
        their bytes.

        Raises ``LoadError`` where the mapping is read-only (``copy_on_write`` False: the
        kernel refused a private writable one), ``ValueError`` if the bytes are not
        inside the mapping, ``ClosedResourceError`` after close.
        """
        view = self._slice(file_offset, nbytes)
        if not self.copy_on_write:
            raise LoadError(self.path, file_offset, _READ_ONLY)
        return view

    def _slice(self, file_offset: int, nbytes: int) -> builtins.memoryview:
        base = self._view
        if base is None:
            raise ClosedResourceError(repr(self))
        if nbytes < 0 or not self.map_start <= file_offset <= file_offset + nbytes <= self.map_end:
            raise ValueError(
                f"{self.path}: bytes [{file_offset}, {file_offset + nbytes}) are outside "
                f"the mapped range [{self.map_start}, {self.map_end})"
            )
        rel = file_offset - self.map_start
        return base[rel : rel + nbytes]

    def as_array(self, file_offset: int, nbytes: int) -> npt.NDArray[np.uint8]:
        """Like ``view`` but a uint8 numpy array."""
        return np.frombuffer(self.view(file_offset, nbytes), dtype=np.uint8)

    def advise(
        self, advice: MapAdvice, file_start: int | None = None, file_end: int | None = None
    ) -> None:
        """``madvise`` on the pages covering ``[file_start, file_end)`` (default: all).

        Raises ``LoadError`` if the kernel rejects it, ``ValueError`` outside the mapping.
        """
        start, end = self._pages(file_start, file_end)
        if start == end:
            return
        pin = self._pin()
        try:
            with os_errors(self.path, start, f"madvise({advice.name}) failed"):
                _libc.madvise(self.address + start - self.map_start, end - start, advice.value)
        finally:
            del pin

    def touch(self, file_start: int | None = None, file_end: int | None = None) -> int:
        """Make the pages covering ``[file_start, file_end)`` resident and mapped.

        Uses ``MADV_POPULATE_READ`` (Linux 5.14+), else reads one byte per page. Blocks
        until the data is read from disk: call it one chunk at a time. Returns the
        page-aligned bytes covered.

        Raises ``LoadError`` if the file cannot be read (e.g. truncated underneath us
        shows up as ``EFAULT`` from populate), ``ValueError`` outside the mapping.
        """
        global _populate_read_works
        start, end = self._pages(file_start, file_end)
        if start == end:
            return 0
        pin = self._pin()
        try:
            rel = start - self.map_start
            if _populate_read_works:
                lo = rel
                try:
                    # In calls of POPULATE_CALL_BYTES: a cancelled load waits for one
                    # of them, not for a whole job read from a slow disk.
                    for lo in range(rel, rel + end - start, POPULATE_CALL_BYTES):
                        raise_if_stopped()
                        n = min(POPULATE_CALL_BYTES, rel + end - start - lo)
                        _libc.madvise(self.address + lo, n, _libc.MADV_POPULATE_READ)
                    return end - start
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        doing = "reading pages into memory failed"
                        at = self.map_start + lo
                        raise from_os_error(exc, self.path, at, doing) from exc
                    _populate_read_works = False  # kernel before 5.14
            # numpy releases the GIL in the reduction loop; each element faults one page.
            pin[rel : end - self.map_start : PAGE_BYTES].sum(dtype=np.uint64)
            return end - start
        finally:
            del pin

    def lock(
        self,
        file_start: int | None = None,
        file_end: int | None = None,
        *,
        on_fault: bool = False,
    ) -> LockResult:
        """``mlock`` the pages covering ``[file_start, file_end)``; reads them in first.

        ``on_fault``: read nothing now; each page is locked as it is faulted in, by
        ``touch`` or by a reader (``mlock2(MLOCK_ONFAULT)``). The call is then cheap and
        takes the process's memory map only briefly, so that populating jobs on several
        threads does not wait on it. Raises ``OSError`` (``ENOSYS``, ``EINVAL``) where
        the kernel or the C library cannot lock on fault; the caller locks as it reads.

        A copy-on-write mapping is locked on fault even without ``on_fault``, then read
        in: a plain ``mlock`` would copy every page (the module's docstring). Only where
        the system cannot lock on fault does it take the plain ``mlock`` and its copy:
        the range is then locked in memory of the process's own, as mode ``none``'s is.

        Locking the same pages twice is harmless and counted once. A refusal by the kernel
        (``RLIMIT_MEMLOCK``) is not raised: the result has ``ok=False`` and a ``problem``
        ready for a warning. Raises ``LoadError`` for any other failure.
        """
        start, end = self._pages(file_start, file_end)
        requested = end - start
        if requested == 0:
            return LockResult(True, 0, self.locked_bytes, memlock_limit())
        pin = self._pin()
        try:
            address = self.address + start - self.map_start
            read_in = _lock_pages(address, requested, on_fault, private=self.copy_on_write)
        except OSError as exc:
            if on_fault and exc.errno in (errno.ENOSYS, errno.EINVAL):
                raise
            if exc.errno not in _MLOCK_LIMIT_ERRNOS:
                raise from_os_error(exc, self.path, start, "mlock failed") from exc
            limit, already = memlock_limit(), self.locked_bytes
            problem = _lock_refusal(self.path, requested, already, limit, exc)
            return LockResult(False, requested, already, limit, problem)
        finally:
            del pin
        with self._lock:
            self._locked = merge_range(self._locked, start, end)
            total = sum(e - s for s, e in self._locked)
        if read_in:
            # Locked on fault: reading the pages in locks them, as mlock would have.
            self.touch(file_start, file_end)
        return LockResult(True, requested, total, memlock_limit())

    def is_locked(self, file_start: int, file_end: int) -> bool:
        """Whether ``[file_start, file_end)`` lies in a range ``lock`` has locked (its
        pages are locked as they are faulted in, or already are)."""
        start, end = self._pages(file_start, file_end)
        with self._lock:
            return any(s <= start and end <= e for s, e in self._locked)


def _map_range(
    source: str | os.PathLike[str] | DataFile,
    path: str,
    file_start: int,
    file_end: int,
    *,
    writable: bool,
    keep: bool = False,
) -> tuple[mmap.mmap, int, int, bool, int | None]:
    """Blocking: ``[file_start, file_end)`` of ``path`` mapped, whole pages from an
    allocation-granularity boundary; the mapping, the file offsets it spans, whether
    it is private (copy-on-write; else shared and read-only, where the kernel refused a
    private one and ``writable`` is False), and with ``keep`` a descriptor of the file
    (the caller's to close; else None)."""
    if isinstance(source, DataFile):
        # Our own duplicate: the DataFile may be closed while the mapping lives on.
        with os_errors(path, None, "cannot duplicate descriptor"):
            fd = os.dup(source.fileno())
    else:
        fd = open_readable(path)
    try:
        size = os.fstat(fd).st_size
        if file_end > size:
            raise LoadError(
                path,
                file_start,
                f"cannot map [{file_start}, {file_end}): the file has only {size} bytes",
            )
        map_start = align_down(file_start, mmap.ALLOCATIONGRANULARITY)
        # Rounded up to a page, but never past EOF: Python's mmap refuses a length
        # beyond the file (touching such pages would be SIGBUS anyway).
        map_end = min(align_up(file_end, PAGE_BYTES), size)
        nbytes = map_end - map_start
        # A byte-swapped range is written whole: reserved, so that a short memory fails
        # here rather than in the swap's page faults.
        flags = mmap.MAP_PRIVATE | (0 if writable else _MAP_NORESERVE)
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        doing = f"mmap of {nbytes} bytes failed"
        try:
            mapping = mmap.mmap(fd, nbytes, flags=flags, prot=prot, offset=map_start)
            private = True
        except OSError as exc:
            if writable or exc.errno != errno.ENOMEM:
                raise from_os_error(exc, path, map_start, doing) from exc
            # The kernel charged the private mapping and refused it: a shared read-only
            # one is charged nothing, and serves every read-only view.
            with os_errors(path, map_start, doing):
                mapping = mmap.mmap(
                    fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=map_start
                )
            private = False
    except BaseException:
        os.close(fd)
        raise
    if not keep:
        os.close(fd)  # the mapping keeps the file alive (and mmap holds its own dup)
    return mapping, map_start, map_end, private, fd if keep else None


def _lock_pages(address: int, nbytes: int, on_fault: bool, *, private: bool) -> bool:
    """Lock ``nbytes`` at ``address``; whether the pages are still to be read in (they
    were locked on fault). A private mapping is locked on fault even when the caller
    wants the pages read in: a plain ``mlock`` would copy them all (the module's
    docstring); it does so only where the system cannot lock on fault. Raises
    ``OSError`` as ``mlock``/``mlock2`` do."""
    if not (on_fault or private):
        _libc.mlock(address, nbytes)
        return False
    try:
        _libc.mlock2(address, nbytes, _libc.MLOCK_ONFAULT)
    except OSError as exc:
        if on_fault or exc.errno not in (errno.ENOSYS, errno.EINVAL):
            raise
        _libc.mlock(address, nbytes)  # locks a copy of every page
        return False
    return not on_fault


def _lock_refusal(path: str, requested: int, already: int, limit: int | None, exc: OSError) -> str:
    """The warning for a lock the kernel refused (``RLIMIT_MEMLOCK``)."""
    limit_text = "unlimited" if limit is None else format_bytes(limit)
    return (
        f"mlock of {shown_path(path)} needed {format_bytes(requested)} more "
        f"({requested} bytes; {format_bytes(already)} already locked by this mapping), "
        f"RLIMIT_MEMLOCK is {limit_text}: raise it with `ulimit -l` or "
        f"LimitMEMLOCK= in the systemd unit ({exc.strerror})"
    )


# Flipped to False the first time the kernel says MADV_POPULATE_READ is unknown.
_populate_read_works = True
