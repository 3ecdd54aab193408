"""The parse stage: a GGUF file's header → ``ParsedFile`` (design §1.1, format §1, §2).

Only header bytes are read, in growing chunks; the data section is never mapped or read.
Every count and length is checked against the bytes left in the *file* before anything is
read or allocated, so a hostile header ends in a ``GGUFFormatError`` naming the offset and
the field, never in a ``MemoryError`` or a read of gigabytes.

The byte walk is synchronous (``parse_header``) and runs on one of the load's threads; it
can be resumed: when the buffer ends before the header does, it raises ``NeedMoreBytes``
and keeps everything parsed so far, so ``read_header`` only reads more and calls it again.
"""

from __future__ import annotations

import math
import os
import re
import struct
from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType
from typing import Final

import anyio
import numpy as np

from aiogguf._records import (
    GGUFArray,
    MetadataEntry,
    MetadataValue,
    ParsedFile,
    StringItems,
    TensorInfo,
    ValueType,
)
from aiogguf.errors import GGUFError, GGUFFormatError, LoadError, SplitError, from_os_error
from aiogguf.io.files import align_up
from aiogguf.io.ggml_types import GGML_TYPE_COUNT, GGML_TYPES
from aiogguf.io.opener import OpenFiles
from aiogguf.io.workers import LoadThreads, raise_if_stopped

__all__ = [
    "NeedMoreBytes",
    "is_split",
    "parse_file",
    "parse_header",
    "parse_model",
    "read_header",
    "read_header_from",
    "split_paths",
]

GGUF_MAGIC: Final = b"GGUF"
DEFAULT_ALIGNMENT: Final = 32
# Limits of ggml's C reader (format §1.5.2, §1.5.4, §1.6).
MAX_STRING_BYTES: Final = 1 << 30
MAX_ARRAY_ITEMS: Final = 1 << 30
MAX_NAME_BYTES: Final = 63
MAX_DIMS: Final = 4
# The C reader reads counts and dims as int64: the top bit set means negative.
INT64_LIMIT: Final = 1 << 63
U64_LIMIT: Final = 1 << 64
# Our own sanity bounds (format §1.9): the smallest possible KV and tensor-info records.
MIN_KV_BYTES: Final = 8 + 1 + 4 + 1
MIN_TENSOR_INFO_BYTES: Final = 8 + 4 + 4 + 8
# Nested arrays are walked recursively; no standard key nests at all, so a deep nest is
# an attack on the recursion limit, not data.
MAX_ARRAY_DEPTH: Final = 16
SPLIT_MAX_COUNT: Final = 65535  # split.count is a u16
# The other splits of a set are parsed by this many workers at most, in split order.
MAX_SPLIT_PARSERS: Final = 8

# Magics of ggml's older formats and of a byte-reversed GGUF, named in the magic error.
_OTHER_MAGICS: Final = frozenset({b"GGML", b"GGMF", b"GGJT", b"FUGG", b"lmgg", b"fmgg", b"tjgg"})

# Enough for a header without a large vocabulary. Each load pays its first read in fresh
# memory (page faults); bigger headers grow it ``GROWTH_FACTOR`` times per read.
FIRST_READ_BYTES: Final = 64 << 10
GROWTH_FACTOR: Final = 4
# String arrays at least this long are decoded on first use (``StringItems``).
LAZY_STRINGS_FROM: Final = 256
# How often the walk looks whether its load was cancelled (``raise_if_stopped``): every
# 256 records, every 64 Ki strings of a long array, every 64 MiB read; each far below a
# second of work.
_RECORDS_PER_STOP_CHECK_MASK: Final = 255
_STRINGS_PER_STOP_CHECK: Final = 1 << 16
_READ_CALL_BYTES: Final = 64 << 20

