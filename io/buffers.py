"""Page-aligned host memory, and one small protocol for "a writable byte region".

``HostBuffer`` takes its memory from an anonymous ``mmap``: it starts on a page boundary
(``np.empty`` starts 16 bytes past one, which halves ``preadv`` speed and rules out
``O_DIRECT``), and its pages come from the kernel zeroed and untouched until first written.
``huge_pages=True`` asks for transparent huge pages instead (``MADV_HUGEPAGE`` on memory
aligned to a huge page, before anything touches it): a first write then faults in a
whole 2 MiB page at once instead of 512 pages one by one. Whether the kernel grants them
is its business (``transparent_huge_pages()`` says what it is set to).

Closing while views are alive
-----------------------------
``mmap.close()`` refuses (``BufferError``) while any memoryview or numpy array still
points into the memory, because unmapping then would turn those views into dangling
pointers. ``close()`` handles this on purpose: it always marks the object CLOSED (every
further call through this object raises ``ClosedResourceError``) and drops its own
references; if views are still alive the memory itself is returned to the OS when the
last of them is released — never earlier, so no view can ever point at freed memory.
``memory_released`` tells which case happened.

Shareable memory
----------------
``shareable=True`` takes the memory from a memfd mapped ``MAP_SHARED`` instead, and
keeps its descriptor (``fileno``; the buffer starts ``descriptor_offset`` bytes into it),
so that another process can map the same pages (``aiogguf.resident``). The memfd is
sealed against shrinking and growing: a process that maps it can trust its size, as a
page cut from under a mapping would end that process with SIGBUS. ``map_private`` is the
other side: a copy-on-write mapping of such a descriptor, whose writes stay in the
process that makes them.
"""

from __future__ import annotations

import builtins
import enum
import errno
import fcntl
import functools
import mmap
import os
import threading
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from aiogguf.errors import ClosedResourceError
from aiogguf.io import _libc

if TYPE_CHECKING:
    from typing import Self

    from typing_extensions import Buffer

__all__ = [
    "HUGE_PAGE_BYTES",
    "PAGE_BYTES",
    "ByteRegion",
    "Closeable",
    "ExternalBuffer",
    "HostBuffer",
    "ResourceState",
    "back_pages",
    "buffer_address",
    "held_by_views",
    "huge_pages_pay",
    "memory_held_by_views",
    "reports_free_pages",
    "seal_writes",
    "sealed_memfd",
    "size_is_sealed",
    "transparent_huge_pages",
]

PAGE_BYTES: int = mmap.PAGESIZE
# Private anonymous memory, as malloc gives. Python's mmap(-1, n) defaults to MAP_SHARED,
# which is shared memory (shmem): every first touch goes through its page cache, so reads
# into fresh shmem are slower than into private pages (docs/performance.md).
PRIVATE_ANONYMOUS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
_THP = "/sys/kernel/mm/transparent_hugepage"


def _huge_page_bytes() -> int:
    try:
        with open(f"{_THP}/hpage_pmd_size", encoding="ascii") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 2 << 20  # x86-64's and arm64's (4 KiB base pages) PMD size


HUGE_PAGE_BYTES: int = _huge_page_bytes()
# virtio's device id of a memory balloon and its feature bit "free page reporting".
_VIRTIO_BALLOON = 5
_VIRTIO_BALLOON_F_REPORTING = 5


def reports_free_pages(sys_root: str = "/sys") -> bool:
    """Whether this kernel hands the memory it frees back to a hypervisor (a virtio
    balloon with free page reporting): the host then backs those pages anew when they
    are next used."""
    devices = Path(sys_root) / "bus/virtio/devices"
    try:
        entries = list(devices.iterdir())
    except OSError:
        return False
    for device in entries:
        try:
            if int((device / "device").read_text(), 16) != _VIRTIO_BALLOON:
                continue
            features = (device / "features").read_text().strip()
        except (OSError, ValueError):
            continue
        # One character per feature bit, bit 0 first; the driver only reports what it
        # negotiated.
        reporting = features[_VIRTIO_BALLOON_F_REPORTING : _VIRTIO_BALLOON_F_REPORTING + 1]
        if reporting == "1" and (device / "driver").exists():
            return True
    return False


