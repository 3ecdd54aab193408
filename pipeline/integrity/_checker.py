"""Checking a model's bytes against its hash manifest (format §8.4).

``match_manifest`` refuses a manifest of another model before any byte is compared:
other files, sizes, header lengths or tensors (by name and byte range). Then
``IntegrityChecker.check_piece`` checks a landed piece of a file, on the thread that
read it: the piece starts at a block boundary of the file's data section and holds whole
blocks (the last one may end at the data's end); each block's digest is compared, and a
block that differs names the tensors whose bytes lie in it, narrowed by their own
digests where the piece holds them whole. The checker keeps no state between calls, so
any number of threads may call it at once. ``compare_manifests`` does the same for two
manifests of the same model (``aiogguf verify``). ``IntegrityChecker.error`` turns the
mismatches into an ``IntegrityError`` that names every bad tensor at once, each with its
file, block and offset.
"""

from __future__ import annotations

import bisect
import builtins
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from aiogguf._records import ParsedFile, WeightIndex
from aiogguf._units import counted
from aiogguf.errors import IntegrityError, ManifestMismatchError, TensorFailure
from aiogguf.integrity._manifest import (
    FileHashes,
    Manifest,
    TensorHash,
    block_digest,
    block_span,
    header_digest,
    tensor_digest,
    tensor_hasher,
)

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "IntegrityChecker",
    "Mismatch",
    "compare_manifests",
    "data_end_of",
    "header_bytes_of",
    "match_manifest",
]

# What a failure of bytes outside every tensor (alignment padding, bytes after the last
# tensor) is reported as.
NO_TENSOR = "(between tensors)"


@dataclass(frozen=True, slots=True)
class Mismatch:
    """A block whose bytes differ from the manifest. ``tensors``: those with bytes in
    it whose own digests differ too; ``unchecked``: those with bytes in it that the
    piece did not hold whole, so their digests could not be checked (``settle``
    checks them once they have landed whole)."""

    file_index: int
    file_name: str
    block: int
    offset: int  # the block's first byte in the file
    nbytes: int
    tensors: tuple[str, ...]
    unchecked: tuple[str, ...] = ()

    @property
    def suspects(self) -> tuple[str, ...]:
        """Every tensor this block may have damaged: bad or unchecked."""
        return self.tensors + self.unchecked

    def __str__(self) -> str:
        names = ", ".join(self.suspects) if self.suspects else "no tensor (padding)"
        return (
            f"{self.file_name} block {self.block} at offset {self.offset} "
            f"({self.nbytes} bytes): {names}"
        )


def header_bytes_of(parsed: ParsedFile) -> int:
    """Where a file's data section starts: its header's length. A file of no tensors
    may end before the padding that would start it (format §1.8)."""
    return min(parsed.data_offset, parsed.file_size)


def data_end_of(parsed: ParsedFile) -> int:
    """Where a file's last tensor ends (its data section's start when it has none)."""
    return max(
        (parsed.data_offset + t.offset + t.nbytes for t in parsed.tensors),
        default=header_bytes_of(parsed),
    )


