"""Hash manifests: what a model's bytes were when it was hashed (format §8).

A ``Manifest`` holds, per file, its size, the length of its header, the sha256 of the
whole file (the value Hugging Face shows as the LFS oid), an xxh3_128 fingerprint of the
header (metadata and tensor infos) and an xxh3_128 per fixed block of the data section,
seeded with the block's index; per tensor, keyed by its name and byte range (never by a
path), the xxh3_128 of its data; and a set id over all of it. ``manifest_json`` writes
one, ``parse_manifest`` reads one back, treating it as hostile input: every size is
bounded, every field is checked, and a manifest whose set id does not match its contents
is refused. Matching a manifest to a model and checking bytes against it is
``aiogguf.integrity._checker``'s job.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import xxhash

from aiogguf.errors import ManifestError, os_errors
from aiogguf.io.files import open_readable

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "BLOCK_BYTES",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MAX_MANIFEST_BYTES",
    "FileHashes",
    "Manifest",
    "TensorHash",
    "block_digest",
    "block_hasher",
    "block_span",
    "compute_set_id",
    "header_digest",
    "manifest_json",
    "parse_manifest",
    "read_manifest_text",
    "sidecar_path",
    "tensor_digest",
    "tensor_hasher",
]

FORMAT_NAME: Final = "aiogguf-manifest"
FORMAT_VERSION: Final = 1
# The block every data section is cut into, counted from the section's first byte: big
# enough that a block's hash costs nothing beside its read, small enough that a read or
# a staging slot holds whole blocks, so each can be checked on its own.
BLOCK_BYTES: Final = 16 << 20
MIN_BLOCK_BYTES: Final = 64 << 10
MAX_BLOCK_BYTES: Final = 1 << 30
# Room for 10^5 tensors and the blocks of a few TB, and a cap on what a hostile file
# makes the JSON decoder allocate.
MAX_MANIFEST_BYTES: Final = 32 << 20
SIDECAR_SUFFIX: Final = ".manifest.json"
MAX_FILES: Final = 65535  # split.count is a u16
MAX_NAME_CHARS: Final = 4096
MAX_TENSOR_NAME_BYTES: Final = 63  # ggml's C reader (format §1.6)
_INT_LIMIT: Final = 1 << 63
_XXH_HEX: Final = 32
_SHA256_HEX: Final = 64

_FILE_KEYS: Final = frozenset(
    {"name", "size", "header_bytes", "data_end", "sha256", "header_xxh3_128", "blocks"}
)
_TENSOR_KEYS: Final = frozenset({"name", "file", "offset", "nbytes", "xxh3_128"})
_TOP_KEYS: Final = frozenset({"format", "version", "block_bytes", "set_id", "files", "tensors"})


@dataclass(frozen=True, slots=True)
class FileHashes:
    """One file of a model as it was hashed. Offsets are absolute in the file; the data
    section is ``[header_bytes, data_end)`` (``data_end``: where the last tensor ends),
    cut into blocks of the manifest's ``block_bytes`` from ``header_bytes`` on."""

    name: str  # the file's name when hashed (for messages only; never matched)
    size: int
    header_bytes: int
    data_end: int
    sha256: bytes
    header_xxh3_128: bytes
    blocks: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class TensorHash:
    """One tensor's data as it was hashed: ``nbytes`` at ``offset`` of file ``file``."""

    name: str
    file: int
    offset: int
    nbytes: int
    xxh3_128: bytes

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True, slots=True)
class Manifest:
    """A model's hashes: ``files`` in split order, ``tensors`` in file order."""

    block_bytes: int
    files: tuple[FileHashes, ...]
    tensors: tuple[TensorHash, ...]
    set_id: str
    version: int = FORMAT_VERSION


def sidecar_path(model_path: str | os.PathLike[str]) -> str:
    """Where a model's manifest is looked for and written by default: beside its
    (first) file, ``MODEL.gguf.manifest.json``."""
    return os.fspath(model_path) + SIDECAR_SUFFIX