# value type → (struct code, numpy code, bytes). STRING and ARRAY are not fixed-size.
_FIXED: Final[dict[ValueType, tuple[str, str, int]]] = {
    ValueType.UINT8: ("B", "u1", 1),
    ValueType.INT8: ("b", "i1", 1),
    ValueType.UINT16: ("H", "u2", 2),
    ValueType.INT16: ("h", "i2", 2),
    ValueType.UINT32: ("I", "u4", 4),
    ValueType.INT32: ("i", "i4", 4),
    ValueType.FLOAT32: ("f", "f4", 4),
    ValueType.BOOL: ("B", "u1", 1),
    ValueType.UINT64: ("Q", "u8", 8),
    ValueType.INT64: ("q", "i8", 8),
    ValueType.FLOAT64: ("d", "f8", 8),
}
# Smallest encoding of one array item, to bound a count against the bytes left.
_MIN_ITEM_BYTES: Final[dict[ValueType, int]] = {
    **{vt: size for vt, (_, _, size) in _FIXED.items()},
    ValueType.STRING: 8,
    ValueType.ARRAY: 12,
}
_VALUE_TYPES: Final[dict[int, ValueType]] = {int(vt): vt for vt in ValueType}


class NeedMoreBytes(Exception):
    """The buffer ends before the header does; ``end`` is the file size needed at least.

    Internal to the parse stage: ``parse_file`` reads more and resumes. Raised only when
    the file itself is longer than the buffer.
    """

    def __init__(self, end: int) -> None:
        super().__init__(end)
        self.end = end


