"""Helpers of the fault-injection suite (tests/test_faults.py): what a process holds, and
seams that make a chosen call of the I/O layer fail or cut the file.

A seam patches a method of a class of ``aiogguf.io`` for the length of a ``with`` block
and counts its calls from every thread; at the chosen call it acts (truncates the file,
raises). ``Holdings`` is what must be the same after a failed load as before it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiogguf.io.files import DataFile
from aiogguf.io.mapping import FileMapping

# The calls through which a load reads file bytes, in every mode: buffered and direct
# reads (none, direct, staging slots, the checks of mapped tensors), and making mapped
# pages resident or locked (mmap, mlock).
READ_CALLS: tuple[tuple[type, str], ...] = (
    (DataFile, "read_into"),
    (DataFile, "read_direct_into"),
    (FileMapping, "touch"),
    (FileMapping, "lock"),
)


@dataclass(frozen=True, slots=True)
class Holdings:
    """What a process holds that a load could leak."""

    fds: frozenset[tuple[int, str]]
    threads: tuple[str, ...]
    maps: int  # /proc/self/maps entries of the watched inodes

    def leaks(self, before: Holdings) -> list[str]:
        """What this holds and ``before`` did not, in words."""
        found = [f"fd {fd} -> {target}" for fd, target in sorted(self.fds - before.fds)]
        extra = sorted(set(self.threads) - set(before.threads))
        found += [f"thread {name}" for name in extra]
        if self.maps > before.maps:
            found.append(f"{self.maps - before.maps} mappings of the file")
        return found


def holdings(inodes: set[int]) -> Holdings:
    """Open descriptors, aiogguf's threads and mappings of ``inodes`` right now."""
    fds: set[tuple[int, str]] = set()
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # the descriptor listdir used
            fds.add((int(name), os.readlink(f"/proc/self/fd/{name}")))
    threads = tuple(sorted(t.name for t in threading.enumerate() if t.name.startswith("aiogguf")))
    maps = 0
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and int(parts[4]) in inodes:
                maps += 1
    return Holdings(frozenset(fds), threads, maps)


class CallSeam:
    """Counts calls of ``READ_CALLS`` (or ``calls``); runs ``act`` just before call
    number ``at`` (1-based) goes on. ``at=0`` only counts."""

    def __init__(
        self,
        act: Callable[[], None],
        at: int,
        calls: tuple[tuple[type, str], ...] = READ_CALLS,
    ) -> None:
        self.act = act
        self.at = at
        self.calls = calls
        self.count = 0
        self.fired = False
        self._lock = threading.Lock()

    def _hit(self) -> bool:
        with self._lock:
            self.count += 1
            fire = self.count == self.at
            if fire:
                self.fired = True
        return fire

    @contextlib.contextmanager
    def installed(self) -> Iterator[CallSeam]:
        saved = [(cls, name, cls.__dict__[name]) for cls, name in self.calls]
        for cls, name, original in saved:
            setattr(cls, name, self._wrap(original))
        try:
            yield self
        finally:
            for cls, name, original in saved:
                setattr(cls, name, original)

    def _wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self._hit():
                self.act()
            return original(*args, **kwargs)

        return wrapper


def copy_file(source: Path, dest: Path) -> None:
    """A fresh copy (a new inode) of ``source``."""
    with open(source, "rb") as fin, open(dest, "wb") as fout:
        while block := fin.read(1 << 20):
            fout.write(block)
