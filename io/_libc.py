"""ctypes bindings for the few memory calls the standard library does not offer well.

``mlock``, ``mlock2``, ``munlock``, ``mincore`` and ``openat2`` have no stdlib wrapper at
all.
``madvise`` has one (``mmap.madvise``) but it holds the GIL for the whole call, and
``MADV_WILLNEED`` or ``MADV_POPULATE_READ`` on a large range can take long enough to
stall the event loop; ctypes releases the GIL around every foreign call, so we call libc directly.

Each function raises ``OSError`` with the C ``errno`` on failure; callers translate it to
``LoadError`` at their own boundary, where the path and offset are known.
"""

from __future__ import annotations

import ctypes
import os
import platform
from errno import ENOSYS

__all__ = [
    "MADV_HUGEPAGE",
    "MADV_POPULATE_READ",
    "MADV_POPULATE_WRITE",
    "MLOCK_ONFAULT",
    "RESOLVE_BENEATH",
    "RESOLVE_NO_MAGICLINKS",
    "madvise",
    "mincore",
    "mlock",
    "mlock2",
    "munlock",
    "openat2",
]

# Linux ≥ 5.14 (<linux/mman.h>); Python 3.11's mmap module does not export them.
MADV_POPULATE_READ = 22
MADV_POPULATE_WRITE = 23
# <asm-generic/mman-common.h>, the same on every architecture; exported by mmap only
# where the build's headers had it.
MADV_HUGEPAGE = 14
# mlock2(2) flag (Linux >= 4.4): lock pages as they are faulted in, none now.
MLOCK_ONFAULT = 1

# The symbols the process has loaded, libc's among them: ``ctypes.util.find_library("c")``
# would start ``ldconfig -p`` (a fork and exec) at every ``import aiogguf``.
_libc = ctypes.CDLL(None, use_errno=True)

_mlock = _libc.mlock
_mlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_mlock.restype = ctypes.c_int

# glibc >= 2.27; None before.
_mlock2 = getattr(_libc, "mlock2", None)
if _mlock2 is not None:
    _mlock2.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    _mlock2.restype = ctypes.c_int

_munlock = _libc.munlock
_munlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_munlock.restype = ctypes.c_int

_madvise = _libc.madvise
_madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_madvise.restype = ctypes.c_int

_mincore = _libc.mincore
_mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
_mincore.restype = ctypes.c_int


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def mlock(address: int, length: int) -> None:
    """Lock ``length`` bytes at ``address`` in RAM (faults them in first)."""
    _check(_mlock(address, length), "mlock")


def mlock2(address: int, length: int, flags: int) -> None:
    """``mlock2``: with ``MLOCK_ONFAULT``, lock the range's pages as they are faulted in.

    Raises ``OSError`` with ``ENOSYS`` where the C library or the kernel lacks it."""
    if _mlock2 is None:
        raise OSError(ENOSYS, f"mlock2: {os.strerror(ENOSYS)}")
    _check(_mlock2(address, length, flags), "mlock2")


def munlock(address: int, length: int) -> None:
    """Undo ``mlock`` on the range; unlocking pages that are not locked is harmless."""
    _check(_munlock(address, length), "munlock")


def madvise(address: int, length: int, advice: int) -> None:
    """``madvise(2)`` without holding the GIL; ``address`` must be page-aligned."""
    _check(_madvise(address, length, advice), "madvise")


def mincore(address: int, length: int) -> bytearray:
    """One byte per page of the page-aligned range; bit 0 set = page resident."""
    pagesize = os.sysconf("SC_PAGE_SIZE")
    vector = bytearray((length + pagesize - 1) // pagesize)
    if not vector:
        return vector
    c_vector = (ctypes.c_ubyte * len(vector)).from_buffer(vector)
    try:
        _check(_mincore(address, length, c_vector), "mincore")
    finally:
        # Drop the ctypes export so the bytearray can be used (and resized) freely.
        del c_vector
    return vector


# openat2(2), Linux >= 5.6: the same number on x86_64 and aarch64 (asm-generic).
_SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437}.get(platform.machine())
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_BENEATH = 0x08


class _OpenHow(ctypes.Structure):
    _fields_ = (
        ("flags", ctypes.c_uint64),
        ("mode", ctypes.c_uint64),
        ("resolve", ctypes.c_uint64),
    )


_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


def openat2(dirfd: int, path: str, flags: int, resolve: int) -> int:
    """``openat2(dirfd, path, {flags, 0, resolve})``: a new descriptor.

    Raises ``OSError`` with ``ENOSYS`` where the kernel or the architecture lacks it.
    """
    if _SYS_OPENAT2 is None:
        raise OSError(ENOSYS, f"openat2: {os.strerror(ENOSYS)}")
    how = _OpenHow(flags, 0, resolve)
    fd = _syscall(
        ctypes.c_long(_SYS_OPENAT2),
        ctypes.c_int(dirfd),
        ctypes.c_char_p(os.fsencode(path)),
        ctypes.byref(how),
        ctypes.c_size_t(ctypes.sizeof(how)),
    )
    if fd < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"openat2: {os.strerror(errno)}", path)
    return int(fd)