class _HeaderParser:
    """A resumable walk over one file's header bytes.

    State advances one whole record at a time (a KV pair, a tensor-info record), so a
    ``NeedMoreBytes`` leaves it at the start of the record it could not finish. Long string
    arrays (vocabularies) also keep the items read so far, so growing the buffer never
    decodes a string twice.
    """

    def __init__(self, path: str, file_size: int) -> None:
        self.path = path
        self.file_size = file_size
        self.buf = b""
        self.n = 0
        self.stage = 0  # 0: fixed header, 1: metadata, 2: tensor infos
        self.pos = 0
        self.version = 0
        self.order = "<"
        self.n_tensors = 0
        self.n_kv = 0
        self.metadata: dict[str, MetadataEntry] = {}
        self.tensors: list[TensorInfo] = []
        self.names: dict[str, int] = {}
        self.alignment = DEFAULT_ALIGNMENT
        # An ordered set: a record re-parsed after NeedMoreBytes must not warn twice.
        self.warnings: dict[str, None] = {}
        self.loadable = True
        # string array data offset → (items decoded so far, offset of the next one)
        self.partial: dict[int, tuple[list[str], int]] = {}
        # long string array data offset → (items walked so far, offset of the next one)
        self.walked: dict[int, tuple[int, int]] = {}
        self._set_order("<")

    def _set_order(self, order: str) -> None:
        self.order = order
        self.u32 = struct.Struct(order + "I").unpack_from
        self.u64 = struct.Struct(order + "Q").unpack_from
        self.scalars = {vt: struct.Struct(order + code) for vt, (code, _, _) in _FIXED.items()}
        # A tensor's dims, by how many there are.
        self.dims = [struct.Struct(f"{order}{k}Q").unpack_from for k in range(MAX_DIMS + 1)]
        self.dtypes = {vt: np.dtype(order + npc) for vt, (_, npc, _) in _FIXED.items()}

    # --- helpers ---------------------------------------------------------------------

    def error(self, offset: int | None, field: str, problem: str) -> GGUFFormatError:
        return GGUFFormatError(self.path, offset, field, problem)

    def need(self, pos: int, size: int, field: str) -> None:
        """Make sure ``size`` bytes at ``pos`` are in the buffer, or say why they are not."""
        end = pos + size
        if end <= self.n:
            return
        if end > self.file_size:
            raise self.error(
                pos,
                field,
                f"needs {size} bytes but the file ends at byte {self.file_size} (truncated)",
            )
        raise NeedMoreBytes(end)

    def value_type(self, raw: int, pos: int, field: str) -> ValueType:
        vt = _VALUE_TYPES.get(raw)
        if vt is None:
            raise self.error(pos, field, f"unknown value type {raw} (expected 0..12)")
        return vt

    def string(self, pos: int, field: str) -> tuple[str, int]:
        """One GGUF string at ``pos``: its text and the offset just past it."""
        self.need(pos, 8, field + " length")
        (length,) = self.u64(self.buf, pos)
        if length > MAX_STRING_BYTES:
            raise self.error(
                pos, field, f"string length {length} exceeds the maximum of {MAX_STRING_BYTES}"
            )
        remaining = self.file_size - pos - 8
        if length > remaining:
            raise self.error(
                pos,
                field,
                f"string length {length} exceeds the {remaining} bytes left in the file",
            )
        self.need(pos + 8, length, field)
        try:
            text = self.buf[pos + 8 : pos + 8 + length].decode()
        except UnicodeDecodeError as exc:
            raise self.error(pos + 8 + exc.start, field, f"not valid UTF-8 ({exc.reason})") from exc
        return text, pos + 8 + length

    # --- the walk --------------------------------------------------------------------

    def parse(self, buf: bytes | bytearray | memoryview) -> ParsedFile:
        """Continue the walk over ``buf`` (the file's first ``len(buf)`` bytes)."""
        # One copy of a bytearray or memoryview, so the hot loops slice ``bytes``.
        self.buf = buf if isinstance(buf, bytes) else bytes(buf)
        self.n = min(len(buf), self.file_size)
        if self.stage == 0:
            self.parse_fixed_header()
            self.stage = 1
        while self.stage == 1 and len(self.metadata) < self.n_kv:
            if not len(self.metadata) & _RECORDS_PER_STOP_CHECK_MASK:
                raise_if_stopped()
            self.parse_kv()
        if self.stage == 1:
            self.resolve_alignment()
            self.stage = 2
        while len(self.tensors) < self.n_tensors:
            if not len(self.tensors) & _RECORDS_PER_STOP_CHECK_MASK:
                raise_if_stopped()
            self.parse_tensor_info()
        return self.finish()

    def parse_fixed_header(self) -> None:
        self.need(0, 4, "magic")
        magic = self.buf[:4]
        if magic != GGUF_MAGIC:
            # Only a known magic is repeated: the bytes of an arbitrary file are not
            # GGUF's to show (a server's client could read /etc/shadow's that way).
            found = f"found {magic!r}" if magic in _OTHER_MAGICS else "found other bytes"
            raise self.error(0, "magic", f"expected b'GGUF', {found}: not a GGUF file")
        self.need(4, 4, "version")
        (version,) = struct.unpack_from("<I", self.buf, 4)
        # Real versions are tiny, so a little-endian read with the low 16 bits all zero
        # means the file is big-endian (format §1.4); the magic is never swapped.
        if version and version & 0xFFFF == 0:
            self._set_order(">")
            (version,) = self.u32(self.buf, 4)
        if version == 1:
            raise self.error(
                4, "version", "GGUF v1 is not supported (v2 widened its counts to 64 bits)"
            )
        if version not in (2, 3):
            raise self.error(4, "version", f"unsupported GGUF version {version} (expected 2 or 3)")
        self.version = version
        self.need(8, 16, "tensor_count and kv_count")
        (n_tensors,) = self.u64(self.buf, 8)
        (n_kv,) = self.u64(self.buf, 16)
        for offset, field, count, min_bytes in (
            (8, "tensor_count", n_tensors, MIN_TENSOR_INFO_BYTES),
            (16, "kv_count", n_kv, MIN_KV_BYTES),
        ):
            if count >= INT64_LIMIT:
                raise self.error(offset, field, f"{count} is negative as an int64")
            if count * min_bytes > self.file_size:
                raise self.error(
                    offset,
                    field,
                    f"{count} records need at least {count * min_bytes} bytes "
                    f"but the file has {self.file_size}",
                )
        self.n_tensors, self.n_kv = n_tensors, n_kv
        self.pos = 24

    def parse_kv(self) -> None:
        index = len(self.metadata)
        start = self.pos
        key, pos = self.string(start, f"metadata #{index} key")
        if not key:
            raise self.error(start, f"metadata #{index} key", "empty key")
        if key in self.metadata:
            first = self.metadata[key].offset
            raise self.error(start, f"metadata '{key}'", f"duplicate key (first at offset {first})")
        field = f"metadata '{key}'"
        self.need(pos, 4, field + " type")
        vt = self.value_type(self.u32(self.buf, pos)[0], pos, field + " type")
        value, pos = self.value(vt, pos + 4, field, 0)
        self.metadata[key] = MetadataEntry(key, vt, value, start)
        self.pos = pos

    def value(self, vt: ValueType, pos: int, field: str, depth: int) -> tuple[MetadataValue, int]:
        if vt is ValueType.STRING:
            return self.string(pos, field)
        if vt is ValueType.ARRAY:
            return self.array(pos, field, depth)
        scalar = self.scalars[vt]
        self.need(pos, scalar.size, field)
        (raw,) = scalar.unpack_from(self.buf, pos)
        if vt is ValueType.BOOL:
            if raw > 1:
                self.warnings[f"{field}: bool byte {raw} at offset {pos} is not 0 or 1"] = None
            return bool(raw), pos + 1
        value: int | float = raw
        return value, pos + scalar.size

    def array(self, pos: int, field: str, depth: int) -> tuple[GGUFArray, int]:
        self.need(pos, 12, field + " array header")
        item_vt = self.value_type(self.u32(self.buf, pos)[0], pos, field + " item type")
        (count,) = self.u64(self.buf, pos + 4)
        if count >= INT64_LIMIT:
            raise self.error(pos + 4, field, f"array count {count} is negative as an int64")
        if count > MAX_ARRAY_ITEMS:
            raise self.error(
                pos + 4, field, f"array count {count} exceeds the maximum of {MAX_ARRAY_ITEMS}"
            )
        start = pos + 12
        least = count * _MIN_ITEM_BYTES[item_vt]
        remaining = self.file_size - start
        if least > remaining:
            raise self.error(
                pos + 4,
                field,
                f"array of {count} {item_vt.json_name} items needs at least {least} bytes "
                f"but {remaining} are left in the file",
            )
        if item_vt is ValueType.ARRAY:
            return self.nested_array(start, count, field, depth)
        if item_vt is ValueType.STRING:
            return self.string_array(start, count, field)
        nbytes = count * _FIXED[item_vt][2]
        self.need(start, nbytes, field)
        raw = np.frombuffer(self.buf, dtype=self.dtypes[item_vt], count=count, offset=start)
        if item_vt is ValueType.BOOL:
            if count and int(raw.max()) > 1:
                self.warnings[f"{field}: bool array holds bytes other than 0 and 1"] = None
            values = raw != 0
        else:
            # A copy in native byte order: the array must not pin the header buffer.
            values = raw.astype(raw.dtype.newbyteorder("="))
        values.flags.writeable = False
        return GGUFArray(item_vt, values), start + nbytes

    def nested_array(self, pos: int, count: int, field: str, depth: int) -> tuple[GGUFArray, int]:
        if depth + 1 >= MAX_ARRAY_DEPTH:
            raise self.error(pos, field, f"arrays nested deeper than {MAX_ARRAY_DEPTH} levels")
        if self.loadable:
            self.warnings[f"{field}: array of arrays; llama.cpp cannot load this file"] = None
            self.loadable = False
        items: list[GGUFArray] = []
        for k in range(count):
            if not k & _RECORDS_PER_STOP_CHECK_MASK:
                raise_if_stopped()
            item, pos = self.array(pos, f"{field}[{k}]", depth + 1)
            items.append(item)
        return GGUFArray(ValueType.ARRAY, tuple(items)), pos

    def string_array(self, pos: int, count: int, field: str) -> tuple[GGUFArray, int]:
        if count >= LAZY_STRINGS_FROM:
            return self.lazy_string_array(pos, count, field)
        # One unpack, one slice and one decode per item. A length prefix past the buffer
        # (struct.error) or a string that is too long or ends past the buffer leaves the
        # loop for the careful path in ``string``, which raises the precise error or
        # NeedMoreBytes.
        items, p = self.partial.pop(pos, ([], pos))
        buf, n, u64, limit = self.buf, self.n, self.u64, MAX_STRING_BYTES
        append = items.append
        start = p
        try:
            for _ in range(len(items), count):
                start = p
                (length,) = u64(buf, start)
                p = start + 8 + length
                if p > n or length > limit:
                    break
                append(buf[start + 8 : p].decode())
            else:
                return GGUFArray(ValueType.STRING, tuple(items)), p
        except struct.error:
            pass  # the length of the string at ``start`` is not in the buffer
        except UnicodeDecodeError as exc:
            raise self.error(
                start + 8 + exc.start, f"{field}[{len(items)}]", f"not valid UTF-8 ({exc.reason})"
            ) from exc
        self.partial[pos] = (items, start)
        self.string(start, f"{field}[{len(items)}]")  # raises: the loop stops only on trouble
        raise AssertionError("unreachable: string() accepted what the loop refused")

    def lazy_string_array(self, pos: int, count: int, field: str) -> tuple[GGUFArray, int]:
        """The hot loop of the parser (10^5-token vocabularies, their merges): only the
        lengths are walked, to find where the array ends; the items are decoded on first
        use (``StringItems``). Trouble leaves the loop as in ``string_array``."""
        done, p = self.walked.pop(pos, (0, pos))
        buf, n, u64, limit = self.buf, self.n, self.u64, MAX_STRING_BYTES
        start = p
        block = i = done
        try:
            while block < count:
                raise_if_stopped()  # once per block of strings: nothing per string
                for i in range(block, min(count, block + _STRINGS_PER_STOP_CHECK)):
                    start = p
                    (length,) = u64(buf, start)
                    p = start + 8 + length
                    if p > n or length > limit:
                        done = i
                        break
                else:
                    block += _STRINGS_PER_STOP_CHECK
                    continue
                break
            else:
                items = StringItems(
                    buf[pos:p],
                    count,
                    byte_order=self.order,
                    path=self.path,
                    start=pos,
                    field=field,
                )
                return GGUFArray(ValueType.STRING, items), p
        except struct.error:
            done = i  # the length of the string at ``start`` is not in the buffer
        self.walked[pos] = (done, start)
        self.string(start, f"{field}[{done}]")  # raises: the loop stops only on trouble
        raise AssertionError("unreachable: string() accepted what the loop refused")

    def resolve_alignment(self) -> None:
        entry = self.metadata.get("general.alignment")
        if entry is None:
            return
        if entry.type is not ValueType.UINT32:
            raise self.error(
                entry.offset,
                "general.alignment",
                f"must be of type uint32, found {entry.type.json_name}",
            )
        assert isinstance(entry.value, int)
        alignment = entry.value
        if alignment == 0 or alignment & (alignment - 1):
            raise self.error(
                entry.offset, "general.alignment", f"{alignment} is not a power of two"
            )
        if alignment < 8:
            self.warnings[f"general.alignment is {alignment}; the spec asks for >= 8"] = None
        self.alignment = alignment

    def parse_tensor_info(self) -> None:
        # Once per tensor (10^3 of them in a big model): messages and field names are
        # made only on trouble, each bounds check is one comparison when all is well.
        index = len(self.tensors)
        start = self.pos
        buf, n = self.buf, self.n
        if start + 8 <= n and (length := self.u64(buf, start)[0]) <= MAX_NAME_BYTES:
            pos = start + 8 + length
            try:
                name = buf[start + 8 : pos].decode() if pos <= n else None
            except UnicodeDecodeError:
                name = None
        else:
            name = None
        if name is None:  # the careful path words what is wrong
            name, pos = self.string(start, f"tensor #{index} name")
            name_bytes = pos - start - 8
            raise self.error(
                start,
                f"tensor #{index} name",
                f"'{name[:80]}' is {name_bytes} bytes; the limit is {MAX_NAME_BYTES}",
            )
        if name in self.names:
            raise self.error(
                start,
                f"tensor '{name}'",
                f"duplicate tensor name (first at offset {self.names[name]})",
            )
        if pos + 4 > n:
            self.need(pos, 4, f"tensor '{name}' n_dims")
        (n_dims,) = self.u32(buf, pos)
        if n_dims > MAX_DIMS:
            raise self.error(
                pos, f"tensor '{name}' n_dims", f"{n_dims} dimensions; at most {MAX_DIMS}"
            )
        pos += 4
        if pos + 8 * n_dims > n:
            self.need(pos, 8 * n_dims, f"tensor '{name}' dims")
        shape = self.dims[n_dims](buf, pos)
        if shape and max(shape) >= INT64_LIMIT:
            k = next(k for k, dim in enumerate(shape) if dim >= INT64_LIMIT)
            raise self.error(
                pos + 8 * k, f"tensor '{name}' ne[{k}]", f"{shape[k]} is negative as int64"
            )
        n_elements = math.prod(shape)
        # ggml's guard: with every dim > 0, each running product stays below INT64_MAX
        # (the dims are positive, so the last product is the largest).
        if n_elements >= INT64_LIMIT - 1 and all(shape):
            raise self.error(
                pos, f"tensor '{name}' dims", f"element count of {list(shape)} overflows int64"
            )
        pos += 8 * n_dims
        if pos + 12 > n:
            self.need(pos, 4, f"tensor '{name}' type")
        (type_id,) = self.u32(buf, pos)
        gtype = GGML_TYPES[type_id] if type_id < GGML_TYPE_COUNT else None
        ne0 = shape[0] if shape else 1
        if gtype is None or not gtype.valid or ne0 % gtype.block_elems:
            self.bad_type(name, pos, type_id, ne0)
        assert gtype is not None
        nbytes = n_elements // gtype.block_elems * gtype.block_bytes
        if nbytes >= U64_LIMIT:
            raise self.error(pos, f"tensor '{name}'", f"{nbytes} bytes do not fit in 64 bits")
        pos += 4
        if pos + 8 > n:
            self.need(pos, 8, f"tensor '{name}' offset")
        (offset,) = self.u64(buf, pos)
        self.tensors.append(TensorInfo(name, gtype, shape, offset, nbytes, n_elements, start))
        self.names[name] = start
        self.pos = pos + 8

    def bad_type(self, name: str, pos: int, type_id: int, ne0: int) -> None:
        """Raise the error for a tensor's type id that is unknown, removed, or whose block
        does not divide ``ne[0]``."""
        field = f"tensor '{name}' type"
        if type_id >= GGML_TYPE_COUNT:
            raise self.error(
                pos, field, f"unknown ggml type id {type_id} (expected 0..{GGML_TYPE_COUNT - 1})"
            )
        gtype = GGML_TYPES[type_id]
        if not gtype.valid:
            raise self.error(
                pos,
                field,
                f"ggml type id {type_id} ({gtype.name}) was removed from ggml; "
                "files using it cannot be loaded",
            )
        raise self.error(
            pos,
            field,
            f"ne[0] = {ne0} is not a multiple of {gtype.name}'s block of "
            f"{gtype.block_elems} elements",
        )

    def finish(self) -> ParsedFile:
        end_of_infos = self.pos
        # The writers always pad, also with no tensors; the C reader then skips the pad,
        # which may point past EOF (a vocab-only file), so that case is not an error.
        data_offset = align_up(end_of_infos, self.alignment)
        if self.tensors and data_offset > self.file_size:
            raise self.error(
                end_of_infos,
                "data section",
                f"starts at {data_offset} (padded to {self.alignment}) but the file ends at "
                f"{self.file_size} (truncated)",
            )
        # ggml's C reader demands exact packing in file order (format §1.8).
        expected = 0
        for info in self.tensors:
            if info.offset != expected:
                raise self.error(
                    info.info_offset,
                    f"tensor '{info.name}' offset",
                    f"{info.offset}, expected {expected} (tensors must follow each other in "
                    f"file order, each padded to {self.alignment} bytes)",
                )
            expected += align_up(info.nbytes, self.alignment)
            if data_offset + expected >= U64_LIMIT:
                raise self.error(
                    info.info_offset, f"tensor '{info.name}'", "data section size overflows 64 bits"
                )
        return ParsedFile(
            path=self.path,
            version=self.version,
            byte_order="little" if self.order == "<" else "big",
            alignment=self.alignment,
            data_offset=data_offset,
            file_size=self.file_size,
            metadata=MappingProxyType(self.metadata),
            tensors=tuple(self.tensors),
            warnings=tuple(self.warnings),
            llama_cpp_loadable=self.loadable,
        )


