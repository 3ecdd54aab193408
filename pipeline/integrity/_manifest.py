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
import re
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from json.scanner import make_scanner
from typing import TYPE_CHECKING, Any, Final, cast

import xxhash

from aiogguf._config import MANIFEST_SUFFIX, manifest_beside
from aiogguf.errors import ManifestError, os_errors
from aiogguf.io.files import open_readable
from aiogguf.io.workers import raise_if_stopped

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
    "is_json_manifest",
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
SIDECAR_SUFFIX: Final = MANIFEST_SUFFIX
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
    return manifest_beside(model_path)


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
        # Joined a few thousand at a time: a join holds an 80-byte buffer view per item.
        for at in range(0, len(f.blocks), 4096):
            h.update(b"".join(f.blocks[at : at + 4096]))
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
            # One buffer, filled in place: the text is decoded from it, so the bytes are
            # held once beside the text, not also as a list of parts and their join.
            data = bytearray(size + 1)
            done = 0
            while True:
                if done == len(data):  # the file grew while it was read
                    if done > MAX_MANIFEST_BYTES:
                        break
                    data.extend(bytes(min(done, MAX_MANIFEST_BYTES + 1 - done)))
                n = os.preadv(fd, [memoryview(data)[done:]], done)
                if not n:
                    break
                done += n
    finally:
        os.close(fd)
    if done > MAX_MANIFEST_BYTES:
        raise ManifestError(fspath, "", f"more than {MAX_MANIFEST_BYTES} bytes")
    try:
        return str(memoryview(data)[:done], "utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestError(fspath, "", f"not UTF-8 text (byte {exc.start})") from exc


def is_json_manifest(text: str) -> bool:
    """Whether ``text`` is aiogguf's JSON (it opens with ``{``) rather than
    llama-gguf-hash's lines; looks at the first character that is not whitespace."""
    start = _ANY_SPACE.match(text)
    return text.startswith("{", start.end() if start else 0)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_manifest(text: str, path: str | os.PathLike[str] | None = None) -> Manifest:
    """The manifest in ``text`` (JSON, format §8.2), every field checked.

    ``path`` names the manifest in messages. Raises ``ManifestError`` naming the field
    and what was expected there: not JSON, another format or version, a missing,
    unknown or mistyped field, a value out of range, a block list of the wrong length,
    a tensor outside its file's data, a duplicate tensor, or a set id that does not
    match the contents.

    The text is read value by value in the shape a manifest has, each object checked as
    it is read, so the first value out of place is refused before the next is read: what
    parsing holds is the text and the manifest, whatever the text is (``json.loads``
    builds every value of a text before anything can be checked: about 800 MB for
    32 MiB of ``{},``)."""
    where = None if path is None else os.fspath(path)
    if len(text) > MAX_MANIFEST_BYTES:
        raise ManifestError(where, "", f"more than {MAX_MANIFEST_BYTES} characters")
    return _Parser(text, where).manifest()


# JSON's whitespace, and an object of at most 16 members whose values are all scalars
# (a tensor's): matched in one call, then decoded by json's own scanner, whose memory is
# then bounded by that object's length.
_WS: Final = re.compile(r"[ \t\n\r]*+")
_ANY_SPACE: Final = re.compile(r"\s*+")
_W: Final = r"[ \t\n\r]*+"
_STRING: Final = r'"[^"\\\x00-\x1f]*+(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})[^"\\\x00-\x1f]*+)*+"'
_NUMBER: Final = r"-?(?:0|[1-9][0-9]*+)(?:\.[0-9]++)?(?:[eE][-+]?[0-9]++)?"
_MEMBER: Final = rf"{_STRING}{_W}:{_W}(?:{_STRING}|{_NUMBER}|true|false|null)"
_FLAT_OBJECT: Final = re.compile(rf"\{{{_W}(?:{_MEMBER}(?:{_W},{_W}{_MEMBER}){{0,15}}+{_W})?\}}")
# A file's block digests as aiogguf writes them; anything else is read one by one.
_DIGEST_LIST: Final = re.compile(
    rf'\[{_W}(?:"[0-9a-f]{{32}}"(?:{_W},{_W}"[0-9a-f]{{32}}")*+{_W})?\]'
)
_HEX32: Final = re.compile("[0-9a-f]{32}")
# Every 4096 items of a list read, a load looks at its stop.
_STOP_EVERY: Final = 4096
_AFTER_ITEM: Final = re.compile(rf"{_W}([,\]]){_W}")
# A tensor as ``manifest_json`` writes it (any spacing), read with one match; any other
# form of one goes through json's scanner.
_COUNT: Final = "(0|[1-9][0-9]{0,18})"
_TENSOR_AS_WRITTEN: Final = re.compile(
    rf'\{{{_W}"name"{_W}:{_W}"([^"\\\x00-\x1f]{{1,63}})"{_W},{_W}"file"{_W}:{_W}{_COUNT}'
    rf'{_W},{_W}"offset"{_W}:{_W}{_COUNT}{_W},{_W}"nbytes"{_W}:{_W}{_COUNT}{_W},{_W}'
    rf'"xxh3_128"{_W}:{_W}"([0-9a-f]{{32}})"{_W}\}}'
)
_KINDS: Final = {"{": "an object", "[": "a list", '"': "a string", "t": "a boolean"}
_KINDS_MORE: Final = {"f": "a boolean", "n": "null"}
_STRING_FIELDS: Final = frozenset(
    {"format", "set_id", "name", "sha256", "header_xxh3_128", "xxh3_128"}
)


@dataclass(frozen=True, slots=True)
class _ReadFile:
    """A file's fields, each checked, before ``block_bytes`` is known to check the
    number of its blocks (the fields of an object come in any order)."""

    field: str
    name: str
    size: int
    header_bytes: int
    data_end: int
    sha256: bytes
    header_xxh3_128: bytes
    blocks: tuple[bytes, ...]


class _Parser:
    """Reads one manifest's text in the shape a manifest has (an object of scalars and
    two lists of objects, a file's blocks a list of strings), checking each value as it
    is read: every error names the field, or the character where the text stops being
    JSON. No value is built that the manifest does not hold."""

    def __init__(self, text: str, where: str | None) -> None:
        self.text = text
        self.check = _Reader(where)
        # A scanner of its own: json's keeps a memo of keys during each call.
        decoder = json.JSONDecoder(parse_constant=_refuse_constant)
        self.scan = make_scanner(cast(Any, decoder))

    def syntax(self, pos: int, problem: str) -> ManifestError:
        return self.check.error("", f"not JSON: {problem} at character {pos}")

    def skip(self, pos: int) -> int:
        end = _WS.match(self.text, pos)
        return end.end() if end else pos

    def char(self, pos: int) -> str:
        return self.text[pos : pos + 1]

    def kind(self, pos: int) -> str:
        """What the value at ``pos`` is, from its first character, for a message."""
        c = self.char(pos)
        return _KINDS.get(c) or _KINDS_MORE.get(c) or ("a number" if c else "nothing")

    def scalar(self, pos: int, field: str) -> tuple[object, int]:
        """The number, string, boolean or null at ``pos``, and where it ends; a list or
        an object there is refused (no field of a manifest holds one here)."""
        if self.char(pos) in ("[", "{"):
            expected = "a string" if field.rsplit(".", 1)[-1] in _STRING_FIELDS else "an integer"
            raise self.check.error(field, f"expected {expected}, got {self.kind(pos)}")
        return self.value(pos)

    def value(self, pos: int) -> tuple[object, int]:
        try:
            value, end = self.scan(self.text, pos)
        except StopIteration:
            raise self.syntax(pos, "expected a value") from None
        except ValueError as exc:  # json.JSONDecodeError, NaN, an int of 4300+ digits
            raise self.check.error("", f"not JSON: {exc}") from None
        return value, end

    def members(
        self,
        pos: int,
        field: str,
        keys: frozenset[str],
        read: Callable[[str, str, int], tuple[object, int]],
    ) -> tuple[dict[str, object], int]:
        """The object at ``pos``: each member read by ``read(key, field, pos)``; a key
        not in ``keys`` or given twice is refused at once, a missing one at the end."""
        if self.char(pos) != "{":
            raise self.check.error(field, f"expected an object, got {self.kind(pos)}")
        found: dict[str, object] = {}
        pos = self.skip(pos + 1)
        if self.char(pos) == "}":
            return self.complete(found, field, keys), pos + 1
        while True:
            if self.char(pos) != '"':
                raise self.syntax(pos, "expected a field name in double quotes")
            key, pos = self.value(pos)
            assert isinstance(key, str)
            pos = self.skip(pos)
            if self.char(pos) != ":":
                raise self.syntax(pos, "expected ':'")
            pos = self.skip(pos + 1)
            name = f"{field}.{key}" if field else key
            if key not in keys:
                raise self.check.error(field, f"unknown field {key[:40]!r}")
            if key in found:
                raise self.check.error(name, "given twice")
            found[key], pos = read(key, name, pos)
            pos = self.skip(pos)
            c = self.char(pos)
            if c == "}":
                return self.complete(found, field, keys), pos + 1
            if c != ",":
                raise self.syntax(pos, "expected ',' or '}'")
            pos = self.skip(pos + 1)

    def complete(
        self, found: dict[str, object], field: str, keys: frozenset[str]
    ) -> dict[str, object]:
        missing = sorted(keys - found.keys())
        if missing:
            raise self.check.error(field, f"missing {', '.join(missing)}")
        return found

    def items(
        self, pos: int, field: str, limit: int, read: Callable[[str, int], tuple[object, int]]
    ) -> tuple[list[object], int]:
        """The list at ``pos``, each item read by ``read(field, pos)``; more than
        ``limit`` items are refused as the one past the limit is reached."""
        if self.char(pos) != "[":
            raise self.check.error(field, f"expected a list, got {self.kind(pos)}")
        found: list[object] = []
        pos = self.skip(pos + 1)
        if self.char(pos) == "]":
            return found, pos + 1
        while True:
            if len(found) == limit:
                raise self.check.error(field, f"more than {limit} items")
            if not len(found) % _STOP_EVERY:  # 10^5 tensors take a second
                raise_if_stopped()
            item, pos = read(f"{field}[{len(found)}]", pos)
            found.append(item)
            after = _AFTER_ITEM.match(self.text, pos)
            if after is None:
                raise self.syntax(self.skip(pos), "expected ',' or ']'")
            if after.group(1) == "]":
                return found, after.end()
            pos = after.end()

    def manifest(self) -> Manifest:
        pos = self.skip(0)
        if not self.char(pos):
            raise self.syntax(pos, "no value")
        if self.char(pos) != "{":
            raise self.check.error("", f"expected an object, got {self.kind(pos)}")
        top, pos = self.members(pos, "", _TOP_KEYS, self.top_member)
        if self.skip(pos) != len(self.text):
            raise self.syntax(self.skip(pos), "extra data after the manifest")
        check = self.check
        if top["format"] != FORMAT_NAME:
            raise check.error(
                "format", f"expected {FORMAT_NAME!r}, got {str(top['format'])[:80]!r}"
            )
        version = check.integer(top["version"], "version", 1)
        if version != FORMAT_VERSION:
            raise check.error(
                "version", f"version {version}; this aiogguf reads version {FORMAT_VERSION}"
            )
        block_bytes = check.integer(
            top["block_bytes"], "block_bytes", MIN_BLOCK_BYTES, MAX_BLOCK_BYTES + 1
        )
        if block_bytes & (block_bytes - 1):
            raise check.error("block_bytes", f"expected a power of two, got {block_bytes}")
        read_files = top["files"]
        assert isinstance(read_files, list)
        if not read_files:
            raise check.error("files", "expected at least one file")
        files = tuple(check.blocks_of(f, block_bytes) for f in read_files)
        read_tensors = top["tensors"]
        assert isinstance(read_tensors, list)
        tensors = tuple(check.placed(t, f"tensors[{i}]", files) for i, t in enumerate(read_tensors))
        seen: set[str] = set()
        for i, t in enumerate(tensors):
            if t.name in seen:
                raise check.error(f"tensors[{i}].name", f"tensor {t.name!r} is listed twice")
            seen.add(t.name)
        set_id = check.digest(top["set_id"], "set_id", _SHA256_HEX).hex()
        if set_id != compute_set_id(block_bytes, files, tensors):
            raise check.error(
                "set_id", "does not match the manifest's contents (edited or damaged)"
            )
        return Manifest(block_bytes=block_bytes, files=files, tensors=tensors, set_id=set_id)

    def top_member(self, key: str, field: str, pos: int) -> tuple[object, int]:
        if key == "files":
            return self.items(pos, field, MAX_FILES, self.file)
        if key == "tensors":
            limit = MAX_MANIFEST_BYTES // 64  # no tensor entry is shorter
            return self.items(pos, field, limit, self.tensor)
        return self.scalar(pos, field)

    def file(self, field: str, pos: int) -> tuple[_ReadFile, int]:
        raw, pos = self.members(pos, field, _FILE_KEYS, self.file_member)
        check = self.check
        size = check.integer(raw["size"], f"{field}.size")
        header = check.integer(raw["header_bytes"], f"{field}.header_bytes", 0, size + 1)
        data_end = check.integer(raw["data_end"], f"{field}.data_end", header, size + 1)
        blocks = raw["blocks"]
        assert isinstance(blocks, tuple)
        read = _ReadFile(
            field=field,
            name=check.text(raw["name"], f"{field}.name", MAX_NAME_CHARS),
            size=size,
            header_bytes=header,
            data_end=data_end,
            sha256=check.digest(raw["sha256"], f"{field}.sha256", _SHA256_HEX),
            header_xxh3_128=check.digest(
                raw["header_xxh3_128"], f"{field}.header_xxh3_128", _XXH_HEX
            ),
            blocks=blocks,
        )
        return read, pos

    def file_member(self, key: str, field: str, pos: int) -> tuple[object, int]:
        if key != "blocks":
            return self.scalar(pos, field)
        whole = _DIGEST_LIST.match(self.text, pos)
        if whole is not None:  # as aiogguf writes them: found a MiB of text at a time
            blocks: list[bytes] = []
            at, end = pos, whole.end()
            while at < end:
                cut = self.text.find(",", at + (1 << 20), end)  # no digest holds a comma
                cut = end if cut < 0 else cut
                blocks += map(bytes.fromhex, _HEX32.findall(self.text, at, cut))
                at = cut
            return tuple(blocks), end

        def digest(item: str, at: int) -> tuple[bytes, int]:
            value, end = self.scalar(at, item)
            return self.check.digest(value, item, _XXH_HEX), end

        read, pos = self.items(pos, field, MAX_MANIFEST_BYTES // 34, digest)
        return tuple(read), pos

    def tensor(self, field: str, pos: int) -> tuple[TensorHash, int]:
        written = _TENSOR_AS_WRITTEN.match(self.text, pos)
        if written is not None:  # as aiogguf writes it: one match, nothing to unescape
            name, file, offset, nbytes, digest = written.groups()
            t = TensorHash(name, int(file), int(offset), int(nbytes), bytes.fromhex(digest))
            if len(name.encode()) <= MAX_TENSOR_NAME_BYTES and max(t.offset, t.nbytes) < _INT_LIMIT:
                return t, written.end()
        if _FLAT_OBJECT.match(self.text, pos) is not None:  # decoded by json in one call
            raw, end = self.value(pos)
            assert isinstance(raw, dict)
            self.check.obj(raw, field, _TENSOR_KEYS)
        else:
            raw, end = self.members(pos, field, _TENSOR_KEYS, self.tensor_member)
        return self.check.tensor(raw, field), end

    def tensor_member(self, key: str, field: str, pos: int) -> tuple[object, int]:
        return self.scalar(pos, field)


class _Reader:
    """Checks the values of one manifest, field by field; every error names the field."""

    def __init__(self, path: str | None) -> None:
        self.path = path

    def error(self, field: str, problem: str) -> ManifestError:
        return ManifestError(self.path, field, problem)

    def obj(self, value: dict[str, object], field: str, keys: frozenset[str]) -> None:
        if value.keys() == keys:
            return
        missing = sorted(keys - value.keys())
        if missing:
            raise self.error(field, f"missing {', '.join(missing)}")
        unknown = sorted(str(k)[:40] for k in value.keys() - keys)
        if unknown:
            raise self.error(field, f"unknown field {unknown[0]!r}")

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

    def blocks_of(self, read: _ReadFile, block_bytes: int) -> FileHashes:
        """``read`` once ``block_bytes`` is known: its blocks counted."""
        n_blocks = -(-(read.data_end - read.header_bytes) // block_bytes)
        if len(read.blocks) != n_blocks:
            raise self.error(
                f"{read.field}.blocks",
                f"expected {n_blocks} blocks for {read.data_end - read.header_bytes} data "
                f"bytes, got {len(read.blocks)}",
            )
        return FileHashes(
            name=read.name,
            size=read.size,
            header_bytes=read.header_bytes,
            data_end=read.data_end,
            sha256=read.sha256,
            header_xxh3_128=read.header_xxh3_128,
            blocks=read.blocks,
        )

    def tensor(self, raw: Mapping[str, object], field: str) -> TensorHash:
        """A tensor's own fields checked; where it lies is checked by ``placed``."""
        name = self.text(raw["name"], f"{field}.name", MAX_TENSOR_NAME_BYTES)
        if len(name.encode()) > MAX_TENSOR_NAME_BYTES:
            raise self.error(f"{field}.name", f"more than {MAX_TENSOR_NAME_BYTES} bytes")
        return TensorHash(
            name=name,
            file=self.integer(raw["file"], f"{field}.file", 0, MAX_FILES),
            offset=self.integer(raw["offset"], f"{field}.offset"),
            nbytes=self.integer(raw["nbytes"], f"{field}.nbytes"),
            xxh3_128=self.digest(raw["xxh3_128"], f"{field}.xxh3_128", _XXH_HEX),
        )

    def placed(self, t: TensorHash, field: str, files: Sequence[FileHashes]) -> TensorHash:
        """``t``, once the files are known: inside its file's data section."""
        if t.file < len(files):
            f = files[t.file]
            if f.header_bytes <= t.offset and t.offset + t.nbytes <= f.data_end:
                return t
        self.integer(t.file, f"{field}.file", 0, len(files))
        f = files[t.file]
        self.integer(t.offset, f"{field}.offset", f.header_bytes, f.data_end + 1)
        self.integer(t.nbytes, f"{field}.nbytes", 0, f.data_end - t.offset + 1)
        return t


def _kind(value: object) -> str:
    """What a JSON value is, for a message."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    return names.get(type(value), f"a number ({str(value)[:40]})")