def match_manifest(
    manifest: Manifest, index: WeightIndex, manifest_path: str | os.PathLike[str] | None = None
) -> None:
    """Refuse ``manifest`` unless it describes ``index``'s model: as many files, each of
    the same size, header length and data end, and the same tensors at the same byte
    ranges. File names are not compared (a model may be renamed).

    Raises ``ManifestMismatchError``: one line naming the first difference."""

    def refuse(why: str) -> ManifestMismatchError:
        return ManifestMismatchError(manifest_path, "", f"not a manifest of this model: {why}")

    if len(manifest.files) != len(index.files):
        raise refuse(
            f"it covers {counted(len(manifest.files), 'file')}, the model has {len(index.files)}"
        )
    for i, (want, parsed) in enumerate(zip(manifest.files, index.files, strict=True)):
        name = os.path.basename(parsed.path)
        have = (parsed.file_size, header_bytes_of(parsed), data_end_of(parsed))
        for what, got, expected in zip(
            ("bytes", "header bytes", "data end"),
            have,
            (want.size, want.header_bytes, want.data_end),
            strict=True,
        ):
            if got != expected:
                raise refuse(f"{name} (file {i}) has {what} {got}, the manifest {expected}")
    if len(manifest.tensors) != len(index.tensors):
        raise refuse(
            f"it lists {counted(len(manifest.tensors), 'tensor')}, "
            f"the model has {len(index.tensors)}"
        )
    for t in manifest.tensors:
        if t.name not in index:
            raise refuse(f"tensor {t.name!r} is not in the model")
        entry = index[t.name]
        if (entry.file_index, entry.offset, entry.nbytes) != (t.file, t.offset, t.nbytes):
            raise refuse(
                f"tensor {t.name!r} is at file {entry.file_index} bytes "
                f"[{entry.offset}, {entry.end}), the manifest says file {t.file} bytes "
                f"[{t.offset}, {t.end})"
            )


class _FileTensors:
    """One file's tensors of a manifest, by start offset, for range lookups."""

    def __init__(self, tensors: Iterable[TensorHash]) -> None:
        self.tensors = sorted(tensors, key=lambda t: (t.offset, t.end))
        self.starts = [t.offset for t in self.tensors]
        # A tensor starts before the previous one ends only in a manifest that lists
        # overlapping tensors; the widest span keeps the lookup correct then too.
        self.longest = max((t.nbytes for t in self.tensors), default=0)

    def overlapping(self, start: int, end: int) -> list[TensorHash]:
        lo = bisect.bisect_left(self.starts, start - self.longest)
        hi = bisect.bisect_left(self.starts, end)
        return [t for t in self.tensors[lo:hi] if t.offset < end and t.end > start]