def parse_header(
    buf: bytes | bytearray | memoryview, path: str | os.PathLike[str], file_size: int
) -> ParsedFile:
    """Parse a GGUF header held in memory (synchronous; safe to call from a thread).

    ``buf``: the file's first bytes (all of them, or at least the whole header).
    ``path``: the file's name, for messages.
    ``file_size``: the size of the whole file; limits are checked against it.
    Returns the parsed header.
    Raises ``GGUFFormatError``: the header is malformed; the message names the offset and field.
    Raises ``NeedMoreBytes``: ``buf`` ends inside the header and the file is longer.
    """
    return _HeaderParser(os.fspath(path), file_size).parse(buf)


async def parse_file(
    path: str | os.PathLike[str],
    *,
    threads: LoadThreads | None = None,
    files: OpenFiles | None = None,
) -> ParsedFile:
    """Parse one GGUF file's header, reading only as many bytes as the header needs.

    ``path``: the file.
    ``threads``: the load's threads; the whole parse is one call on one of them
        (default: a thread of its own).
    ``files``: the load's open files: ``path`` is opened through it (under its
        opener's policy) and stays open there for the later stages. Default: a table of
        its own, any path, closed on return.
    Returns the parsed header; the data section is not read.
    Raises ``GGUFFormatError``: the file is not a valid GGUF file.
    Raises ``PathNotAllowedError``: the opener of ``files`` refuses ``path``.
    Raises ``LoadError``: the file cannot be opened or read (``__cause__`` is the OSError).
    """
    if files is None:
        with OpenFiles() as own:
            return await parse_file(path, threads=threads, files=own)
    if threads is None:
        async with LoadThreads(1, name="aiogguf-parse") as own_threads:
            return await parse_file(path, threads=own_threads, files=files)
    return await threads.run_sync(read_header, os.fspath(path), files)


