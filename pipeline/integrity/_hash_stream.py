"""One streaming pass over one file, computing every digest a manifest needs at once.

The file is read once, in order, in reads of ``READ_BYTES`` (whole blocks of the data
section) into a ring of ``RING_SLOTS`` buffers that are reused, so memory stays flat
whatever the model's size. Lanes, each a call on a load thread, share the work:

- the *reader* reads a piece, then hashes it while it is in the CPU's cache: the header
  fingerprint, each block's digest, each tensor's digest (xxh3, many GB/s);
- each *ordered* lane takes the pieces in file order for digests that must see the file
  in sequence: sha256 of the file; llama.cpp's per-tensor digests; its whole-model
  digests. A buffer goes back to the reader once every ordered lane is done with it.

xxhash and hashlib let the GIL go for a large buffer, so the lanes run on separate cores
(sha256, the slowest, runs on one core: it cannot be split).
Both check the load's stop flag between pieces and while they wait for each other, so a
cancelled pass ends within a piece; a lane that fails ends the other one.
"""

from __future__ import annotations

import functools
import hashlib
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

import xxhash

from aiogguf.integrity._llama_hash import LlamaDigests, LlamaHasher, merge_llama
from aiogguf.integrity._manifest import FileHashes, TensorHash, block_digest
from aiogguf.io.source import ByteSource
from aiogguf.io.workers import Stopped, raise_if_stopped

__all__ = ["READ_BYTES", "RING_SLOTS", "FileLayout", "FilePass", "FileResult", "Wanted"]

# One read: 16 MiB reaches a disk's full speed and stays a small part of memory.
READ_BYTES: Final = 16 << 20
RING_SLOTS: Final = 3
# How often a waiting lane looks at the stop flags.
_POLL_S: Final = 0.05


@dataclass(frozen=True, slots=True)
class Wanted:
    """Which digests a pass computes."""

    sha256: bool = True
    blocks: bool = True  # header fingerprint, blocks and tensors (xxh3_128)
    llama: frozenset[str] = frozenset()  # llama-gguf-hash algorithms
    block_bytes: int = READ_BYTES


@dataclass(frozen=True, slots=True)
class FileLayout:
    """What the pass knows of a file: its name (for messages), size, where its data
    section starts and ends, and its tensors (name, start, end), in file order. A file
    hashed whole (sha256 only) has ``header_bytes == data_end == 0`` and no tensors."""

    name: str
    size: int
    header_bytes: int
    data_end: int
    tensors: tuple[tuple[str, int, int], ...]
    file_index: int = 0


@dataclass(frozen=True, slots=True)
class FileResult:
    """The digests of one file (what ``Wanted`` asked for)."""

    file: FileHashes
    tensors: tuple[TensorHash, ...]
    llama: LlamaDigests | None


class _TensorDigests:
    """xxh3_128 of each tensor, from pieces in file order: a tensor inside one piece in
    one call, one that spans pieces through a running state."""

    def __init__(self, tensors: Sequence[tuple[str, int, int]], file_index: int) -> None:
        self._tensors = tensors
        self._file_index = file_index
        self._next = 0
        self._state: xxhash.xxh3_128 | None = None
        self.done: list[TensorHash] = []

    def update(self, offset: int, view: memoryview) -> None:
        end = offset + len(view)
        tensors = self._tensors
        while self._next < len(tensors) and tensors[self._next][1] < end:
            name, start, stop = tensors[self._next]
            lo, hi = max(start, offset), min(stop, end)
            if stop <= end and self._state is None and start >= offset:
                digest = xxhash.xxh3_128_digest(view[lo - offset : hi - offset])
            else:
                if self._state is None:
                    self._state = xxhash.xxh3_128()
                self._state.update(view[lo - offset : hi - offset])
                if stop > end:
                    return  # continues in the next piece
                digest = self._state.digest()
                self._state = None
            self.done.append(TensorHash(name, self._file_index, start, stop - start, digest))
            self._next += 1

    def finish(self) -> None:
        """Tensors of no bytes at the data's end (no piece reaches them)."""
        for name, start, stop in self._tensors[self._next :]:
            self.done.append(
                TensorHash(name, self._file_index, start, stop - start, xxhash.xxh3_128_digest(b""))
            )
        self._next = len(self._tensors)


