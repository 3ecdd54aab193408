"""A load checked against its hash manifest while the bytes land (format §8).

``open_manifest`` runs on the load's thread once the model is indexed and its files
are open: it reads the manifest (bounded: ``read_manifest_text``), refuses one of
another model (``match_manifest``) or with another header fingerprint, and makes the
load's ``IntegritySink``.

Where each block of a file's data section is hashed:

- bytes read into host memory (``none``, ``direct``) or into a device's staging slot:
  by the thread that read them, right after its read, from where they landed (the
  sink is the reader's ``PieceSink``); a piece overlaps the one before it, so each
  block of a job lies wholly inside one piece, and the jobs' useful bytes are cut at
  block boundaries (``block_grid``), so a block crosses two jobs only at the edge of a
  coalesced range;
- mapped images (``mmap``, ``mlock``) and bytes swapped after their read: by the reader
  thread after the job, through ``pread`` into a scratch buffer of its own
  (``check_from_file``), never through the mapping: a file cut short during the load
  would kill the process at the first page past its end. The tensor checks of a mapped
  image take their pieces from the same reads (``feed``), so that the file is read
  once, not twice;
- the blocks no landed piece held whole (the edges): once the reads are done
  (``finish``), from the file, with the parts that landed in host memory copied over
  from there (unless they were byte-swapped). Parts of an edge block that went to a
  device are checked as the file holds them.

Blocks that hold no byte the load reads (lazy tensors) are not checked. A block is
hashed once (a bitmap per file, shared by the threads). ``error`` settles the bad
blocks (the tensors in them are checked whole where the block did not decide) into one
``IntegrityError``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiogguf._images import HostImage, tensor_chunks
from aiogguf._jobs import BufferLayout, PieceSink, ReadJob, TensorSlot, Watcher
from aiogguf._records import WeightIndex
from aiogguf.errors import IntegrityError, ManifestMismatchError
from aiogguf.integrity._checker import IntegrityChecker, Mismatch, match_manifest
from aiogguf.integrity._llama_check import LlamaCheck, LlamaSink
from aiogguf.integrity._manifest import (
    block_hasher,
    is_json_manifest,
    parse_manifest,
    read_manifest_text,
)
from aiogguf.io.opener import OpenFiles
from aiogguf.io.source import ByteSource
from aiogguf.io.workers import raise_if_stopped

if TYPE_CHECKING:
    import xxhash

    from aiogguf._images import Image

__all__ = [
    "IntegritySink",
    "block_grid",
    "open_manifest",
    "shares_mapped_reads",
    "watch",
]

# A mapped load's blocks are read from the file in chunks this big, each hashed while
# it is in the CPU's cache: the copy costs a pass over memory less than a whole block.
FILE_CHUNK_BYTES = 1 << 20


def open_manifest(
    path: str, index: WeightIndex, files: Sequence[ByteSource], opened: OpenFiles
) -> IntegrityChecker | LlamaCheck:
    """Blocking: the manifest at ``path`` read and matched to the model; for one of
    aiogguf's own, each file's header checked against its fingerprint. The checker of
    the load. Raises ``ManifestError`` (not a usable manifest) or
    ``ManifestMismatchError`` (one of another model, or a damaged header)."""
    # Through the load's opener, as its model files are (a duplicate: the load's file
    # table closes its own).
    text = read_manifest_text(path, fd=os.dup(opened.open(path)))
    if not is_json_manifest(text):
        return LlamaCheck.open(text, path, index)
    manifest = parse_manifest(text, path)
    match_manifest(manifest, index, path)
    names = [os.path.basename(f.path) for f in index.files]
    checker = IntegrityChecker(manifest, index, file_names=names)
    for i, (f, source) in enumerate(zip(manifest.files, files, strict=True)):
        header = bytearray(f.header_bytes)
        source.read_into(header, 0)
        if not checker.check_header(i, header):
            raise ManifestMismatchError(
                path,
                "",
                f"not a manifest of this model: the header of {names[i]} (file {i}) differs "
                "(another model, or a damaged header)",
            )
    return checker


def block_grid(checker: IntegrityChecker | LlamaCheck | None) -> list[tuple[int, int]] | None:
    """Per file: where its data section starts, and the block size (``split_jobs``
    cuts the jobs there); None without block digests."""
    if not isinstance(checker, IntegrityChecker):
        return None
    manifest = checker.manifest
    return [(f.header_bytes, manifest.block_bytes) for f in manifest.files]


def watch(
    checker: IntegrityChecker | LlamaCheck,
    index: WeightIndex,
    files: Sequence[ByteSource],
    images: Sequence[Image | None],
    layouts: Sequence[BufferLayout],
    slots: dict[str, TensorSlot],
    *,
    swapped: bool,
    feed: PieceSink | None,
) -> tuple[IntegritySink | LlamaSink, Watcher]:
    """The load's side of ``checker`` (an ``IntegritySink``, or a ``LlamaSink`` for a
    llama-gguf-hash manifest; ``feed``: as ``IntegritySink``'s) and how it watches the
    bytes land: the pieces it hashes (not swapped bytes, which are not the file's: it reads
    the file instead), a local file's reads streamed through its block hashes, and the
    jobs it reads back from the file (mapped images, swapped bytes)."""
    sink: IntegritySink | LlamaSink
    if isinstance(checker, LlamaCheck):
        sink = LlamaSink(checker, index, files, images, layouts, slots, swapped=swapped)
    else:
        sink = IntegritySink(checker, files, images, layouts, slots, swapped=swapped, feed=feed)
    return sink, Watcher(
        piece=sink if not swapped and sink.takes_pieces else None,
        stream=sink.stream if isinstance(sink, IntegritySink) and not swapped else None,
        from_file=sink.check_from_file,
    )


def shares_mapped_reads(checker: IntegrityChecker | LlamaCheck | None, *, mapped: bool) -> bool:
    """Whether the checks of mapped tensors (``mapped``: the mode maps host images)
    take their pieces from the manifest's reads of the file (``IntegritySink``'s
    ``feed``)."""
    return isinstance(checker, IntegrityChecker) and mapped


@dataclass(slots=True)
class _Streamed:
    """A block being hashed part by part as a reader lands it (``IntegritySink.stream``)."""

    file: int
    block: int
    hasher: xxhash.xxh3_128
    next: int  # the file offset its next part starts at


class IntegritySink:
    """One load's blocks checked against its manifest, from any thread (the module's
    docstring says where each block is hashed)."""

    # The engine hands it the landed pieces (``__call__``).
    takes_pieces = True
    tensors_hashed = 0  # blocks, not tensors, are its unit (``hashed``)

    def __init__(
        self,
        checker: IntegrityChecker,
        files: Sequence[ByteSource],
        images: Sequence[Image | None],
        layouts: Sequence[BufferLayout],
        slots: dict[str, TensorSlot],
        *,
        swapped: bool = False,
        feed: PieceSink | None = None,
    ) -> None:
        """``feed`` (a ``PieceSink``, the tensor checks) also gets each piece that
        ``check_from_file`` reads: the checks of mapped tensors then need no reads of
        their own."""
        self.checker = checker
        self._feed = feed
        # Swapped bytes land converted: every block is then hashed from the file.
        self._swapped = swapped
        self._files = files
        self._images = images
        self._slots = slots
        manifest = checker.manifest
        self.block_bytes = manifest.block_bytes
        self._grid = [(f.header_bytes, f.data_end, len(f.blocks)) for f in manifest.files]
        self._done = [bytearray(len(f.blocks)) for f in manifest.files]
        self._lock = threading.Lock()
        self._found: list[Mismatch] = []
        self._scratch = threading.local()
        # Per file: the loaded ranges, (start, end, buffer index, image offset of start).
        self._loaded: list[list[tuple[int, int, int, int]]] = [[] for _ in manifest.files]
        for lay in layouts:
            if lay.plan.lazy:
                continue
            for rs in lay.slots:
                r = rs.range
                self._loaded[r.file_index].append(
                    (r.start, r.end, lay.index, rs.buffer_offset_of(r.start))
                )
        for ranges in self._loaded:
            ranges.sort()

    # --- while the bytes land ----------------------------------------------------------

    def _claim(self, file_index: int, lo: int, hi: int) -> list[int]:
        """The blocks wholly inside file bytes ``[lo, hi)`` that no one has hashed yet,
        now this caller's to hash."""
        start, data_end, count = self._grid[file_index]
        B = self.block_bytes
        first = max(-(-(lo - start) // B), 0)
        last = count if hi >= data_end else max((hi - start) // B, 0)
        if first >= last:
            return []
        done = self._done[file_index]
        with self._lock:
            mine = [k for k in range(first, last) if not done[k]]
            for k in mine:
                done[k] = 1
        return mine

    def _check(self, file_index: int, blocks: Sequence[int], at: int, data: memoryview) -> None:
        """Hash ``blocks`` (claimed) in ``data``, the file's bytes from ``at``."""
        start, data_end, _ = self._grid[file_index]
        B = self.block_bytes
        found: list[Mismatch] = []
        for k in blocks:
            lo = start + k * B
            hi = min(lo + B, data_end)
            found += self.checker.check_piece(file_index, lo, data[lo - at : hi - at])
        if found:
            with self._lock:
                self._found += found

    def __call__(self, job: ReadJob, file_offset: int, piece: memoryview) -> None:
        """The ``PieceSink``: hash the blocks ``piece`` holds whole, not hashed yet."""
        blocks = self._claim(job.file_index, file_offset, file_offset + len(piece))
        if blocks:
            self._check(job.file_index, blocks, file_offset, piece)

    def stream(self, job: ReadJob, file_offset: int, part: memoryview) -> None:
        """A ``PieceSink`` for reads as they land, in order within a job (``Reader``'s
        ``stream``): each block is hashed part by part while the parts are in the
        core's cache, from a part that starts it to the one that ends it. A block that
        matches is done; one that does not, or whose parts came apart (it spans two
        jobs), is left to the piece that holds it whole, or to the edges."""
        i = job.file_index
        start, data_end, count = self._grid[i]
        B = self.block_bytes
        state: _Streamed | None = getattr(self._scratch, "stream", None)
        at, end = file_offset, file_offset + len(part)
        while at < end:
            k = (at - start) // B
            if at < start or k >= count:
                return
            block_end = min(start + (k + 1) * B, data_end)
            upto = min(end, block_end)
            if at == start + k * B:
                state = _Streamed(i, k, block_hasher(k), at)
            if state is not None and (state.file, state.block, state.next) == (i, k, at):
                state.hasher.update(part[at - file_offset : upto - file_offset])
                state.next = upto
                if upto == block_end:
                    if state.hasher.digest() == self.checker.manifest.files[i].blocks[k]:
                        with self._lock:
                            self._done[i][k] = 1
                    state = None
            at = upto
        self._scratch.stream = state

    def _scratch_view(self) -> memoryview:
        buf: bytearray | None = getattr(self._scratch, "buf", None)
        if buf is None:
            buf = self._scratch.buf = bytearray(self.block_bytes)
        return memoryview(buf)

    def check_from_file(self, job: ReadJob) -> None:
        """Hash the blocks that ``job``'s useful bytes hold whole, each read from the
        file in chunks that stay in the CPU's cache (mapped images, swapped bytes)."""
        i = job.file_index
        blocks = self._claim(i, job.useful_start, job.useful_end)
        start, data_end, _ = self._grid[i]
        want = self.checker.manifest.files[i].blocks
        chunk = self._scratch_view()[:FILE_CHUNK_BYTES]
        for k in blocks:
            raise_if_stopped()
            lo = start + k * self.block_bytes
            hi = min(lo + self.block_bytes, data_end)
            state = block_hasher(k)
            for at in range(lo, hi, FILE_CHUNK_BYTES):
                part = chunk[: min(FILE_CHUNK_BYTES, hi - at)]
                self._files[i].read_into(part, at)
                state.update(part)
                if self._feed is not None:
                    self._feed(job, at, part)
            if state.digest() != want[k]:
                # Read whole, to name the tensors in it (a failing load only).
                view = self._scratch_view()[: hi - lo]
                self._files[i].read_into(view, lo)
                self._check(i, (k,), lo, view)

    # --- once the reads are done -------------------------------------------------------

    def edges(self) -> list[tuple[int, int]]:
        """(file, block) of each block with loaded bytes that no piece held whole."""
        B = self.block_bytes
        left: list[tuple[int, int]] = []
        for i, ranges in enumerate(self._loaded):
            start, _, count = self._grid[i]
            done = self._done[i]
            wanted = bytearray(count)
            for lo, hi, _, _ in ranges:
                first, last = (lo - start) // B, -(-(hi - start) // B)
                wanted[first : min(last, count)] = b"\1" * (min(last, count) - first)
            left += [(i, k) for k in range(count) if wanted[k] and not done[k]]
        return left

    def finish(self) -> None:
        """Blocking, once every read has landed: hash the edge blocks (``edges``)."""
        for i, k in self.edges():
            raise_if_stopped()
            self._edge(i, k)

    def _edge(self, file_index: int, block: int) -> None:
        start, data_end, _ = self._grid[file_index]
        lo = start + block * self.block_bytes
        hi = min(lo + self.block_bytes, data_end)
        parts = [
            (max(r_lo, lo), min(r_hi, hi), image, at + max(r_lo, lo) - r_lo)
            for r_lo, r_hi, buffer, at in self._loaded[file_index]
            if r_lo < hi and r_hi > lo and not self._swapped
            if isinstance(image := self._images[buffer], HostImage)
        ]
        if len(parts) == 1 and parts[0][:2] == (lo, hi):
            # Landed whole in one host image (jobs of one range cut off the grid).
            at = parts[0][3]
            view = parts[0][2].buffer.memoryview[at : at + hi - lo]
        else:
            view = self._scratch_view()[: hi - lo]
            self._files[file_index].read_into(view, lo)
            for p_lo, p_hi, image, at in parts:
                view[p_lo - lo : p_hi - lo] = image.buffer.memoryview[at : at + p_hi - p_lo]
        self._done[file_index][block] = 1
        self._check(file_index, (block,), lo, view)

    # --- the verdict -------------------------------------------------------------------

    @property
    def hashed(self) -> int:
        """Blocks hashed so far."""
        return sum(done.count(1) for done in self._done)

    @property
    def mismatches(self) -> list[Mismatch]:
        with self._lock:
            return list(self._found)

    def tensor_bytes(self, name: str) -> Iterator[memoryview]:
        """Blocking: tensor ``name``'s landed bytes, in pieces (``tensor_chunks``: a
        device tensor's copied back; a mapped, swapped or unloaded one's read from its
        file)."""
        slot = None if self._swapped else self._slots.get(name)
        t = next(t for t in self.checker.manifest.tensors if t.name == name)
        return tensor_chunks(slot, self._images, self._files[t.file], t.offset, t.nbytes)

    def error(self, path: str | None) -> IntegrityError | None:
        """Blocking, once the reads are done: hash the edges (``finish``); the
        ``IntegrityError`` naming every bad tensor (None: all good)."""
        self.finish()
        found = self.mismatches
        if not found:
            return None
        settled = self.checker.settle(found, self.tensor_bytes)
        return self.checker.error(settled, path)