def read_header(path: str, files: OpenFiles) -> ParsedFile:
    """Blocking: open ``path`` through ``files`` and parse its header (``read_header_from``)."""
    fd = files.open(path)
    try:
        # Through the descriptor, never the name: it is the file the opener allowed.
        size = os.lseek(fd, 0, os.SEEK_END)
        return read_header_from(path, size, lambda at, n: _pread_upto(fd, at, n))
    except OSError as exc:
        raise from_os_error(exc, path, None, "cannot read the file") from exc


def read_header_from(path: str, file_size: int, read: Callable[[int, int], bytes]) -> ParsedFile:
    """Blocking: parse the header of ``path`` (``file_size`` bytes) from ``read(offset,
    n)`` (up to ``n`` bytes, fewer only at the end), reading more (``GROWTH_FACTOR``
    times as much each time) until the parser has what it needs."""
    parser = _HeaderParser(path, file_size)
    data = b""
    target = min(file_size, FIRST_READ_BYTES)
    while True:
        while len(data) < target:
            raise_if_stopped()  # a header of GiBs is read in bounded calls
            part = read(len(data), min(target - len(data), _READ_CALL_BYTES))
            if not part:
                break
            data += part
        if len(data) < target:
            raise LoadError(path, len(data), f"short read: the file shrank below {target} bytes")
        try:
            return parser.parse(data)
        except NeedMoreBytes as more:
            # Grow geometrically (x4: a 10 MiB vocabulary costs three reads and three
            # resumed walks), never past the end of the file (the parser checked
            # ``more.end`` against it).
            target = min(file_size, max(more.end, GROWTH_FACTOR * len(data)))