@functools.cache
def huge_pages_pay() -> bool:
    """Whether fresh memory fills faster in transparent huge pages than in 4 KiB pages on
    this machine: what ``huge_pages = "auto"`` uses (and only where the kernel grants
    them at all).

    Where memory stays backed once the kernel has it (bare metal, a VM whose guest keeps
    what it frees), a first write faults in 2 MiB at once instead of one 4 KiB page at
    a time, and a read into fresh memory spends a fraction of the kernel time. Under a
    hypervisor that takes freed memory back (free page reporting), the kernel reports
    free memory in blocks of a huge page's size once they have been free a moment, so a
    huge page is most often memory the host must back anew, while 4 KiB pages often
    come from memory it still backs; there huge pages measured several times slower
    (``bench/host_pages.py``), and faster only for memory freed just before.
    """
    return not reports_free_pages()


def transparent_huge_pages() -> str:
    """The kernel's transparent huge page setting: ``"always"``, ``"madvise"`` or
    ``"never"`` (also where the kernel has none, or it cannot be read)."""
    try:
        with open(f"{_THP}/enabled", encoding="ascii") as f:
            text = f.read()
    except OSError:
        return "never"
    # "always [madvise] never": the bracketed word is the setting.
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else "never"


# The seals a shareable buffer's memfd carries from the start: a process that maps such
# a descriptor needs its size never to shrink under the mapping.
_SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
# F_SEAL_FUTURE_WRITE (Linux 5.1; Python's fcntl names it from 3.12 on): no new write to
# the memfd, by write() or by a new shared writable mapping, while the mappings made
# before it keep writing. Copy-on-write mappings stay allowed.
_F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)


def sealed_memfd(name: str, nbytes: int) -> int:
    """A new memfd (close-on-exec) of ``nbytes`` zero bytes, sealed against shrinking
    and growing: the descriptor. Raises ``MemoryError`` if the kernel refuses it."""
    try:
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as exc:
        raise MemoryError(f"cannot create shared memory of {nbytes} bytes: {exc}") from exc
    try:
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SIZE_SEALS)
    except OSError as exc:
        os.close(fd)
        raise MemoryError(f"cannot size shared memory of {nbytes} bytes: {exc}") from exc
    return fd


def seal_writes(fd: int) -> None:
    """Refuse every later write to the memfd ``fd`` but through the mappings made before
    (and every later seal): what another process gets of it can only read, or write into
    copy-on-write pages of its own. Raises ``OSError`` where the kernel cannot (before
    5.1)."""
    if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SEAL:
        return  # sealed already (a second share of the same memory)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL)


def size_is_sealed(fd: int) -> bool:
    """Whether ``fd`` is a memfd whose size can no longer shrink (``F_SEAL_SHRINK``)."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        return False  # not a memfd: a file can always be cut
    return bool(seals & fcntl.F_SEAL_SHRINK)


class ResourceState(enum.Enum):
    """Lifecycle of every closeable object in ``aiogguf.io``."""

    OPEN = "open"
    CLOSED = "closed"


class Closeable:
    """The lifecycle every closeable object here shares: an explicit state, ``with``
    support, and a ``ResourceWarning`` (then a close) if it is collected while open."""

    _state: ResourceState = ResourceState.CLOSED

    @property
    def state(self) -> ResourceState:
        return self._state

    def close(self) -> None:
        """Release what the object holds; each subclass says how."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __del__(self) -> None:
        if self._state is ResourceState.OPEN:
            warnings.warn(f"unclosed {self!r}", ResourceWarning, stacklevel=1, source=self)
            self.close()


