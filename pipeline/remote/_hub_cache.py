"""The hub's own cache, written as an ``hf://`` load streams, and the whole file's digest
checked as it does.

**Layout.** ``huggingface_hub``'s own; where each file lives, how a cached one is found
and how every name is reached without following a link: ``aiogguf.remote._cache_fs``.

**Writing.** Reader threads land ranges out of order; each is written at its offset to
``blobs/<etag>.aiogguf.incomplete`` (the library's ``.incomplete`` suffix, so that
``hf cache`` lists and cleans it; not its old ``<etag>.incomplete``, which an older
``huggingface_hub`` resumes by appending at the file's length: this one has holes).
The blob is committed (renamed into place, linked) only once every byte is there and
the digest matched; the bytes the load does not read (the header's end, padding) are
fetched by the hashing thread.

**Resuming.** Which ranges a partial file holds is recorded after its last byte (a
trailer: magic, length, sha256 of a JSON list of ranges; two slots written in turn, so
that a record torn by a kill leaves the one before), each time a piece is written and
when the load ends unfinished; a range is recorded only once its write returned, and a
read lands request by request, so a process killed keeps all it wrote. A later load
trusts exactly those ranges (and reads them from the file instead of the network),
but only under the kernel that wrote them (the record names its boot id): a process
killed loses nothing of what it wrote (the page cache has it), a machine that lost
power may have, and its record is not trusted. So no ``fdatasync`` is needed, and a
cancelled load's close costs a small write, not a flush of gigabytes. A record that
does not check out makes the load start over. Trust is not blind: the whole-file digest
still covers those bytes, and a mismatch removes the file.

**The digest.** The hub's ETag of a large file is its sha256 (a small git file's: its
git blob sha1). One thread per file (``_Tap``) follows the contiguous prefix of the
bytes that have landed, from the partial file or, without a cache, from copies kept in
memory (``PARK_BYTES`` at most; a range past that is fetched again when the prefix gets
there). A mismatch is an ``IntegrityError`` naming the file and both digests, and
nothing is committed. Every wait polls a stop (``POLL_S``); closing the source stops
and joins the thread.

**A full disk.** A write that fails ends the partial file: its name is removed at once
(its space is free when the load closes it) and the load goes on without a cache.
"""

from __future__ import annotations

import builtins
import contextlib
import fcntl
import hashlib
import json
import os
import struct
import threading
import time
from bisect import bisect_left, bisect_right
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiogguf.errors import GGUFError, IntegrityError, LoadError
from aiogguf.io.workers import raise_if_stopped
from aiogguf.remote._cache_fs import PARTIAL_SUFFIX as PARTIAL_SUFFIX
from aiogguf.remote._cache_fs import CacheEntry as CacheEntry
from aiogguf.remote._cache_fs import CacheFolder
from aiogguf.remote._cache_fs import cache_entry as cache_entry
from aiogguf.remote._cache_fs import find_cached as find_cached
from aiogguf.remote._cache_fs import hub_cache_dir as hub_cache_dir
from aiogguf.remote._http_source import HttpSource, RemoteOptions
from aiogguf.remote._hub import COMMIT_HASH, SHA256_HEX

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["CacheEntry", "HubSource", "cache_entry", "find_cached", "hub_cache_dir"]

# A wait for bytes, or for the hashing thread, lasts this long at a time.
POLL_S = 0.25
# Bytes hashed (and fetched, for a gap) at a time.
PIECE_BYTES = 4 << 20
# Without a cache file: the most landed bytes kept for the hash ahead of its prefix.
PARK_BYTES = 1 << 30
# Where a write is not known to survive a crash of the machine unless synced (no boot
# id to tell a reboot by), how often a partial file's record is synced and written.
RECORD_S = 5.0
_TRAILER_MAGIC = b"AIOGGPR1"
_TRAILER = struct.Struct("<8sQ32s")
_MAX_RECORD_BYTES = 1 << 20
# The record's two slots after the file's end, written in turn: a record torn by a kill
# leaves the other one whole.
_SLOT_BYTES = _TRAILER.size + _MAX_RECORD_BYTES


