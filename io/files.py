"""Positional reads straight into caller memory: buffered ``preadv`` and ``O_DIRECT``.

Every call is synchronous, blocking and bounded by the size the caller passes: the engine
runs one chunk per call on the load's threads, so cancellation stays prompt.

``DataFile`` is thread-safe. Reads from many threads may overlap; ``close()`` may race
with them: the descriptors are closed by whichever of ``close()`` or the last in-flight
read finishes later, so a read never sees its descriptor number reused by another file.

Every ``OSError`` leaves this module as ``LoadError(path, offset, problem)``.
"""

from __future__ import annotations

import builtins
import enum
import errno
import fcntl
import os
import stat
import threading
from typing import TYPE_CHECKING

from aiogguf.errors import ClosedResourceError, LoadError, from_os_error, os_errors
from aiogguf.io.buffers import Closeable, ResourceState, buffer_address

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "DIRECT_ALIGNMENT",
    "MAX_CALL_BYTES",
    "DataFile",
    "FileAdvice",
    "align_down",
    "align_up",
    "merge_range",
    "open_file",
    "open_readable",
    "readable_descriptor",
]

# O_DIRECT needs offset, length and memory address aligned to the device's logical block
# size (512 or 4096). 4096 satisfies both and is also the page size.
DIRECT_ALIGNMENT = 4096


# The most one read call asks for, by default. Each call lets the GIL go and takes it
# back, and both cost: the call's own Python, and, with a pure-Python thread beside the
# load (a server's own request handling), a wait of up to a switch interval (5 ms) for
# the GIL after every call (README, Performance: the convoy). Bounded all the same, so
# that a reader ends soon after it is asked to (cancellation) and no one call holds a
# core for long.
MAX_CALL_BYTES = 64 << 20


def align_down(value: int, alignment: int) -> int:
    """Largest multiple of ``alignment`` that is <= ``value`` (alignment > 0)."""
    return value - value % alignment


def align_up(value: int, alignment: int) -> int:
    """Smallest multiple of ``alignment`` that is >= ``value`` (alignment > 0)."""
    return -(-value // alignment) * alignment


def merge_range(ranges: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """``ranges`` (sorted, disjoint ``[start, end)`` pairs) with ``[lo, hi)`` added,
    merging what it overlaps or touches; an empty ``[lo, hi)`` changes nothing."""
    if lo >= hi:
        return ranges
    merged: list[tuple[int, int]] = []
    for start, end in ranges:
        if end < lo or start > hi:
            merged.append((start, end))
        else:
            lo, hi = min(lo, start), max(hi, end)
    merged.append((lo, hi))
    merged.sort()
    return merged


class FileAdvice(enum.Enum):
    """``posix_fadvise`` hints, by name."""

    NORMAL = os.POSIX_FADV_NORMAL
    SEQUENTIAL = os.POSIX_FADV_SEQUENTIAL
    RANDOM = os.POSIX_FADV_RANDOM
    WILLNEED = os.POSIX_FADV_WILLNEED
    DONTNEED = os.POSIX_FADV_DONTNEED
    NOREUSE = os.POSIX_FADV_NOREUSE


# st_mode kind → its name, for the error. Anything not regular or a block device is
# refused: a FIFO or a socket blocks the open or the first read for ever, a character
# device (/dev/zero) never ends, a directory is no model.
_KIND_NAMES = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFDIR: "a directory",
    stat.S_IFLNK: "a symbolic link",
}


def open_readable(path: str | os.PathLike[str], flags: int = 0) -> int:
    """Open ``path`` read-only (plus ``flags``) if it is a regular file or a block
    device; return the descriptor (blocking, close-on-exec).

    The open itself is non-blocking, so a FIFO with no writer cannot hang it, and the
    kind is checked on the descriptor (``fstat``) before anything is read: no gap in
    which the path could be swapped for something else.

    Raises ``LoadError`` naming the path if it cannot be opened or is of another kind.
    """
    fspath = os.fspath(path)
    with os_errors(fspath, None, "cannot open"):
        fd = os.open(fspath, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | flags)
    return readable_descriptor(fd, fspath)


def readable_descriptor(fd: int, path: str) -> int:
    """``fd``, opened with ``O_NONBLOCK``, made blocking again if it is a regular file or
    a block device. Otherwise ``fd`` is closed and a ``LoadError`` names ``path`` and
    what it is (a FIFO, a directory...)."""
    try:
        with os_errors(path, None, "cannot open"):
            mode = os.fstat(fd).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISBLK(mode)):
                kind = _KIND_NAMES.get(stat.S_IFMT(mode), "not a file")
                raise LoadError(path, None, f"not a regular file: it is {kind}")
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_file(
    path: str | os.PathLike[str],
    *,
    direct: bool = False,
    alignment: int = DIRECT_ALIGNMENT,
    fd: int | None = None,
) -> DataFile:
    """Open ``path`` for reading; with ``direct=True`` also try ``O_DIRECT``.

    A filesystem that refuses ``O_DIRECT`` (at open or at a probe read of the first block)
    is not an error: the file falls back to buffered reads, ``direct_ok`` is False and
    ``direct_refusal`` says why, so the caller can warn.

    ``fd``: an open descriptor of the file (see ``aiogguf.io.opener``) to read through
    instead of opening ``path``, which then only names the file in messages. The
    ``DataFile`` keeps a duplicate; the caller still closes ``fd``.

    Raises ``LoadError`` if the file cannot be opened.
    """
    return DataFile(path, direct=direct, alignment=alignment, fd=fd)