class _HeldByViews:
    """Memory closed while views of it were alive (kept until the last view goes).

    A failed or cancelled load leaves frames in reference cycles that can hold such
    views; only a garbage collection frees them. A full collection holds the GIL for as
    long as the heap is big, so the load's caller runs one only when this says there is
    something for it to free."""

    def __init__(self) -> None:
        # Reentrant: a watched object can die (and its callback run) during a garbage
        # collection started on a thread that holds the lock.
        self._lock = threading.RLock()
        # By id, not a WeakSet: a WeakSet hashes its members, and numpy arrays (the
        # simulated device's memory) cannot be hashed. Backends pass objects of their own
        # where the memory's owner cannot be weakly referenced (CuPy's ``Memory``).
        self._held: dict[int, weakref.ref[object]] = {}
        self._unknown = False  # memory that cannot be watched was held

    def add(self, memory: object) -> None:
        key = id(memory)

        def gone(ref: weakref.ref[object]) -> None:
            with self._lock:
                if self._held.get(key) is ref:
                    del self._held[key]

        with self._lock:
            try:
                self._held[key] = weakref.ref(memory, gone)
            except TypeError:  # no weak references to it: assume it is held
                self._unknown = True

    def any(self) -> bool:
        with self._lock:
            unknown, self._unknown = self._unknown, False
            return unknown or len(self._held) > 0


_HELD_BY_VIEWS = _HeldByViews()


def held_by_views(memory: object) -> None:
    """Record that ``memory``, whose owner was just closed, may live on in views (its
    release then waits for them). Pass the object whose death frees the memory."""
    _HELD_BY_VIEWS.add(memory)


def memory_held_by_views() -> bool:
    """Whether memory recorded by ``held_by_views`` is still alive."""
    return _HELD_BY_VIEWS.any()


_populate_write_works = True


def back_pages(pages: npt.NDArray[np.uint8]) -> None:
    """Back ``pages`` (fresh memory starting on a page) with RAM now, so that no later
    write into them faults: one ``MADV_POPULATE_WRITE``, the GIL let go. Kernels before
    5.14: one write per page (a read would only map the shared zero page), which zeroes
    those bytes."""
    try:
        _libc.madvise(pages.ctypes.data, pages.nbytes, _libc.MADV_POPULATE_WRITE)
    except OSError:
        pages[::PAGE_BYTES] = 0


def buffer_address(buffer: Buffer) -> int:
    """Address of the first byte of a C-contiguous buffer (read-only buffers too).

    Raises ``ValueError`` if the buffer is not contiguous.
    """
    view = builtins.memoryview(buffer)
    if not view.c_contiguous:
        raise ValueError("buffer is not C-contiguous")
    if view.nbytes == 0:
        # numpy cannot wrap an empty buffer; an empty region has no meaningful address.
        return 0
    array = np.frombuffer(view.cast("B"), dtype=np.uint8)
    address: int = array.__array_interface__["data"][0]
    return address


@runtime_checkable
class ByteRegion(Protocol):
    """A writable, contiguous byte region with a stable address, closed by its owner.

    ``HostBuffer`` (anonymous mmap) and ``ExternalBuffer`` (e.g. pinned memory from a
    device backend) both satisfy it, so readers need not know where memory came from.
    """

    @property
    def nbytes(self) -> int: ...

    @property
    def address(self) -> int: ...

    @property
    def memoryview(self) -> builtins.memoryview: ...

    def as_array(self) -> npt.NDArray[np.uint8]:
        """The region as a flat array of bytes, over the same memory."""

    def close(self) -> None:
        """Release the region."""