def block_span(file: FileHashes, block: int, block_bytes: int) -> tuple[int, int]:
    """The file offsets ``[start, end)`` of block ``block`` of ``file``."""
    start = file.header_bytes + block * block_bytes
    return start, min(start + block_bytes, file.data_end)


def block_digest(data: Buffer, block: int) -> bytes:
    """The digest of block number ``block``: xxh3_128 seeded with the block's index, so
    that the same bytes elsewhere do not match."""
    return xxhash.xxh3_128_digest(data, seed=block)


def block_hasher(block: int) -> xxhash.xxh3_128:
    """``block_digest`` of block ``block`` fed in parts: ``update`` each, then
    ``digest``."""
    return xxhash.xxh3_128(seed=block)


def tensor_digest(data: Buffer) -> bytes:
    """The digest of a tensor's data bytes (xxh3_128, seed 0)."""
    return xxhash.xxh3_128_digest(data)


def tensor_hasher() -> xxhash.xxh3_128:
    """``tensor_digest`` fed in parts: ``update`` each, then ``digest``."""
    return xxhash.xxh3_128()


def header_digest(data: Buffer) -> bytes:
    """The header fingerprint: xxh3_128 of the file's bytes before its data section."""
    return xxhash.xxh3_128_digest(data)


def compute_set_id(
    block_bytes: int, files: Sequence[FileHashes], tensors: Sequence[TensorHash]
) -> str:
    """The set id: sha256 over every file's sizes and digests and every tensor's name,
    range and digest, in order (format §8.3). Two sets share it only if they hashed
    the same."""
    h = hashlib.sha256(b"aiogguf-set-v1\0")
    h.update(struct.pack("<QQ", block_bytes, len(files)))
    for f in files:
        h.update(struct.pack("<QQQQ", f.size, f.header_bytes, f.data_end, len(f.blocks)))
        h.update(f.sha256)
        h.update(f.header_xxh3_128)
        h.update(b"".join(f.blocks))
    h.update(struct.pack("<Q", len(tensors)))
    for t in tensors:
        name = t.name.encode()
        h.update(struct.pack("<QQQQ", len(name), t.file, t.offset, t.nbytes))
        h.update(name)
        h.update(t.xxh3_128)
    return h.hexdigest()


# --- writing ---------------------------------------------------------------------------


def manifest_json(manifest: Manifest) -> str:
    """The manifest as JSON text (format §8.2): one file or tensor per line."""
    head = {
        "format": FORMAT_NAME,
        "version": manifest.version,
        "block_bytes": manifest.block_bytes,
        "set_id": manifest.set_id,
    }
    files = [
        json.dumps(
            {
                "name": f.name,
                "size": f.size,
                "header_bytes": f.header_bytes,
                "data_end": f.data_end,
                "sha256": f.sha256.hex(),
                "header_xxh3_128": f.header_xxh3_128.hex(),
                "blocks": [b.hex() for b in f.blocks],
            }
        )
        for f in manifest.files
    ]
    tensors = [
        json.dumps(
            {
                "name": t.name,
                "file": t.file,
                "offset": t.offset,
                "nbytes": t.nbytes,
                "xxh3_128": t.xxh3_128.hex(),
            }
        )
        for t in manifest.tensors
    ]
    lines = [json.dumps(head)[:-1] + ","]
    lines.append(' "files": [\n  ' + ",\n  ".join(files) + "\n ],")
    lines.append(' "tensors": [\n  ' + ",\n  ".join(tensors) + "\n ]\n}\n")
    return "\n".join(lines)


# --- reading ---------------------------------------------------------------------------