class DataFile(Closeable):
    """An open model file: positional reads into caller-owned memory (the local
    ``ByteSource``, and a ``DirectSource``: ``aiogguf.io.source``). Use ``open_file``."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        direct: bool,
        alignment: int = DIRECT_ALIGNMENT,
        fd: int | None = None,
    ) -> None:
        if alignment <= 0 or alignment % 512:
            raise ValueError(f"alignment must be a positive multiple of 512, got {alignment}")
        self.path: str = os.fspath(path)
        self.alignment = alignment
        self.direct_requested = direct
        self.direct_refusal: str | None = None
        self._lock = threading.Lock()
        self._inflight = 0
        self._direct_fd: int | None = None
        self._direct_enabled = False
        # An adopted descriptor was opened once under a policy (the server's roots):
        # from here on the file is reached through it, never through its name.
        self._adopted = fd is not None
        if fd is not None:
            with os_errors(self.path, None, "cannot open"):
                self._fd: int = os.dup(fd)
        else:
            self._fd = open_readable(self.path)
        self._state = ResourceState.OPEN
        try:
            self._opened = os.fstat(self._fd)
            self.size_bytes: int = self._opened.st_size
            if direct:
                # /proc/self/fd/N reopens the inode that N refers to, not whatever the
                # name points at now: O_DIRECT needs a new open file description of its own.
                source = f"/proc/self/fd/{self._fd}" if self._adopted else self.path
                self._direct_fd, self.direct_refusal = _open_direct(source, self.path, alignment)
                self._direct_enabled = self._direct_fd is not None
        except BaseException:
            self.close()
            raise

    # -- what a load does with it (``ByteSource``) -------------------------------

    local = True  # read by system calls, from a disk of this machine
    piece_bytes: int | None = None  # the read stage's default

    @property
    def direct_ok(self) -> bool:
        """True while ``read_direct_into`` really uses ``O_DIRECT``."""
        return self._direct_enabled

    @property
    def direct(self) -> DataFile | None:
        """Itself while its reads bypass the page cache, else None."""
        return self if self._direct_enabled else None

    @property
    def mappable(self) -> DataFile:
        return self

    def disk(self) -> str:
        """The filesystem device it lives on (a ``stat``)."""
        dev = os.fstat(self.fileno()).st_dev
        return f"dev {os.major(dev)}:{os.minor(dev)}"

    # -- lifecycle ---------------------------------------------------------------

    def fileno(self) -> int:
        """The buffered descriptor (for ``mmap`` or ``fadvise``); valid until ``close``."""
        if self._state is ResourceState.CLOSED:
            raise ClosedResourceError(repr(self))
        return self._fd

    def close(self) -> None:
        """Close the descriptors (now, or when the last in-flight read ends); idempotent."""
        with self._lock:
            if self._state is ResourceState.CLOSED:
                return
            self._state = ResourceState.CLOSED
            if self._inflight:
                return  # the last reader closes them in _leave()
        self._close_fds()

    def _close_fds(self) -> None:
        fds = [self._fd, self._direct_fd]
        self._direct_fd = None
        for fd in fds:
            if fd is not None:
                os.close(fd)

    def _enter(self) -> None:
        with self._lock:
            if self._state is ResourceState.CLOSED:
                raise ClosedResourceError(repr(self))
            self._inflight += 1

    def _leave(self) -> None:
        with self._lock:
            self._inflight -= 1
            last = self._inflight == 0 and self._state is ResourceState.CLOSED
        if last:
            self._close_fds()

    def __repr__(self) -> str:
        mode = "direct" if self.direct_ok else "buffered"
        return f"<DataFile {self.path!r} {mode} state={self._state.value}>"

    # -- reads -------------------------------------------------------------------

    def read_into(self, dest: Buffer, offset: int, *, max_call: int = MAX_CALL_BYTES) -> None:
        """Fill all of ``dest`` with the file bytes at ``[offset, offset + len(dest))``,
        in read calls of at most ``max_call`` bytes.

        Short reads are continued; ``EINTR`` is retried. No alignment is required.

        Raises ``LoadError`` if the file ends first (naming where it ended and how many
        bytes were expected) or if the read fails; ``ClosedResourceError`` after close;
        ``ValueError`` if ``dest`` is read-only or ``offset`` negative.
        """
        view = _writable_bytes(dest)
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        self._enter()
        try:
            calls = max_call or MAX_CALL_BYTES  # 0: the default, as ``ByteSource`` says
            done = _pread_loop(self._fd, view, offset, self.path, max_call=calls)
        finally:
            self._leave()
        if done < len(view):
            raise LoadError(
                self.path,
                offset,
                f"file ended at byte {offset + done}, expected {len(view)} bytes "
                f"(up to byte {offset + len(view)})",
            )

    def read_direct_into(
        self, dest: Buffer, offset: int, length: int | None = None, *, need_end: int | None = None
    ) -> int:
        """Read ``length`` bytes (default all of ``dest``) at ``offset`` with ``O_DIRECT``.

        ``offset``, ``length`` and the address of ``dest`` must be multiples of
        ``alignment`` — checked even after a fallback, so alignment bugs show up on every
        filesystem. The read may end early only at the end of the file: the last block is
        read whole and comes back short. Returns the bytes read, which is
        ``min(length, size_bytes - offset)``. Without ``O_DIRECT`` (``direct_ok`` False)
        the same read is done buffered. ``need_end`` (an absolute file offset) lowers or
        raises the bar: the read fails unless it reached ``min(need_end, offset+length)``.

        Raises ``LoadError`` if the file is shorter than it was at open or a read fails;
        ``ValueError`` on misalignment; ``ClosedResourceError`` after close.
        """
        view = _writable_bytes(dest)
        if length is None:
            length = len(view)
        if not 0 <= length <= len(view):
            raise ValueError(f"length {length} does not fit in a {len(view)}-byte buffer")
        view = view[:length]
        a = self.alignment
        if offset < 0 or offset % a or length % a or (length and buffer_address(view) % a):
            raise ValueError(
                f"O_DIRECT read needs offset, length and address aligned to {a} bytes: "
                f"offset={offset}, length={length}, address%{a}="
                f"{buffer_address(view) % a if length else 0}"
            )
        end = offset + length if need_end is None else min(need_end, offset + length)
        if need_end is None:
            end = min(end, self.size_bytes)
        expected = max(0, end - offset)
        self._enter()
        try:
            done = self._direct_loop(view, offset)
        finally:
            self._leave()
        if done < expected:
            raise LoadError(
                self.path,
                offset,
                f"file ended at byte {offset + done}, expected {expected} bytes "
                f"(up to byte {offset + expected}; the file was {self.size_bytes} bytes "
                f"when opened)",
            )
        return done

    def _direct_loop(self, view: builtins.memoryview, offset: int) -> int:
        fd = self._direct_fd
        if fd is None or not self._direct_enabled:
            return _pread_loop(self._fd, view, offset, self.path)
        try:
            # One call for the whole chunk: the device then gets it as many requests in
            # flight at once, and the thread sleeps on the disk rather than burning CPU.
            done = _pread_loop(
                fd, view, offset, self.path, stop_unaligned=self.alignment, max_call=len(view) or 1
            )
        except LoadError as exc:
            if not isinstance(exc.__cause__, OSError) or exc.__cause__.errno != errno.EINVAL:
                raise
            # The probe passed, yet this aligned read was refused: give up on O_DIRECT
            # for this file (direct_ok turns False) and do the same read buffered.
            # The descriptor stays open until close(): another thread may be using it.
            self.direct_refusal = f"an O_DIRECT read was refused ({exc.__cause__.strerror})"
            self._direct_enabled = False
            return _pread_loop(self._fd, view, offset, self.path)
        if done < len(view) and done % self.alignment and offset + done < self.size_bytes:
            # A short direct read that stopped mid-block and not at EOF (rare: signals,
            # some network filesystems). O_DIRECT cannot continue from an unaligned
            # offset, so finish buffered.
            done += _pread_loop(self._fd, view[done:], offset + done, self.path)
        return done

    def check_unchanged(self) -> None:
        """Raise ``LoadError`` if the file changed since it was opened.

        Asked of the open descriptor (``fstat``), never of the path: the path may lead
        elsewhere now (a root symlink repointed, a ``..`` after a symlink), and a load
        held to its roots must not look a name up outside them. Changed means: its size
        differs (truncated or extended), its modification or status-change time differs
        (rewritten in place: the status-change time also moves when the modification
        time is set back with ``utime``), or it has no name left (deleted, or replaced
        by a rename over it). A file that had no name when it was opened (an anonymous
        ``memfd`` an opener serves) cannot lose one. Blocking (one ``fstat``).
        """
        self._enter()
        try:
            with os_errors(self.path, None, "cannot stat the open file"):
                now = os.fstat(self._fd)
        finally:
            self._leave()
        was = self._opened
        if now.st_size != was.st_size:
            raise LoadError(
                self.path,
                min(now.st_size, was.st_size),
                f"the file changed during the load: it was {was.st_size} bytes, now {now.st_size}",
            )
        if was.st_nlink and not now.st_nlink:
            raise LoadError(self.path, None, "the file was deleted or replaced during the load")
        if (now.st_mtime_ns, now.st_ctime_ns, now.st_ino, now.st_dev) != (
            was.st_mtime_ns,
            was.st_ctime_ns,
            was.st_ino,
            was.st_dev,
        ):
            raise LoadError(self.path, 0, "the file was modified during the load")

    # -- hints -------------------------------------------------------------------

    def fadvise(self, advice: FileAdvice, offset: int = 0, length: int = 0) -> None:
        """``posix_fadvise`` on ``[offset, offset + length)``; ``length=0`` = to the end.

        Raises ``LoadError`` if the kernel rejects the hint.
        """
        self._enter()
        try:
            with os_errors(self.path, offset, f"posix_fadvise({advice.name}) failed"):
                os.posix_fadvise(self._fd, offset, length, advice.value)
        finally:
            self._leave()


def _writable_bytes(dest: Buffer) -> builtins.memoryview:
    view = builtins.memoryview(dest)
    if view.readonly:
        raise ValueError("destination buffer is read-only")
    if not view.c_contiguous:
        raise ValueError("destination buffer is not C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _open_direct(source: str, path: str, alignment: int) -> tuple[int | None, str | None]:
    """Blocking: an ``O_DIRECT`` descriptor of ``source`` (``path``'s file), or None and
    why the filesystem refuses it."""
    try:
        fd = open_readable(source, os.O_DIRECT)
    except LoadError as exc:
        cause = exc.__cause__
        if not isinstance(cause, OSError) or cause.errno != errno.EINVAL:
            raise
        return None, f"the filesystem refuses O_DIRECT at open ({cause.strerror})"
    # Some filesystems accept the flag and fail the first read instead: probe one
    # aligned block now, so direct_ok is settled before the caller's first read.
    import mmap  # local: only the probe needs an aligned scratch page

    try:
        with os_errors(path, None, "out of host memory"):
            scratch = mmap.mmap(-1, alignment)
    except LoadError:
        os.close(fd)
        raise
    try:
        os.preadv(fd, [scratch], 0)
    except OSError as exc:
        os.close(fd)
        if exc.errno != errno.EINVAL:
            raise from_os_error(exc, path, 0, "O_DIRECT probe read failed") from exc
        return None, f"the filesystem refuses O_DIRECT reads ({exc.strerror})"
    finally:
        scratch.close()
    return fd, None


def _pread_loop(
    fd: int,
    view: builtins.memoryview,
    offset: int,
    path: str,
    stop_unaligned: int = 0,
    max_call: int = MAX_CALL_BYTES,
) -> int:
    """``preadv`` of ``path``'s ``fd`` until ``view`` is full or EOF, ``max_call`` bytes
    at a time; returns the bytes read."""
    done = 0
    total = len(view)
    while done < total:
        try:
            n = os.preadv(fd, [view[done : done + max_call]], offset + done)
        except InterruptedError:
            continue  # PEP 475 retries EINTR already; kept for non-CPython runtimes
        except OSError as exc:
            doing = f"read of {total - done} bytes failed"
            raise from_os_error(exc, path, offset + done, doing) from exc
        if n == 0:
            break  # end of file
        done += n
        if stop_unaligned and done % stop_unaligned and done < total:
            break
    return done