def _pieces(layout: FileLayout, block_bytes: int) -> list[tuple[int, int]]:
    """The reads, in file order: the header, the data section in whole blocks (several
    per read when blocks are small), the bytes after the data."""
    step_data = block_bytes * max(1, READ_BYTES // block_bytes)
    found: list[tuple[int, int]] = []
    for lo, hi, step in (
        (0, layout.header_bytes, READ_BYTES),
        (layout.header_bytes, layout.data_end, step_data),
        (layout.data_end, layout.size, READ_BYTES),
    ):
        found += [(at, min(step, hi - at)) for at in range(lo, hi, step)]
    return found


class FilePass:
    """Hashes one open file in one pass: run ``read_lane`` and every one of
    ``ordered_lanes`` at once, each on a thread of its own, then take ``result``.
    ``report(nbytes)`` is called once each piece has been through every lane;
    ``stop()`` (any thread) ends every lane soon."""

    def __init__(
        self,
        data: ByteSource,
        layout: FileLayout,
        wanted: Wanted,
        report: Callable[[int], None] | None = None,
    ) -> None:
        self._data = data
        self.layout = layout
        self._wanted = wanted
        self._report = report
        self._pieces = _pieces(layout, wanted.block_bytes)
        size = max((n for _, n in self._pieces), default=0)
        self._buffers = [bytearray(size) for _ in range(min(RING_SLOTS, len(self._pieces)))]
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(len(self._buffers)):
            self._free.put(slot)
        self._stop = threading.Event()  # set: stopped from outside, or a lane failed
        self._header = xxhash.xxh3_128()
        self._blocks: list[bytes] = []
        self._tensors = _TensorDigests(layout.tensors, layout.file_index)
        self._sha256 = hashlib.sha256()
        # The llama digests take two lanes: per tensor, and over the whole model.
        self._llama = [
            LlamaHasher(layout.name, layout.tensors, sorted(wanted.llama), part)
            for part in (("tensors", "model") if wanted.llama else ())
        ]
        consumers: list[Callable[[int, memoryview], None]] = [h.update for h in self._llama]
        if wanted.sha256:
            consumers.append(lambda offset, view: self._sha256.update(view))
        self._consumers = consumers
        self._queues: list[queue.SimpleQueue[tuple[int, int, int] | None]] = [
            queue.SimpleQueue() for _ in consumers
        ]
        # Per slot: the lanes that have yet to release it; guarded by ``_lock``.
        self._holders = [0] * len(self._buffers)
        self._lock = threading.Lock()

    @property
    def ordered_lanes(self) -> list[Callable[[], None]]:
        """The lanes that take the pieces in file order, one blocking call each."""
        return [functools.partial(self._ordered_lane, i) for i in range(len(self._consumers))]

    def stop(self) -> None:
        self._stop.set()

    def _take(
        self, q: queue.SimpleQueue[int] | queue.SimpleQueue[tuple[int, int, int] | None]
    ) -> object:
        """The next item of ``q``; raises ``Stopped`` once the pass is stopped."""
        while True:
            if self._stop.is_set():
                raise Stopped
            raise_if_stopped()
            try:
                return q.get(timeout=_POLL_S)
            except queue.Empty:
                continue

    def read_lane(self) -> None:
        """Blocking: read every piece and hash what can be hashed out of order."""
        try:
            for offset, n in self._pieces:
                slot = self._take(self._free)
                assert isinstance(slot, int)
                view = memoryview(self._buffers[slot])[:n]
                self._data.read_into(view, offset)
                self._hash_in_place(offset, view)
                if not self._queues:
                    self._release(slot, n)
                    continue
                with self._lock:
                    self._holders[slot] = len(self._queues)
                for q in self._queues:
                    q.put((slot, offset, n))
        except Stopped:
            return  # cancelled (the awaiting task says so), or a lane failed (it says why)
        except BaseException:
            self._stop.set()
            raise
        finally:
            for q in self._queues:
                q.put(None)

    def _release(self, slot: int, n: int) -> None:
        """A lane is done with ``slot``: the last one hands it back and reports."""
        with self._lock:
            self._holders[slot] -= 1
            last = self._holders[slot] <= 0
        if last:
            self._free.put(slot)
            if self._report is not None:
                self._report(n)

    def _hash_in_place(self, offset: int, view: memoryview) -> None:
        if not self._wanted.blocks:
            return
        layout = self.layout
        if offset < layout.header_bytes:
            self._header.update(view)
        elif offset < layout.data_end:
            B = self._wanted.block_bytes
            first = (offset - layout.header_bytes) // B
            for k in range(-(-len(view) // B)):
                self._blocks.append(block_digest(view[k * B : (k + 1) * B], first + k))
            self._tensors.update(offset, view)

    def _ordered_lane(self, lane: int) -> None:
        """Blocking: pass each piece, in file order, to consumer ``lane``."""
        consume, q = self._consumers[lane], self._queues[lane]
        try:
            while (item := self._take(q)) is not None:
                assert isinstance(item, tuple)
                slot, offset, n = item
                consume(offset, memoryview(self._buffers[slot])[:n])
                self._release(slot, n)
        except Stopped:
            return  # cancelled, or another lane failed: as in ``read_lane``
        except BaseException:
            self._stop.set()
            raise

    def result(self) -> FileResult:
        """The digests, once every lane has returned."""
        layout = self.layout
        self._tensors.finish()
        file = FileHashes(
            name=layout.name,
            size=layout.size,
            header_bytes=layout.header_bytes,
            data_end=layout.data_end,
            sha256=self._sha256.digest(),
            header_xxh3_128=self._header.digest(),
            blocks=tuple(self._blocks),
        )
        llama = merge_llama(*(h.result() for h in self._llama)) if self._llama else None
        return FileResult(file, tuple(self._tensors.done), llama)