def read_manifest_text(path: str | os.PathLike[str], *, fd: int | None = None) -> str:
    """Blocking: the text of the manifest at ``path``, at most ``MAX_MANIFEST_BYTES``;
    ``fd``: a descriptor of it, opened already (a load's opener), closed here.

    Raises ``ManifestError`` (too large, not UTF-8) or ``LoadError`` (cannot be read)."""
    fspath = os.fspath(path)
    if fd is None:
        fd = open_readable(fspath)
    try:
        with os_errors(fspath, None, "cannot read the manifest"):
            size = os.fstat(fd).st_size
            if size > MAX_MANIFEST_BYTES:
                raise ManifestError(
                    fspath, "", f"{size} bytes; a manifest is at most {MAX_MANIFEST_BYTES} bytes"
                )
            chunks: list[bytes] = []
            done = 0
            while done <= MAX_MANIFEST_BYTES:  # the file may grow while it is read
                part = os.pread(fd, min(1 << 20, MAX_MANIFEST_BYTES + 1 - done), done)
                if not part:
                    break
                chunks.append(part)
                done += len(part)
    finally:
        os.close(fd)
    if done > MAX_MANIFEST_BYTES:
        raise ManifestError(fspath, "", f"more than {MAX_MANIFEST_BYTES} bytes")
    try:
        return b"".join(chunks).decode()
    except UnicodeDecodeError as exc:
        raise ManifestError(fspath, "", f"not UTF-8 text (byte {exc.start})") from exc


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_manifest(text: str, path: str | os.PathLike[str] | None = None) -> Manifest:
    """The manifest in ``text`` (JSON, format §8.2), every field checked.

    ``path`` names the manifest in messages. Raises ``ManifestError`` naming the field
    and what was expected there: not JSON, another format or version, a missing,
    unknown or mistyped field, a value out of range, a block list of the wrong length,
    a tensor outside its file's data, a duplicate tensor, or a set id that does not
    match the contents."""
    where = None if path is None else os.fspath(path)
    if len(text) > MAX_MANIFEST_BYTES:
        raise ManifestError(where, "", f"more than {MAX_MANIFEST_BYTES} characters")
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError as exc:
        raise ManifestError(where, "", "not a manifest: JSON nested too deeply") from exc
    except ValueError as exc:
        raise ManifestError(where, "", f"not JSON: {exc}") from exc
    return _Reader(where).manifest(data)


