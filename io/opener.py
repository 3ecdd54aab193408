"""Opening a load's files once each, under a policy: any path, or only beneath given roots.

A loader that serves other people (``aiogguf serve``) must read only files beneath its
roots, and a symlink swapped between a check and an open must not lead it out of them.
So the policy is applied *while* opening, by a ``FileOpener``, and that one descriptor is
all a load ever reads through: the header parse preads it, the engine's ``DataFile``
duplicates it, mappings duplicate that. Nothing opens the path a second time.

``RootedOpener`` uses ``openat2(root_fd, relpath, RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)``
where the kernel has it (Linux >= 5.6): the kernel itself refuses any step of the walk
that leaves the root (``..``, an absolute or escaping symlink). Elsewhere it opens the
file and then checks where the descriptor really points (``/proc/self/fd/N``): the check
is on the opened file, so a later swap of the path changes nothing.

Every file is opened non-blocking (a FIFO would otherwise hang the open) and must be a
regular file or a block device; anything else is a ``LoadError`` before any byte is read.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol

from aiogguf.errors import LoadError, PathNotAllowedError, from_os_error, os_errors
from aiogguf.io import _libc
from aiogguf.io.files import open_readable, readable_descriptor

__all__ = ["AnyPathOpener", "FileOpener", "OpenFiles", "RootedOpener"]

_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK


class FileOpener(Protocol):
    """Opens one file for reading under some policy; the caller owns the descriptor."""

    def open(self, path: str) -> int:
        """A new read-only descriptor of ``path``.

        Raises ``PathNotAllowedError`` if the policy refuses ``path``, ``LoadError`` if it
        cannot be opened or is not a regular file (or a block device)."""
        ...


def _no_nul(path: str) -> None:
    # The kernel would read the name only up to the NUL; Python refuses it with a
    # ValueError, which is no GGUFError.
    if "\0" in path:
        raise LoadError(path.replace("\0", "\\0"), None, "a file name cannot hold a NUL byte")


class AnyPathOpener:
    """Any path the process can read (the library's and the CLI's default)."""

    def open(self, path: str) -> int:
        """A read-only descriptor for ``path``, wherever it is."""
        _no_nul(path)
        return open_readable(path)


def _inside(path: str, root: str) -> str | None:
    """``path`` relative to ``root`` when it lies beneath it (both absolute, normalised)."""
    if path == root:
        return ""
    prefix = root.rstrip(os.sep) + os.sep
    return path[len(prefix) :] if path.startswith(prefix) else None


@dataclass(frozen=True, slots=True)
class _Root:
    given: str  # as configured, made absolute and normalised
    real: str  # symlinks resolved: what /proc/self/fd/N shows for a file beneath it
    fd: int  # O_PATH descriptor: the walk starts here, never at the name again


class RootedOpener:
    """Only files beneath ``roots`` (directories), with no symlink out of them.

    A path is matched to a root by its text (``os.path.abspath``, no ``~`` expansion), then
    opened relative to that root's descriptor. A path beneath no root, and a walk that
    leaves its root, raise the same ``PathNotAllowedError``, whatever lies outside.

    Holds one descriptor per root: ``close()`` it (or use ``with``). Thread-safe.
    """

    def __init__(self, roots: Sequence[str | os.PathLike[str]]) -> None:
        if not roots:
            raise ValueError("RootedOpener needs at least one root")
        self._roots: list[_Root] = []
        self._openat2: bool | None = None  # unknown until the first open
        try:
            for root in roots:
                given = os.path.abspath(os.fspath(root))
                with os_errors(given, None, "not a usable root"):
                    fd = os.open(given, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
                self._roots.append(_Root(given, os.path.realpath(given), fd))
        except BaseException:
            self.close()
            raise

    @property
    def roots(self) -> tuple[str, ...]:
        return tuple(r.given for r in self._roots)

    def close(self) -> None:
        """Close the roots' descriptors; idempotent."""
        roots, self._roots = self._roots, []
        for root in roots:
            os.close(root.fd)

    def __enter__(self) -> RootedOpener:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def open(self, path: str) -> int:
        """A read-only descriptor for ``path``, refused unless it lies beneath one of
        the roots (no link out of them followed)."""
        _no_nul(path)
        full = os.path.abspath(path)
        for root in self._roots:
            relative = _inside(full, root.given)
            if relative is None:
                relative = _inside(full, root.real)
            if relative is not None:
                return self._open_beneath(root, relative or ".", path)
        raise PathNotAllowedError(path)

    def _open_beneath(self, root: _Root, relative: str, path: str) -> int:
        if self._openat2 is not False:
            try:
                fd = _libc.openat2(
                    root.fd,
                    relative,
                    _FLAGS,
                    _libc.RESOLVE_BENEATH | _libc.RESOLVE_NO_MAGICLINKS,
                )
            except OSError as exc:
                # ENOSYS: an older kernel; EPERM: a seccomp filter that does not know it.
                if exc.errno not in (errno.ENOSYS, errno.EPERM):
                    if exc.errno == errno.EXDEV:  # the walk tried to leave the root
                        raise PathNotAllowedError(path) from None
                    raise from_os_error(exc, path, None, "cannot read the file") from exc
                self._openat2 = False
            else:
                self._openat2 = True
                return readable_descriptor(fd, path)
        return self._open_and_verify(root, relative, path)

    def _open_and_verify(self, root: _Root, relative: str, path: str) -> int:
        try:
            fd = os.open(relative, _FLAGS, dir_fd=root.fd)
        except OSError as exc:
            # Only a file beneath the root may be said to be missing or unreadable: a
            # symlink to a missing file outside must read like one to a present file.
            where = os.path.realpath(os.path.join(root.real, relative))
            if _inside(where, root.real) is None:
                raise PathNotAllowedError(path) from None
            raise from_os_error(exc, path, None, "cannot read the file") from exc
        try:
            real = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            real = ""  # no /proc: nothing proves the file is inside
        if _inside(real, root.real) is None:
            os.close(fd)
            raise PathNotAllowedError(path)
        return readable_descriptor(fd, path)


class OpenFiles:
    """The descriptors of one load's files: each path opened once by ``opener`` (default
    ``AnyPathOpener``), shared by the stages that read it, and closed together.

    ``open`` may be called from worker threads. Use it as a context manager."""

    def __init__(self, opener: FileOpener | None = None) -> None:
        self._opener: FileOpener = opener if opener is not None else AnyPathOpener()
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._closed = False

    def open(self, path: str | os.PathLike[str]) -> int:
        """The descriptor of ``path``, opened on first use; owned by this table.

        Raises what the opener raises; ``LoadError`` after ``close``."""
        key = os.fspath(path)
        with self._lock:
            self._check_open(key)
            fd = self._fds.get(key)
        if fd is not None:
            return fd
        fd = self._opener.open(key)
        with self._lock:
            try:
                self._check_open(key)
            except BaseException:
                os.close(fd)
                raise
            if key in self._fds:  # another thread opened it meanwhile: keep theirs
                os.close(fd)
                return self._fds[key]
            self._fds[key] = fd
            return fd

    def get(self, path: str | os.PathLike[str]) -> int | None:
        """The descriptor of ``path`` if it was opened, else None."""
        with self._lock:
            return self._fds.get(os.fspath(path))

    def _check_open(self, key: str) -> None:
        if self._closed:
            raise LoadError(key, None, "the load's files are already closed")

    def close(self) -> None:
        """Close every descriptor; idempotent."""
        with self._lock:
            self._closed = True
            fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            os.close(fd)

    def __enter__(self) -> OpenFiles:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