def _pread_upto(fd: int, offset: int, nbytes: int) -> bytes:
    """Up to ``nbytes`` at ``offset``: fewer only at the end of the file."""
    parts: list[bytes] = []
    done = 0
    while done < nbytes:
        part = os.pread(fd, nbytes - done, offset + done)
        if not part:
            break
        parts.append(part)
        done += len(part)
    return b"".join(parts)


# The name of a split of a set (gguf-split's naming): ``<prefix>-00002-of-00005.gguf``.
_SPLIT_NAME = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


def split_count_from_name(path: str | os.PathLike[str]) -> int:
    """How many splits the name of ``path`` says its set has (1 for a single file)."""
    match = _SPLIT_NAME.search(Path(path).name)
    return int(match.group(2)) if match else 1


def split_paths(path: str | os.PathLike[str], split_no: int, split_count: int) -> list[str]:
    """The paths of every split of a set, derived from the path of split ``split_no``.

    The name must end in ``-<split_no+1:05d>-of-<split_count:05d>.gguf`` (format §2.2).

    Raises ``SplitError``: the name does not follow that pattern.
    """
    fspath = os.fspath(path)
    suffix = f"-{split_no + 1:05d}-of-{split_count:05d}.gguf"
    name = Path(fspath).name
    if not name.endswith(suffix) or len(name) == len(suffix):
        raise SplitError(
            fspath,
            f"invalid split file name: split {split_no + 1} of {split_count} must be named "
            f"'<prefix>{suffix}'",
        )
    prefix = fspath[: len(fspath) - len(suffix)]
    return [f"{prefix}-{i + 1:05d}-of-{split_count:05d}.gguf" for i in range(split_count)]