class _Reader:
    """Checks one decoded manifest, field by field; every error names the field."""

    def __init__(self, path: str | None) -> None:
        self.path = path

    def error(self, field: str, problem: str) -> ManifestError:
        return ManifestError(self.path, field, problem)

    def obj(self, value: object, field: str, keys: frozenset[str]) -> Mapping[str, Any]:
        if not isinstance(value, dict):
            raise self.error(field, f"expected an object, got {_kind(value)}")
        missing = sorted(keys - value.keys())
        if missing:
            raise self.error(field, f"missing {', '.join(missing)}")
        unknown = sorted(str(k)[:40] for k in value.keys() - keys)
        if unknown:
            raise self.error(field, f"unknown field {unknown[0]!r}")
        return value

    def integer(self, value: object, field: str, low: int = 0, high: int = _INT_LIMIT) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(field, f"expected an integer, got {_kind(value)}")
        if not low <= value < high:
            raise self.error(field, f"expected {low} <= value < {high}, got {value}")
        return value

    def text(self, value: object, field: str, max_chars: int) -> str:
        if not isinstance(value, str):
            raise self.error(field, f"expected a string, got {_kind(value)}")
        if not value or len(value) > max_chars or "\0" in value:
            raise self.error(field, f"expected 1 to {max_chars} characters, no NUL")
        return value

    def digest(self, value: object, field: str, hex_digits: int) -> bytes:
        if (
            not isinstance(value, str)
            or len(value) != hex_digits
            or value.strip("0123456789abcdef")
        ):
            shown = repr(value)[:80] if isinstance(value, str) else _kind(value)
            raise self.error(field, f"expected {hex_digits} lower-case hex digits, got {shown}")
        return bytes.fromhex(value)

    def items(self, value: object, field: str, limit: int) -> list[Any]:
        if not isinstance(value, list):
            raise self.error(field, f"expected a list, got {_kind(value)}")
        if len(value) > limit:
            raise self.error(field, f"{len(value)} items; at most {limit}")
        return value

    def manifest(self, data: object) -> Manifest:
        top = self.obj(data, "", _TOP_KEYS)
        if top["format"] != FORMAT_NAME:
            raise self.error("format", f"expected {FORMAT_NAME!r}, got {str(top['format'])[:80]!r}")
        version = self.integer(top["version"], "version", 1)
        if version != FORMAT_VERSION:
            raise self.error(
                "version", f"version {version}; this aiogguf reads version {FORMAT_VERSION}"
            )
        block_bytes = self.integer(
            top["block_bytes"], "block_bytes", MIN_BLOCK_BYTES, MAX_BLOCK_BYTES + 1
        )
        if block_bytes & (block_bytes - 1):
            raise self.error("block_bytes", f"expected a power of two, got {block_bytes}")
        raw_files = self.items(top["files"], "files", MAX_FILES)
        if not raw_files:
            raise self.error("files", "expected at least one file")
        files = tuple(self.file(f, f"files[{i}]", block_bytes) for i, f in enumerate(raw_files))
        limit = MAX_MANIFEST_BYTES // 64  # no tensor entry is shorter
        raw_tensors = self.items(top["tensors"], "tensors", limit)
        tensors = tuple(self.tensor(t, f"tensors[{i}]", files) for i, t in enumerate(raw_tensors))
        seen: set[str] = set()
        for i, t in enumerate(tensors):
            if t.name in seen:
                raise self.error(f"tensors[{i}].name", f"tensor {t.name!r} is listed twice")
            seen.add(t.name)
        set_id = self.digest(top["set_id"], "set_id", _SHA256_HEX).hex()
        if set_id != compute_set_id(block_bytes, files, tensors):
            raise self.error("set_id", "does not match the manifest's contents (edited or damaged)")
        return Manifest(block_bytes=block_bytes, files=files, tensors=tensors, set_id=set_id)

    def file(self, value: object, field: str, block_bytes: int) -> FileHashes:
        raw = self.obj(value, field, _FILE_KEYS)
        name = self.text(raw["name"], f"{field}.name", MAX_NAME_CHARS)
        size = self.integer(raw["size"], f"{field}.size")
        header = self.integer(raw["header_bytes"], f"{field}.header_bytes", 0, size + 1)
        data_end = self.integer(raw["data_end"], f"{field}.data_end", header, size + 1)
        n_blocks = -(-(data_end - header) // block_bytes)
        raw_blocks = self.items(raw["blocks"], f"{field}.blocks", n_blocks)
        if len(raw_blocks) != n_blocks:
            raise self.error(
                f"{field}.blocks",
                f"expected {n_blocks} blocks for {data_end - header} data bytes, "
                f"got {len(raw_blocks)}",
            )
        blocks = tuple(
            self.digest(b, f"{field}.blocks[{k}]", _XXH_HEX) for k, b in enumerate(raw_blocks)
        )
        return FileHashes(
            name=name,
            size=size,
            header_bytes=header,
            data_end=data_end,
            sha256=self.digest(raw["sha256"], f"{field}.sha256", _SHA256_HEX),
            header_xxh3_128=self.digest(
                raw["header_xxh3_128"], f"{field}.header_xxh3_128", _XXH_HEX
            ),
            blocks=blocks,
        )

    def tensor(self, value: object, field: str, files: Sequence[FileHashes]) -> TensorHash:
        raw = self.obj(value, field, _TENSOR_KEYS)
        name = self.text(raw["name"], f"{field}.name", MAX_TENSOR_NAME_BYTES)
        if len(name.encode()) > MAX_TENSOR_NAME_BYTES:
            raise self.error(f"{field}.name", f"more than {MAX_TENSOR_NAME_BYTES} bytes")
        index = self.integer(raw["file"], f"{field}.file", 0, len(files))
        f = files[index]
        offset = self.integer(raw["offset"], f"{field}.offset", f.header_bytes, f.data_end + 1)
        nbytes = self.integer(raw["nbytes"], f"{field}.nbytes", 0, f.data_end - offset + 1)
        digest = self.digest(raw["xxh3_128"], f"{field}.xxh3_128", _XXH_HEX)
        return TensorHash(name=name, file=index, offset=offset, nbytes=nbytes, xxh3_128=digest)


def _kind(value: object) -> str:
    """What a JSON value is, for a message."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    return names.get(type(value), f"a number ({str(value)[:40]})")