# --- the digest -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Digest:
    """The digest the hub gives for a file: ``sha256``, or ``git-sha1`` (a git blob)."""

    kind: str
    hexdigest: str

    @classmethod
    def of_etag(cls, etag: str | None) -> Digest | None:
        if etag and SHA256_HEX.fullmatch(etag):
            return cls("sha256", etag)
        if etag and COMMIT_HASH.fullmatch(etag):
            return cls("git-sha1", etag)
        return None

    def start(self, size: int) -> Any:
        if self.kind == "sha256":
            return hashlib.sha256()
        hasher = hashlib.sha1(usedforsecurity=False)
        hasher.update(b"blob %d\0" % size)
        return hasher


class _Ranges:
    """Disjoint, sorted byte ranges ``[start, end)``; adding merges."""

    def __init__(self, pairs: Iterable[tuple[int, int]] = ()) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        for lo, hi in pairs:
            self.add(lo, hi)

    def add(self, lo: int, hi: int) -> None:
        if hi <= lo:
            return
        i = bisect_left(self._ends, lo)
        j = bisect_right(self._starts, hi)
        if i < j:
            lo, hi = min(lo, self._starts[i]), max(hi, self._ends[j - 1])
        self._starts[i:j] = [lo]
        self._ends[i:j] = [hi]

    def run_end(self, at: int) -> int:
        """The end of the range holding byte ``at``; ``at`` when none does."""
        i = bisect_right(self._starts, at) - 1
        return self._ends[i] if i >= 0 and self._ends[i] > at else at

    def next_start(self, at: int, default: int) -> int:
        """The first start after ``at``, else ``default``."""
        i = bisect_right(self._starts, at)
        return self._starts[i] if i < len(self._starts) else default

    def pairs(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._ends, strict=True))

    def total(self) -> int:
        return sum(e - s for s, e in zip(self._starts, self._ends, strict=True))