def _bytes_view(data: Buffer) -> builtins.memoryview:
    view = builtins.memoryview(data)
    if not view.c_contiguous:
        raise ValueError("the piece is not C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class IntegrityChecker:
    """Checks pieces of a model's files against its manifest; thread-safe, no state.

    ``manifest``: matched to the model already (``match_manifest``). ``index``: the
    model's index, for the tensors' type names in failures (optional). ``file_names``:
    how to name each file in messages (default: the names in the manifest)."""

    def __init__(
        self,
        manifest: Manifest,
        index: WeightIndex | None = None,
        *,
        file_names: Sequence[str] | None = None,
    ) -> None:
        self.manifest = manifest
        self.block_bytes = manifest.block_bytes
        self._index = index
        if file_names is None:
            file_names = [f.name for f in manifest.files]
        self._names = tuple(file_names)
        self._by_file = [
            _FileTensors(t for t in manifest.tensors if t.file == i)
            for i in range(len(manifest.files))
        ]
        self._by_name = {t.name: t for t in manifest.tensors}

    def block_start(self, file_index: int, block: int) -> int:
        """The file offset where block ``block`` of file ``file_index`` starts."""
        return block_span(self.manifest.files[file_index], block, self.block_bytes)[0]

    def whole_blocks(self, file_index: int, start: int, end: int) -> tuple[int, int]:
        """The part of file range ``[start, end)`` made of whole blocks (the last block
        may end at the data's end), as file offsets ``(lo, hi)``; ``lo == hi`` when it
        holds none. A piece that is not block-aligned is checked on that part, and the
        blocks at its edges once their other parts have landed."""
        f = self.manifest.files[file_index]
        B = self.block_bytes
        lo = max(start, f.header_bytes)
        lo = f.header_bytes + -(-(lo - f.header_bytes) // B) * B
        hi = min(end, f.data_end)
        if hi < f.data_end:
            hi = f.header_bytes + max(0, (hi - f.header_bytes) // B) * B
        return (lo, hi) if lo < hi else (lo, lo)

    def check_piece(self, file_index: int, file_offset: int, data: Buffer) -> list[Mismatch]:
        """Check the bytes ``data`` that landed from file ``file_index`` at
        ``file_offset``; return a ``Mismatch`` per block that differs (none: all good).

        The piece must start at a block boundary of the file's data section and end at
        one, or at the data's end. Raises ``ValueError`` when it does not (a caller's
        bug, not a bad file)."""
        view = _bytes_view(data)
        f = self.manifest.files[file_index]
        rel = file_offset - f.header_bytes
        end = file_offset + len(view)
        B = self.block_bytes
        if (
            rel < 0
            or rel % B
            or end > f.data_end
            or (end != f.data_end and (end - f.header_bytes) % B)
        ):
            raise ValueError(
                f"piece [{file_offset}, {end}) of file {file_index} is not whole blocks of "
                f"{B} bytes from {f.header_bytes} up to {f.data_end}"
            )
        found: list[Mismatch] = []
        first = rel // B
        for k in range(-(-len(view) // B)):
            lo = k * B
            part = view[lo : lo + B]
            if block_digest(part, first + k) != f.blocks[first + k]:
                found.append(self._mismatch(file_index, first + k, file_offset, view))
        return found

    def _mismatch(
        self, file_index: int, block: int, piece_offset: int, piece: builtins.memoryview
    ) -> Mismatch:
        """The ``Mismatch`` of a bad block, naming the tensors in it that differ too:
        those the piece holds whole are hashed, the rest are named unchecked."""
        start, end = block_span(self.manifest.files[file_index], block, self.block_bytes)
        piece_end = piece_offset + len(piece)
        bad: list[str] = []
        unchecked: list[str] = []
        for t in self._by_file[file_index].overlapping(start, end):
            if t.offset < piece_offset or t.end > piece_end:
                unchecked.append(t.name)
            elif tensor_digest(piece[t.offset - piece_offset : t.end - piece_offset]) != t.xxh3_128:
                bad.append(t.name)
            # else: the difference is in another tensor, or in the padding
        name = self._names[file_index]
        return Mismatch(file_index, name, block, start, end - start, tuple(bad), tuple(unchecked))

    def settle(
        self,
        mismatches: Iterable[Mismatch],
        tensor_bytes: Callable[[str], Buffer | Iterator[Buffer]],
    ) -> list[Mismatch]:
        """``mismatches`` with their unchecked tensors checked whole (``tensor_bytes(name)``
        gives a tensor's landed data, whole or in pieces: ``check_tensor``): a tensor
        whose digest matches is dropped; a block left with no tensor stays (its padding
        differs)."""
        verdicts: dict[str, bool] = {}
        settled: list[Mismatch] = []
        for m in mismatches:
            bad = list(m.tensors)
            for name in m.unchecked:
                if name not in verdicts:
                    verdicts[name] = not self.check_tensor(name, tensor_bytes(name))
                if verdicts[name]:
                    bad.append(name)
            settled.append(replace(m, tensors=tuple(bad), unchecked=()))
        return settled

    def check_header(self, file_index: int, data: Buffer) -> bool:
        """Whether ``data``, file ``file_index``'s bytes before its data section, has
        the manifest's header fingerprint (False: another model, or a damaged header)."""
        f = self.manifest.files[file_index]
        view = _bytes_view(data)
        return len(view) == f.header_bytes and header_digest(view) == f.header_xxh3_128

    def check_tensor(self, name: str, data: Buffer | Iterator[Buffer]) -> bool:
        """Whether ``data`` (a tensor's whole data, or an iterator of its pieces in
        order) matches the manifest's digest of tensor ``name``. Raises ``KeyError`` for
        a tensor the manifest does not list."""
        if isinstance(data, Iterator):
            state = tensor_hasher()
            for piece in data:
                state.update(_bytes_view(piece))
            digest = state.digest()
        else:
            digest = tensor_digest(_bytes_view(data))
        return digest == self._by_name[name].xxh3_128

    def failures(self, mismatches: Iterable[Mismatch]) -> tuple[TensorFailure, ...]:
        """One ``TensorFailure`` per bad tensor (in file order), naming the file, the
        first bad block and its offset, and how many of its blocks differ."""
        blocks: dict[str, list[Mismatch]] = {}
        for m in sorted(mismatches, key=lambda m: (m.file_index, m.block)):
            for name in m.suspects or (NO_TENSOR,):
                blocks.setdefault(name, []).append(m)
        failures: list[TensorFailure] = []
        for name, bad in blocks.items():
            first = bad[0]
            type_name = "-"
            if self._index is not None and name in self._index:
                type_name = self._index[name].type.name
            noun = "block differs" if len(bad) == 1 else "blocks differ"
            failures.append(
                TensorFailure(
                    name=name,
                    type_name=type_name,
                    problem=(
                        f"{len(bad)} {noun} from the manifest, first: {first.file_name} "
                        f"block {first.block} at offset {first.offset}"
                    ),
                    first_index=None,
                    count=len(bad),
                )
            )
        return tuple(failures)

    def error(self, mismatches: Iterable[Mismatch], path: str | None = None) -> IntegrityError:
        """The ``IntegrityError`` naming every bad tensor of ``mismatches``."""
        return IntegrityError(self.failures(mismatches), path)


def compare_manifests(
    expected: Manifest,
    actual: Manifest,
    *,
    file_names: Sequence[str] | None = None,
    manifest_path: str | os.PathLike[str] | None = None,
) -> list[Mismatch]:
    """The blocks where ``actual`` (the model hashed now) differs from ``expected``, each
    naming the tensors whose own digests differ. Bytes after the last tensor that
    differ come back as one ``Mismatch`` past the last block.

    Both must describe the same model (``match_manifest``). Raises
    ``ManifestMismatchError`` when a file's header differs: another model, or a
    damaged header."""
    if expected.block_bytes != actual.block_bytes:
        raise ValueError("the manifests cut the data into blocks of different sizes")
    names = tuple(file_names) if file_names is not None else tuple(f.name for f in actual.files)
    tensors = {t.name: t for t in actual.tensors}
    by_file = [
        _FileTensors(t for t in expected.tensors if t.file == i) for i in range(len(expected.files))
    ]
    found: list[Mismatch] = []
    for i, (want, got) in enumerate(zip(expected.files, actual.files, strict=True)):
        if want.header_xxh3_128 != got.header_xxh3_128:
            raise ManifestMismatchError(
                manifest_path,
                "",
                f"not a manifest of this model: the header of {names[i]} (file {i}) differs "
                "(another model, or a damaged header)",
            )
        found.extend(
            _block_diffs(i, names[i], want, got, expected.block_bytes, by_file[i], tensors)
        )
        if want.sha256 != got.sha256 and not any(m.file_index == i for m in found):
            found.append(
                Mismatch(
                    i, names[i], len(want.blocks), want.data_end, want.size - want.data_end, ()
                )
            )
    return found


def _block_diffs(
    file_index: int,
    name: str,
    want: FileHashes,
    got: FileHashes,
    block_bytes: int,
    expected_tensors: _FileTensors,
    actual_tensors: dict[str, TensorHash],
) -> list[Mismatch]:
    found: list[Mismatch] = []
    for k, (a, b) in enumerate(zip(want.blocks, got.blocks, strict=True)):
        if a == b:
            continue
        start, end = block_span(want, k, block_bytes)
        bad = tuple(
            t.name
            for t in expected_tensors.overlapping(start, end)
            if actual_tensors[t.name].xxh3_128 != t.xxh3_128
        )
        found.append(Mismatch(file_index, name, k, start, end - start, bad))
    return found