class HostBuffer(Closeable):
    """``nbytes`` of page-aligned, zero-filled host memory (an anonymous mmap).

    ``alignment`` (a power of two) raises the guarantee above the page for ``O_DIRECT``
    on devices with larger logical blocks: the mapping is over-sized and the buffer
    starts at the first aligned address inside it. ``prefault=True`` backs every page
    now (see ``prefault``). ``huge_pages=True`` aligns the buffer to ``HUGE_PAGE_BYTES``
    and asks the kernel for transparent huge pages before any page is touched
    (``MADV_HUGEPAGE``); where the kernel has them off (``never``) or refuses the advice
    the buffer is plain 4 KiB-page memory (``huge_pages`` then reads False), silently.
    ``shareable=True`` takes the memory from a sealed memfd mapped shared, whose
    descriptor the buffer keeps (``fileno``: the module's docstring).

    Thread-safe: any thread may read into the memory while others do the same; ``close``
    may race with them safely (see the module docstring).

    Raises ``ValueError`` for a negative size or a bad ``alignment`` and ``MemoryError``
    if the kernel refuses the mapping.
    """

    # Class-level defaults so __del__ is safe even when __init__ failed half-way.
    _mmap: mmap.mmap | None = None
    _huge_pages = False
    _fd: int | None = None  # the memfd of a shareable buffer

    def __init__(
        self,
        nbytes: int,
        *,
        alignment: int = PAGE_BYTES,
        prefault: bool = False,
        huge_pages: bool = False,
        shareable: bool = False,
    ) -> None:
        if nbytes < 0:
            raise ValueError(f"buffer size must be >= 0, got {nbytes}")
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        self._nbytes = nbytes
        self._lock = threading.Lock()
        # mmap refuses length 0; a zero-byte buffer still gets one page so that it has
        # an address and behaves like any other buffer.
        capacity = max(_round_up_to_page(nbytes), PAGE_BYTES)
        huge_pages = huge_pages and transparent_huge_pages() != "never"
        # A huge page is only granted for a whole aligned 2 MiB of the mapping: the
        # buffer starts on one, and the mapping reaches past its last one.
        mapped = -(-capacity // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES if huge_pages else capacity
        if huge_pages:
            alignment = max(alignment, HUGE_PAGE_BYTES)
        # mmap only promises page alignment; the slack is untouched, so costs no memory.
        slack = max(alignment - PAGE_BYTES, 0)
        if shareable:
            self._mmap = self._map_shared(mapped + slack)
        else:
            try:
                self._mmap = mmap.mmap(-1, mapped + slack, flags=PRIVATE_ANONYMOUS)
            except OSError as exc:
                raise MemoryError(f"cannot map {capacity} bytes of host memory: {exc}") from exc
        self._capacity_bytes = capacity
        self._mmap_ref: weakref.ref[mmap.mmap] = weakref.ref(self._mmap)
        base = buffer_address(self._mmap)
        self._start = -base % alignment
        self._address = base + self._start
        if huge_pages:
            try:
                _libc.madvise(self._address, mapped, _libc.MADV_HUGEPAGE)
            except OSError:
                huge_pages = False  # a kernel built without them: plain pages
        self._huge_pages = huge_pages
        self._view: builtins.memoryview | None = builtins.memoryview(self._mmap)[
            self._start : self._start + nbytes
        ]
        self._state = ResourceState.OPEN
        if prefault:
            self.prefault()

    def _map_shared(self, nbytes: int) -> mmap.mmap:
        fd = sealed_memfd("aiogguf-image", nbytes)
        try:
            mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        except OSError as exc:
            os.close(fd)
            raise MemoryError(f"cannot map {nbytes} bytes of shared memory: {exc}") from exc
        self._fd = fd
        return mapping

    @classmethod
    def map_private(cls, fd: int, offset: int, nbytes: int) -> HostBuffer:
        """``nbytes`` at ``offset`` of the memfd ``fd`` (a shareable buffer's, possibly
        another process's), mapped copy-on-write (``MAP_PRIVATE``, reserving nothing): its
        pages are the memfd's until written, and a write stays in this process. The
        caller keeps ``fd`` (the mapping does not need it) and has checked that the range
        lies inside it and that its size is sealed (``size_is_sealed``). Raises
        ``MemoryError`` if the kernel refuses the mapping."""
        from aiogguf.io.mapping import _MAP_NORESERVE

        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        length = max(offset + nbytes - start, 1)
        try:
            mapping = mmap.mmap(
                fd,
                length,
                flags=mmap.MAP_PRIVATE | _MAP_NORESERVE,
                prot=mmap.PROT_READ | mmap.PROT_WRITE,
                offset=start,
            )
        except OSError as exc:
            raise MemoryError(f"cannot map {length} bytes of shared memory: {exc}") from exc
        self = cls.__new__(cls)
        self._nbytes = nbytes
        self._lock = threading.Lock()
        self._mmap = mapping
        self._mmap_ref = weakref.ref(mapping)
        self._capacity_bytes = length - (offset - start)
        self._start = offset - start
        self._address = buffer_address(mapping) + self._start
        self._view = builtins.memoryview(mapping)[self._start : self._start + nbytes]
        self._state = ResourceState.OPEN
        return self

    # -- lifecycle ---------------------------------------------------------------

    @property
    def memory_released(self) -> bool:
        """True once the memory is unmapped (after ``close`` and the last view's release)."""
        mapping = self._mmap_ref()
        return mapping is None or mapping.closed

    @property
    def shareable(self) -> bool:
        """Whether the memory is a memfd another process can map (``fileno``)."""
        return self._fd is not None

    def fileno(self) -> int:
        """The memfd of a shareable buffer (valid until ``close``); the buffer starts
        ``descriptor_offset`` bytes into it. Raises ``ValueError`` for a buffer of private
        memory, ``ClosedResourceError`` after close."""
        self._open_mmap()
        if self._fd is None:
            raise ValueError(f"{self!r} is private memory: it has no descriptor")
        return self._fd

    @property
    def descriptor_offset(self) -> int:
        """Where the buffer starts in its memfd (``fileno``)."""
        return self._start

    def close(self) -> None:
        """Release the buffer; idempotent. Outstanding views keep the memory alive."""
        with self._lock:
            if self._state is ResourceState.CLOSED:
                return
            self._state = ResourceState.CLOSED
            mapping, view = self._mmap, self._view
            self._mmap = self._view = None
            fd, self._fd = self._fd, None
        assert mapping is not None
        assert view is not None
        if fd is not None:
            os.close(fd)  # the mapping (ours, another process's) keeps the memory
        try:
            view.release()
            mapping.close()
        except BufferError:
            # Views are alive (numpy arrays, slices held by a reader): we have dropped
            # our references; the mmap is unmapped when the last view goes away.
            held_by_views(mapping)

    def __repr__(self) -> str:
        return f"<HostBuffer nbytes={self._nbytes} state={self._state.value}>"

    # -- access ------------------------------------------------------------------

    def _open_mmap(self) -> mmap.mmap:
        mapping = self._mmap
        if mapping is None:
            raise ClosedResourceError(repr(self))
        return mapping

    @property
    def nbytes(self) -> int:
        """The size asked for (the mapping itself is rounded up to whole pages)."""
        return self._nbytes

    @property
    def capacity_bytes(self) -> int:
        """Usable bytes from ``address``: ``nbytes`` rounded up to a whole page (at least
        one)."""
        return self._capacity_bytes

    @property
    def huge_pages(self) -> bool:
        """Whether the memory was advised for transparent huge pages (the kernel may
        still back some of it with 4 KiB pages)."""
        return self._huge_pages

    @property
    def address(self) -> int:
        """Address of the first byte; a multiple of ``PAGE_BYTES`` and of ``alignment``
        (and of ``HUGE_PAGE_BYTES`` with ``huge_pages``)."""
        self._open_mmap()
        return self._address

    @property
    def memoryview(self) -> builtins.memoryview:
        """A writable view of exactly ``nbytes`` bytes (the same object on every call)."""
        view = self._view
        if view is None:
            raise ClosedResourceError(repr(self))
        return view

    def as_array(self) -> npt.NDArray[np.uint8]:
        """A writable uint8 numpy view of exactly ``nbytes`` bytes."""
        return np.frombuffer(
            self._open_mmap(), dtype=np.uint8, count=self._nbytes, offset=self._start
        )

    def populate(self, start: int, end: int) -> None:
        """Back the pages of ``[start, end)`` with memory in one kernel call
        (``MADV_POPULATE_WRITE``, the GIL let go) where the kernel has it (5.14 on);
        elsewhere do nothing. A read into fresh memory otherwise takes one fault per page
        it lands on, each entered and left on its own, which costs the kernel more than
        zeroing the same pages in one call. Pages already backed are left as they are,
        so a range may overlap one that another thread is reading into."""
        global _populate_write_works
        if not _populate_write_works:
            return
        mapping = self._open_mmap()
        start -= start % PAGE_BYTES
        end = min(end, self._capacity_bytes)
        if start >= end:
            return
        # Holding an array keeps the mapping alive even if another thread closes us.
        array = np.frombuffer(mapping, dtype=np.uint8, offset=self._start)
        try:
            _libc.madvise(self._address + start, end - start, _libc.MADV_POPULATE_WRITE)
        except OSError as exc:
            # Any refusal leaves the pages to the read's own faults, as without the call.
            if exc.errno == errno.EINVAL:
                _populate_write_works = False  # a kernel before 5.14
        finally:
            del array

    def prefault(self, start: int = 0, end: int | None = None) -> None:
        """Back the pages of ``[start, end)`` (default: all) with real memory now, so that
        later reads into them take no page faults."""
        mapping = self._open_mmap()
        end = self._capacity_bytes if end is None else min(end, self._capacity_bytes)
        start -= start % PAGE_BYTES
        if start >= end:
            return
        # Holding an array keeps the mapping alive even if another thread closes us.
        array = np.frombuffer(mapping, dtype=np.uint8, offset=self._start)
        back_pages(array[start:end])
        del array


class ExternalBuffer(Closeable):
    """Memory owned elsewhere (e.g. a CuPy pinned buffer) behind the ``ByteRegion`` face.

    ``memory`` must be a writable, C-contiguous buffer. ``release`` is called once, by the
    first ``close()``; the wrapped object itself is dropped at that point too.
    """

    def __init__(
        self,
        memory: Buffer,
        *,
        release: Callable[[], None] | None = None,
        name: str = "external buffer",
    ) -> None:
        view = builtins.memoryview(memory)
        if view.readonly:
            raise ValueError(f"{name}: memory is read-only")
        if not view.c_contiguous:
            raise ValueError(f"{name}: memory is not C-contiguous")
        self._lock = threading.Lock()
        self._view: builtins.memoryview | None = view.cast("B")
        self._nbytes = view.nbytes
        self._address = buffer_address(view)
        self._release = release
        self._name = name
        self._state = ResourceState.OPEN

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def address(self) -> int:
        self.memoryview  # noqa: B018 — raises if closed
        return self._address

    @property
    def memoryview(self) -> builtins.memoryview:
        view = self._view
        if view is None:
            raise ClosedResourceError(repr(self))
        return view

    def as_array(self) -> npt.NDArray[np.uint8]:
        """The wrapped memory as a flat array of bytes, without a copy."""
        return np.frombuffer(self.memoryview, dtype=np.uint8)

    def close(self) -> None:
        """Drop the wrapped memory and call ``release`` once; idempotent."""
        with self._lock:
            if self._state is ResourceState.CLOSED:
                return
            self._state = ResourceState.CLOSED
            self._view, release, self._release = None, self._release, None
        if release is not None:
            release()

    def __repr__(self) -> str:
        return f"<ExternalBuffer {self._name!r} nbytes={self._nbytes} state={self._state.value}>"


def _round_up_to_page(nbytes: int) -> int:
    return -(-nbytes // PAGE_BYTES) * PAGE_BYTES