def _boot_id() -> str:
    """This boot's id (Linux); empty where there is none."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _pwrite_all(fd: int, view: builtins.memoryview, offset: int) -> None:
    while view:
        done = os.pwrite(fd, view, offset)
        view, offset = view[done:], offset + done


def _pread_all(fd: int, view: builtins.memoryview, offset: int, name: str) -> None:
    while view:
        got = os.preadv(fd, [view], offset)
        if not got:
            raise LoadError(name, offset, "the cache's partial file ended early")
        view, offset = view[got:], offset + got


# --- the source -------------------------------------------------------------------------


class HubSource(HttpSource):
    """An ``HttpSource`` of a hub file whose digest is known: what it reads is hashed in
    file order as it lands and, with a cache ``entry``, written to the partial file (the
    ranges already there are read from it). ``finish`` waits for the verdict and commits
    the blob; ``close`` stops the hashing and records what a later load may resume."""

    def __init__(
        self,
        url: str,
        options: RemoteOptions,
        *,
        name: str,
        size: int | None,
        digest: Digest,
        entry: CacheEntry | None,
    ) -> None:
        super().__init__(url, options, name=name)
        try:
            if size is not None and self.size_bytes != size:
                raise LoadError(
                    name, None, f"the hub says {size} bytes, its file has {self.size_bytes}"
                )
            self._tap = _Tap(self, digest, entry)
        except BaseException:
            super().close()
            raise

    @property
    def cached_bytes(self) -> int:
        """Bytes of the file the partial file held when the load began (resumed)."""
        return self._tap.resumed

    def read_into(self, dest: Buffer, offset: int, *, max_call: int = 0) -> None:
        view = builtins.memoryview(dest).cast("B")
        tap = getattr(self, "_tap", None)
        if tap is None:
            super().read_into(view, offset)
            return
        step = max(self.options.request_bytes, 1)
        for lo, hi, cached in tap.split(offset, offset + len(view)):
            if cached:
                tap.read_cached(view[lo - offset : hi - offset], lo)
                continue
            # Request by request, as ``HttpSource`` asks: each lands (and is recorded)
            # as it comes, so a load killed mid-read keeps all but its last requests.
            for at in range(lo, hi, step):
                part = view[at - offset : min(at + step, hi) - offset]
                super().read_into(part, at)
                tap.landed(part, at)

    def read_upto(self, offset: int, nbytes: int) -> bytes:
        """The header parse's reads come from the network (the first request's bytes, then
        ranged reads), never from a partial file: a spoiled byte there would fail the
        parse before the digest could tell."""
        data = super().read_upto(offset, nbytes)
        if data:
            self._tap.landed(builtins.memoryview(data), offset)
        return data

    def fetch(self, view: builtins.memoryview, offset: int) -> None:
        """The network's bytes, never the cache's (the hashing thread's gaps)."""
        super().read_into(view, offset)

    def expect(self, ranges: Iterable[tuple[int, int]]) -> None:
        """The ranges the load's reads will land: the rest is fetched for the digest."""
        self._tap.expect(ranges)

    def finish(self) -> None:
        """Blocking: wait for the whole file's digest; ``IntegrityError`` if it differs
        from the hub's; the blob committed to the cache."""
        self._tap.finish()

    def close(self) -> None:
        super().close()
        tap = getattr(self, "_tap", None)
        if tap is not None:
            tap.close()


class _PartialFile:
    """A cache entry's partial file, its lock held: written at any offset, the ranges
    it holds recorded after its end, renamed into place and linked once verified.
    Every name is reached from the cache's folders' descriptors (``CacheFolder``)."""

    def __init__(
        self,
        entry: CacheEntry,
        fd: int,
        lock_fd: int,
        folders: tuple[CacheFolder, CacheFolder],
        size: int,
        digest: Digest,
    ) -> None:
        self.entry, self._fd, self._lock_fd = entry, fd, lock_fd
        self._storage, self._blobs = folders
        self._size, self._digest = size, digest
        self._seq = 0  # the last record's number: the higher of the two slots wins
        self.boot = _boot_id()

    @classmethod
    def open(cls, entry: CacheEntry, size: int, digest: Digest) -> _PartialFile | None:
        """Take the entry's lock and open its partial file; None without the lock
        (another process writes it), or where the cache cannot be written. Raises
        ``LoadError`` for a link planted in the cache."""
        try:
            root = CacheFolder.open_root(entry.root, create=True)
        except OSError:
            return None
        with root, contextlib.ExitStack() as held:
            try:
                with root.folder([".locks", entry.folder_name], create=True) as locks:
                    lock_fd = locks.open_file(entry.lock_name, os.O_RDWR | os.O_CREAT, 0o664)
                held.callback(os.close, lock_fd)
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                storage = held.enter_context(root.folder([entry.folder_name], create=True))
                blobs = held.enter_context(storage.folder(["blobs"], create=True))
                if blobs.lstat(entry.etag) is not None:
                    return None  # committed meanwhile: nothing to write
                try:
                    fd = blobs.open_file(entry.partial_name, os.O_RDWR, only_link=True)
                except FileNotFoundError:
                    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
                    fd = blobs.open_file(entry.partial_name, flags, 0o666)
                held.callback(os.close, fd)
            except OSError:
                return None
            with contextlib.suppress(OSError):  # as the library does: for backup tools
                tag = root.open_file("CACHEDIR.TAG", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
                try:
                    os.write(tag, b"Signature: 8a477f597d28d172789f06886806bc55\n")
                finally:
                    os.close(tag)
            held.pop_all()
        return cls(entry, fd, lock_fd, (storage, blobs), size, digest)

    def resumable(self) -> list[tuple[int, int]]:
        """The ranges the file's record vouches for; none (and the file emptied) when
        it has no record that checks out."""
        best: tuple[int, list[tuple[int, int]]] | None = None
        for slot in (0, 1):
            found = self._read_record(slot)
            if found is not None and (best is None or found[0] > best[0]):
                best = found
        if best is None:
            os.ftruncate(self._fd, 0)
            return []
        self._seq = best[0]
        return best[1]

    def _read_record(self, slot: int) -> tuple[int, list[tuple[int, int]]] | None:
        """``(number, ranges)`` of the record in ``slot``, if it checks out."""
        at = self._size + slot * _SLOT_BYTES
        try:
            head = os.pread(self._fd, _TRAILER.size, at)
            magic, length, check = _TRAILER.unpack(head)
            if magic != _TRAILER_MAGIC or length > _MAX_RECORD_BYTES:
                return None
            payload = os.pread(self._fd, length, at + _TRAILER.size)
            if len(payload) != length or hashlib.sha256(payload).digest() != check:
                return None
            record = json.loads(payload)
            pairs = [(int(lo), int(hi)) for lo, hi in record["ranges"]]
            number = int(record.get("seq", 0))
        except (OSError, struct.error, ValueError, KeyError, TypeError):
            return None
        expected = {"size": self._size, "digest": self._digest.hexdigest, "boot": self.boot}
        if any(record.get(key) != value for key, value in expected.items()):
            return None
        if any(not 0 <= lo < hi <= self._size for lo, hi in pairs):
            return None
        return number, pairs

    def write(self, view: builtins.memoryview, offset: int) -> None:
        _pwrite_all(self._fd, view, offset)

    def read(self, view: builtins.memoryview, offset: int, name: str) -> None:
        _pread_all(self._fd, view, offset, name)

    def record(self, pairs: list[tuple[int, int]]) -> None:
        """Record ``pairs`` (written before) after the file's end, for this boot, in the
        slot the last record did not use."""
        if not self.boot:  # no boot id to tell a reboot by: the data made durable first
            os.fdatasync(self._fd)
        record = {"size": self._size, "digest": self._digest.hexdigest, "boot": self.boot}
        payload = json.dumps({**record, "seq": self._seq + 1, "ranges": pairs}).encode()
        if len(payload) > _MAX_RECORD_BYTES:
            return  # the last record stands: it vouches for less, all of it true
        self._seq += 1
        head = _TRAILER.pack(_TRAILER_MAGIC, len(payload), hashlib.sha256(payload).digest())
        at = self._size + (self._seq % 2) * _SLOT_BYTES
        _pwrite_all(self._fd, builtins.memoryview(head + payload), at)

    def commit(self) -> None:
        """The verified file renamed into place and linked: complete, or absent. Raises
        ``OSError``, or ``LoadError`` for a link planted in the snapshot's way."""
        os.ftruncate(self._fd, self._size)  # the records go
        self._blobs.replace(self.entry.partial_name, self.entry.etag)
        self.entry.link(self._storage)

    def remove(self) -> None:
        """The partial file's name removed (its space is free once it is closed)."""
        with contextlib.suppress(OSError):
            self._blobs.remove(self.entry.partial_name)

    def close(self) -> None:
        """Close the file and the folders, and release the lock with its descriptor."""
        for fd in (self._fd, self._lock_fd):
            if fd >= 0:
                os.close(fd)
        self._fd = self._lock_fd = -1
        self._blobs.close()
        self._storage.close()


class _Tap:
    """The digest of one file, in file order, on a thread of its own, and the partial
    file of its cache entry (None when there is none, or it cannot be written)."""

    def __init__(self, source: HubSource, digest: Digest, entry: CacheEntry | None) -> None:
        self._source, self._digest, self._size = source, digest, source.size_bytes
        self._cond = threading.Condition()
        self._written = _Ranges()  # in the partial file, trusted
        self._landed = _Ranges()  # landed by this load, or resumed
        self._planned: _Ranges | None = None
        self._parked: dict[int, bytes] = {}
        self._parked_bytes = 0
        self._hashed = 0
        self._stop = threading.Event()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._verified = self._committed = False
        self._record_lock = threading.Lock()  # one record written at a time, the newest last
        self._recorded = time.monotonic()
        self._file = _PartialFile.open(entry, self._size, digest) if entry else None
        self._writing = self._file is not None  # False after a write failed
        try:
            try:
                resumed = self._file.resumable() if self._file is not None else []
            except OSError:
                resumed = []
                self._write_failed()
            for lo, hi in resumed:
                self._written.add(lo, hi)
                self._landed.add(lo, hi)
            self.resumed = self._written.total()
            self._thread = threading.Thread(
                target=self._run, name=f"aiogguf-hub-hash {source.path}", daemon=True
            )
            self._thread.start()
        except BaseException:
            if self._file is not None:
                self._file.close()
            raise

    # -- the readers' side -------------------------------------------------------------

    def split(self, lo: int, hi: int) -> list[tuple[int, int, bool]]:
        """``[lo, hi)`` cut into parts the partial file holds (True) and the rest."""
        parts: list[tuple[int, int, bool]] = []
        with self._cond:
            at = lo
            while at < hi:
                end = min(self._written.run_end(at), hi)
                if end > at:
                    parts.append((at, end, True))
                else:
                    end = min(self._written.next_start(at, hi), hi)
                    parts.append((at, end, False))
                at = end
        return parts

    def read_cached(self, view: builtins.memoryview, offset: int) -> None:
        assert self._file is not None  # only ranges it holds are read from it
        self._file.read(view, offset, self._source.path)

    def landed(self, view: builtins.memoryview, offset: int) -> None:
        """Bytes the network gave at ``offset``: written to the partial file, or kept
        for the digest while there is room (or when the digest is up to them)."""
        end = offset + len(view)
        if self._writing and self._file is not None:
            try:
                # In pieces: a write waits while the kernel flushes (seconds for a job,
                # on a slow disk), and a stopped load stops between two.
                for lo in range(offset, end, PIECE_BYTES):
                    raise_if_stopped()
                    hi = min(lo + PIECE_BYTES, end)
                    self._file.write(view[lo - offset : hi - offset], lo)
                    self._wrote(lo, hi)
                return
            except OSError:
                self._write_failed()  # a full disk: the load goes on without a cache
        with self._cond:
            at = self._hashed
            keep = end > at and (offset <= at or self._parked_bytes + len(view) <= PARK_BYTES)
            if keep:
                self._parked_bytes += end - max(offset, at)
        data = bytes(view[max(0, at - offset) :]) if keep else b""
        with self._cond:
            if keep:
                self._parked[max(offset, at)] = data
            self._landed.add(offset, end)
            self._cond.notify_all()

    def expect(self, ranges: Iterable[tuple[int, int]]) -> None:
        planned = _Ranges(ranges)
        with self._cond:
            self._planned = planned
            self._cond.notify_all()

    # -- the hashing thread ------------------------------------------------------------

    def _run(self) -> None:
        try:
            hasher = self._digest.start(self._size)
            scratch = builtins.memoryview(bytearray(PIECE_BYTES))
            while self._hashed < self._size:
                if self._stop.is_set():
                    return
                piece = self._next_piece(scratch)
                if piece is None:
                    continue
                hasher.update(piece)
                with self._cond:
                    self._hashed += len(piece)
                    self._drop_parked()
            got = hasher.hexdigest()
            if got != self._digest.hexdigest:
                raise IntegrityError(
                    (),
                    self._source.path,
                    f"the file's {self._digest.kind} is {got}, the hub's is "
                    f"{self._digest.hexdigest}: nothing was cached",
                )
            self._verified = True
        except BaseException as exc:  # the load's verdict, given by ``finish``
            self._error = exc
        finally:
            self._done.set()

    def _next_piece(self, scratch: builtins.memoryview) -> builtins.memoryview | None:
        """The bytes at the digest's prefix: kept in memory, in the partial file, or
        fetched (a gap no read lands, or bytes that found no room); None after a wait."""
        at = self._hashed
        with self._cond:
            for start, data in self._parked.items():
                if start <= at < start + len(data):
                    return builtins.memoryview(data)[at - start : at - start + PIECE_BYTES]
            end = min(self._written.run_end(at), at + PIECE_BYTES)
            in_file = end > at
            if not in_file:
                planned = self._planned
                if planned is None or (planned.run_end(at) > at and self._landed.run_end(at) == at):
                    self._cond.wait(POLL_S)  # a read will land it
                    return None
                landed_end = self._landed.run_end(at)
                end = landed_end if landed_end > at else planned.next_start(at, self._size)
                end = min(end, self._written.next_start(at, self._size), at + PIECE_BYTES)
        view = scratch[: end - at]
        if in_file:
            self.read_cached(view, at)
            return view
        self._source.fetch(view, at)
        if self._writing and self._file is not None:
            try:
                self._file.write(view, at)
                self._wrote(at, end)
            except OSError:
                self._write_failed()
        with self._cond:
            self._landed.add(at, end)
        return view

    def _drop_parked(self) -> None:
        at = self._hashed
        for start in [s for s, d in self._parked.items() if s + len(d) <= at]:
            self._parked_bytes -= len(self._parked.pop(start))

    # -- the end -----------------------------------------------------------------------

    def finish(self) -> None:
        with self._cond:
            self._planned = _Ranges()  # every read has landed: the hash fetches the rest
            self._cond.notify_all()
        while not self._done.wait(POLL_S):
            raise_if_stopped()
        if self._error is not None:
            raise self._error
        self._commit()

    def _commit(self) -> None:
        if self._file is None or not self._writing or not self._verified or self._committed:
            return
        with self._cond:
            whole = self._written.total() == self._size
        if not whole:  # every byte hashed was written; this holds, unless a bug
            return
        self._committed = True
        with contextlib.suppress(OSError):  # the cache is an extra: the load stands
            self._file.commit()

    # -- the partial file's record -----------------------------------------------------

    def _wrote(self, lo: int, hi: int) -> None:
        """``[lo, hi)`` is in the partial file: trusted from now on, and recorded at
        once, so that a process killed the next moment loses none of it (where a record
        needs a sync first, no boot id, every ``RECORD_S``)."""
        with self._cond:
            self._written.add(lo, hi)
            self._landed.add(lo, hi)
            self._cond.notify_all()
        assert self._file is not None
        if self._file.boot or time.monotonic() - self._recorded > RECORD_S:
            self._record()

    def _record(self) -> None:
        """Raises ``OSError``: the record could not be written."""
        assert self._file is not None
        with self._record_lock:
            with self._cond:
                pairs = self._written.pairs()
            self._file.record(pairs)
            self._recorded = time.monotonic()

    def _write_failed(self) -> None:
        """A write to the partial file failed (a full disk, a quota): the load goes on
        without it, and its name goes at once, so that the next load does not find the
        disk full of it (its space is free once the load closes it; until then, the
        ranges it holds are still read from it)."""
        self._writing = False
        if self._file is not None:
            self._file.remove()

    def close(self) -> None:
        """Stop and join the hashing thread (the source's connections are closed first,
        so a fetch in flight ends at once); commit a verified file, record what a
        partial one holds, or remove one whose digest differed."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join()
        file = self._file
        if file is None:
            return
        try:
            if self._verified:
                # Not raised from here: the load is over, and a link refused is not
                # followed (``finish`` raised it, when the load got that far).
                with contextlib.suppress(GGUFError):
                    self._commit()
            elif isinstance(self._error, IntegrityError):
                file.remove()
            elif self._writing:
                try:
                    self._record()
                except OSError:
                    self._write_failed()
        finally:
            file.close()
            self._parked.clear()