def is_split(first: ParsedFile) -> bool:
    """Whether a parsed file says it is one split of several (``split.count`` > 1).
    Raises ``SplitError``: ``split.count`` is not an integer."""
    count = first.split_int("split.count")
    return count is not None and count > 1


async def parse_model(
    path: str | os.PathLike[str],
    *,
    threads: LoadThreads | None = None,
    files: OpenFiles | None = None,
    first: ParsedFile | None = None,
) -> tuple[ParsedFile, ...]:
    """Parse a model: one file, or every split of a split set (concurrently).

    ``path``: a single-file model, or the **first** split of a set.
    ``threads``: the load's threads (see ``parse_file``); the other splits of a set are
        parsed on threads of their own, up to ``MAX_SPLIT_PARSERS`` at once, in order;
        the first that fails ends the walk (a ``split.count`` of 65535 with two files
        present opens three, not 65535).
    ``files``: the load's open files (see ``parse_file``); every split is opened
        through it. Default: a table of its own, closed on return.
    ``first``: ``path`` already parsed (through ``files``), when the caller has it.
    Returns one ``ParsedFile`` per file, in split order.
    Raises ``GGUFFormatError``: a file is malformed.
    Raises ``SplitError``: ``path`` is not the first split (the message names the first), or
        a split file is missing (named). Whether each split's ``split.no`` is its position
        is ``build_index``'s check.
    Raises ``PathNotAllowedError``: the opener of ``files`` refuses a file.
    Raises ``LoadError``: a file cannot be read.
    """
    if files is None:
        with OpenFiles() as own:
            return await parse_model(path, threads=threads, files=own, first=first)
    if first is None:
        first = await parse_file(path, threads=threads, files=files)
    count = first.split_int("split.count")
    if count is None or count <= 1:
        return (first,)
    if count > SPLIT_MAX_COUNT:
        raise SplitError(first.path, f"split.count {count} exceeds {SPLIT_MAX_COUNT}")
    split_no = first.split_int("split.no")
    if split_no is None:
        raise SplitError(first.path, f"split.count is {count} but split.no is missing")
    if not 0 <= split_no < count:
        raise SplitError(first.path, f"split.no {split_no} is outside 0..{count - 1}")
    paths = split_paths(first.path, split_no, count)
    if split_no != 0:
        raise SplitError(
            first.path,
            f"this is split {split_no + 1} of {count}; a split model must be opened from "
            f"its first split: {paths[0]}",
        )

    results: list[ParsedFile] = [first]
    found: dict[int, ParsedFile] = {}
    failed: dict[int, GGUFError] = {}
    # Split numbers in order, taken one at a time by a few workers: ``split.count`` is a
    # header value (up to 65535), so the work must follow the files that are there, not
    # the count: once a split fails, no worker takes a new one.
    todo = iter(range(1, count))
    n_workers = min(count - 1, MAX_SPLIT_PARSERS)

    async def parse_splits(split_threads: LoadThreads) -> None:
        for i in todo:
            if failed:
                return
            try:
                found[i] = await parse_file(paths[i], threads=split_threads, files=files)
            except LoadError as exc:
                if isinstance(exc.__cause__, FileNotFoundError):
                    failed[i] = SplitError(
                        paths[i], f"split {i + 1} of {count} is missing (needed by {first.path})"
                    )
                else:
                    failed[i] = exc
            except GGUFError as exc:
                failed[i] = exc

    async with (
        LoadThreads(n_workers, name="aiogguf-parse") as split_threads,
        anyio.create_task_group() as tg,
    ):
        for _ in range(n_workers):
            tg.start_soon(parse_splits, split_threads)
    if failed:
        # The lowest failed split: every lower one was taken before it and has been
        # parsed, so the message does not depend on scheduling.
        raise failed[min(failed)]
    results.extend(found[i] for i in range(1, count))
    # Each split's ``split.no`` and its agreement with the first are the index stage's
    # checks (``build_index``), made once for every way a set reaches it.
    return tuple(results)
