"""``GGUFReader``: a drop-in for gguf-py's reader whose tensor data aiogguf loads.

Code written against ``gguf.GGUFReader`` (vLLM's GGUF plugin, transformers, SGLang) runs
unchanged: ``fields`` (gguf-py's ``ReaderField``s, the same ``parts``, ``data``,
``types`` and ``contents()``), ``tensors`` (gguf-py's ``ReaderTensor``s in file order,
``data`` in gguf-py's shapes and dtypes, so that ``gguf.quants.dequantize(t.data,
t.tensor_type)`` works), ``get_field``, ``get_tensor``. The difference is where the
bytes come from: the constructor loads every tensor with ``aiogguf.load_sync`` (parallel
reads, every tensor checked), where gguf-py maps the file and leaves each page to fault
in when it is first touched. Needs the ``gguf`` extra (gguf-py's enums and tables).

Its errors are gguf-py's kinds as well as aiogguf's: a malformed file raises
``CompatFormatError`` (a ``GGUFFormatError`` and a ``ValueError``, as gguf-py's reader
raises ``ValueError``), a file that cannot be opened a ``CompatOSError`` (a ``LoadError``
and an ``OSError`` with its ``errno`` and ``filename``: ``CompatFileNotFoundError`` is a
``FileNotFoundError``...), so code written for either reader catches them.

Fields are made when first asked for: a vocabulary of 10^5 strings is 2·10^5 numpy
arrays in gguf-py's layout, which a reader that only wants the tensors never pays.
"""

from __future__ import annotations

import errno
import functools
import os
import struct
import sys
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar, Literal, NoReturn

import numpy as np
import numpy.typing as npt

from aiogguf._api import load_sync
from aiogguf._records import ParsedFile
from aiogguf._run import run
from aiogguf.errors import GGUFFormatError, LoadError, os_errors
from aiogguf.io._devices.cpu import CpuDevice
from aiogguf.io.byteswap import needs_swap
from aiogguf.stages.parse import is_split, parse_file, split_paths

try:
    from gguf.constants import (
        GGML_QUANT_SIZES,
        GGUF_DEFAULT_ALIGNMENT,
        GGMLQuantizationType,
        GGUFEndian,
        GGUFValueType,
    )
    from gguf.gguf_reader import ReaderField, ReaderTensor
except ImportError as exc:  # pragma: no cover - the extra is part of every test install
    raise ImportError(
        "aiogguf.compat._reader needs gguf-py: pip install 'aiogguf[gguf]' (or pip install gguf)"
    ) from exc

__all__ = [
    "CompatFileNotFoundError",
    "CompatFormatError",
    "CompatIsADirectoryError",
    "CompatOSError",
    "CompatPermissionError",
    "GGUFReader",
    "ReaderField",
    "ReaderTensor",
]


class CompatFormatError(GGUFFormatError, ValueError):
    """A malformed file, as the compat reader raises it: aiogguf's ``GGUFFormatError``
    (path, offset, field) and the ``ValueError`` gguf-py's reader raises."""


class CompatOSError(LoadError, OSError):
    """A file the compat reader cannot open or read: aiogguf's ``LoadError`` and an
    ``OSError`` with the ``errno``, ``strerror`` and ``filename`` of the failure, as
    gguf-py's reader raises it. ``str()`` is aiogguf's message (it names the path)."""

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        offset: int | None,
        problem: str,
        os_errno: int | None,
        strerror: str | None,
    ) -> None:
        super().__init__(path, offset, problem)
        self.errno = os_errno
        self.strerror = strerror
        self.filename: str | None = self.path

    def __str__(self) -> str:
        # OSError's would be "[Errno 2] ...": keep the one wording of every LoadError.
        return BaseException.__str__(self)


class CompatFileNotFoundError(CompatOSError, FileNotFoundError):
    """The file (or a shard of its split set) does not exist (``ENOENT``)."""


class CompatPermissionError(CompatOSError, PermissionError):
    """The file may not be read (``EACCES``, ``EPERM``)."""


class CompatIsADirectoryError(CompatOSError, IsADirectoryError):
    """The path names a directory (``EISDIR``)."""


# errno → the OSError subclass Python itself raises for it; any other is CompatOSError.
_OS_ERRORS: dict[int, type[CompatOSError]] = {
    errno.ENOENT: CompatFileNotFoundError,
    errno.EACCES: CompatPermissionError,
    errno.EPERM: CompatPermissionError,
    errno.EISDIR: CompatIsADirectoryError,
}

_SCALARS: dict[GGUFValueType, type[np.generic]] = {
    GGUFValueType.UINT8: np.uint8,
    GGUFValueType.INT8: np.int8,
    GGUFValueType.UINT16: np.uint16,
    GGUFValueType.INT16: np.int16,
    GGUFValueType.UINT32: np.uint32,
    GGUFValueType.INT32: np.int32,
    GGUFValueType.FLOAT32: np.float32,
    GGUFValueType.UINT64: np.uint64,
    GGUFValueType.INT64: np.int64,
    GGUFValueType.FLOAT64: np.float64,
    GGUFValueType.BOOL: np.bool_,
}
# Array items cut without a walk per item (_Header._flat_items).
_FLAT_ITEMS = frozenset(int(t) for t in (*_SCALARS, GGUFValueType.STRING))
# gguf-py's element types; every other type is its bytes, rows of blocks.
_ELEMENTS: dict[GGMLQuantizationType, type[np.generic]] = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class _Header:
    """A file's header bytes, cut into numpy views exactly as gguf-py's reader cuts its
    map of the file (its ``_get``, ``_get_str``, ``_get_field_parts``)."""

    def __init__(self, raw: npt.NDArray[np.uint8], byte_order: Literal["I", "S"]) -> None:
        self.raw = raw
        self.byte_order = byte_order
        self._length = np.dtype(np.uint64).newbyteorder(byte_order)
        host_little = sys.byteorder == "little"
        self._unpack_length = struct.Struct("<Q" if host_little == (byte_order == "I") else ">Q")

    def get(self, offset: int, dtype: type[np.generic], count: int = 1) -> npt.NDArray[Any]:
        count = int(count)
        end = offset + np.dtype(dtype).itemsize * count
        return self.as_read(self.raw[offset:end].view(dtype)[:count])

    def as_read(self, array: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """``array`` with the file's byte order, as gguf-py's ``_get`` marks it."""
        return array.view(array.dtype.newbyteorder(self.byte_order))

    def string(self, offset: int) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
        length = self.get(offset, np.uint64)
        return length, self.get(offset + 8, np.uint8, int(length[0]))

    def value_parts(
        self, offset: int, raw_type: int
    ) -> tuple[int, list[npt.NDArray[Any]], list[int], list[GGUFValueType]]:
        """(bytes, parts, data indices, types) of one value, as gguf-py lays them out."""
        value_type = GGUFValueType(raw_type)
        if value_type == GGUFValueType.STRING:
            text = list(self.string(offset))
            return sum(int(p.nbytes) for p in text), text, [1], [value_type]
        scalar = _SCALARS.get(value_type)
        if scalar is not None:
            value = self.get(offset, scalar)
            return int(value.nbytes), [value], [0], [value_type]
        if value_type != GGUFValueType.ARRAY:
            raise ValueError(f"Unknown/unhandled field type {value_type}")
        item_type = self.get(offset, np.uint32)
        length = self.get(offset + 4, np.uint64)
        at = offset + 12
        parts: list[npt.NDArray[Any]] = [item_type, length]
        n = int(length[0])
        if n and int(item_type[0]) in _FLAT_ITEMS:
            # A vocabulary's 10^5 items: the same parts as the walk below, cut faster.
            item = GGUFValueType(int(item_type[0]))
            size, items, item_indices = self._flat_items(at, item, n)
            return 12 + size, parts + items, [i + 2 for i in item_indices], [value_type, item]
        indices: list[int] = []
        types: list[GGUFValueType] = [value_type]
        for i in range(n):
            size, item_parts, item_indices, item_types = self.value_parts(at, int(item_type[0]))
            if i == 0:
                types += item_types
            indices += (j + len(parts) for j in item_indices)
            parts += item_parts
            at += size
        return at - offset, parts, indices, types

    def _flat_items(
        self, offset: int, item: GGUFValueType, n: int
    ) -> tuple[int, list[npt.NDArray[Any]], list[int]]:
        """(bytes, parts, data indices) of ``n`` strings or scalars of one type: one
        1-element view per scalar, a length and a bytes view per string, as gguf-py's."""
        scalar = _SCALARS.get(item)
        if scalar is not None:
            values = self.get(offset, scalar, n)
            return int(values.nbytes), [values[i : i + 1] for i in range(n)], list(range(n))
        raw, length, unpack = self.raw, self._length, self._unpack_length.unpack_from
        buffer = raw.data
        parts: list[npt.NDArray[Any]] = []
        at = offset
        for _ in range(n):
            (size,) = unpack(buffer, at)
            parts += (raw[at : at + 8].view(length), raw[at + 8 : at + 8 + size])
            at += 8 + size
        return at - offset, parts, list(range(1, 2 * n, 2))

    def kv_field(self, offset: int) -> ReaderField:
        key_length, key = self.string(offset)
        at = offset + 8 + int(key_length[0])
        raw_type = self.get(at, np.uint32)
        parts: list[npt.NDArray[Any]] = [key_length, key, raw_type]
        _, value_parts, indices, types = self.value_parts(at + 4, int(raw_type[0]))
        return ReaderField(
            offset,
            str(bytes(key), encoding="utf-8"),
            parts + value_parts,
            [i + 3 for i in indices],
            types,
        )

    def tensor_field(self, offset: int) -> ReaderField:
        name_length, name = self.string(offset)
        at = offset + 8 + int(name_length[0])
        n_dims = self.get(at, np.uint32)
        dims = self.get(at + 4, np.uint64, int(n_dims[0]))
        at += 4 + int(dims.nbytes)
        raw_type = self.get(at, np.uint32)
        data_offset = self.get(at + 4, np.uint64)
        parts = [name_length, name, n_dims, dims, raw_type, data_offset]
        return ReaderField(offset, str(bytes(name), encoding="utf-8"), parts, [1, 3, 4, 5])


class _Fields(Mapping[str, ReaderField]):
    """Key → ``ReaderField`` in file order (gguf-py's ``GGUF.*`` three first); each field
    is cut from the header on first access and kept."""

    def __init__(self, header: _Header, parsed: ParsedFile) -> None:
        self._header = header
        self._offsets = {"GGUF.version": 4, "GGUF.tensor_count": 8, "GGUF.kv_count": 16}
        self._offsets.update((key, entry.offset) for key, entry in parsed.metadata.items())
        self._made: dict[str, ReaderField] = {}

    def __getitem__(self, key: str) -> ReaderField:
        field = self._made.get(key)
        if field is None:
            field = self._make(key, self._offsets[key])
            self._made[key] = field
        return field

    def _make(self, key: str, offset: int) -> ReaderField:
        header = self._header
        if key == "GGUF.version":
            return ReaderField(4, key, [header.get(4, np.uint32)], [0], [GGUFValueType.UINT32])
        if key.startswith("GGUF.") and offset in (8, 16):
            return ReaderField(
                offset, key, [header.get(offset, np.uint64)], [0], [GGUFValueType.UINT64]
            )
        return header.kv_field(offset)

    def __iter__(self) -> Iterator[str]:
        return iter(self._offsets)

    def __len__(self) -> int:
        return len(self._offsets)

    def __contains__(self, key: object) -> bool:
        return key in self._offsets


class GGUFReader:
    """gguf-py's ``GGUFReader(path, mode)``, its tensors loaded by aiogguf.

    ``mode``: ``"r"`` (gguf-py's default) loads with aiogguf's ``mode="mmap"``: the
    tensors are the file's read-only pages, populated by the load; ``"c"`` (gguf-py's
    copy-on-write) loads into memory of the process's own (``mode="none"``): writable,
    nothing goes back to the file. ``"r+"`` (writing into the file) is refused.
    ``load_options`` go to ``aiogguf.load_sync`` (``check_tensors=False``,
    ``readers=4``, a ``config``, …); the tensors stay on the host.

    A split shard is read as gguf-py reads it: its own metadata and tensors (aiogguf
    loads a split model whole, so every shard of it is loaded). Raises what
    ``aiogguf.load_sync`` raises, a malformed file as ``CompatFormatError`` (also a
    ``ValueError``) and an ``OSError`` as ``CompatOSError`` (also an ``OSError``:
    ``CompatFileNotFoundError`` for a missing file), ``TensorValidationError`` for bad
    tensors.
    """

    # gguf-py's class attributes: its scripts read them (gguf_dump.py tells a scalar
    # field from the others with ``gguf_scalar_to_np``).
    gguf_scalar_to_np: ClassVar[dict[GGUFValueType, type[np.generic]]] = dict(_SCALARS)
    byte_order: Literal["I", "S"] = "I"
    alignment: int = GGUF_DEFAULT_ALIGNMENT

    def __init__(
        self,
        path: os.PathLike[str] | str,
        mode: Literal["r", "r+", "c"] = "r",
        **load_options: Any,
    ) -> None:
        if mode not in ("r", "c"):
            raise ValueError(f"mode {mode!r}: aiogguf's reader loads a copy; use 'r' or 'c'")
        self.path: str = os.fspath(path)
        try:
            self._read(mode, load_options)
        except GGUFFormatError as exc:
            _reraise_format(exc)
        except LoadError as exc:
            _reraise_os(exc)

    def _read(self, mode: Literal["r", "c"], load_options: dict[str, Any]) -> None:
        options: dict[str, Any] = {"mode": "mmap" if mode == "r" else "none", "n_gpu_layers": 0}
        options.update(load_options)
        # This file's own header (a shard's, for a split model): what gguf-py reads.
        parsed: ParsedFile = run(functools.partial(parse_file, self.path), name="compat.GGUFReader")
        swapped = needs_swap(parsed.byte_order)
        self.byte_order = "S" if swapped else "I"
        self.alignment = parsed.alignment
        self.data_offset: int = parsed.data_offset
        self.endianess: GGUFEndian = _endianness(swapped)
        with os_errors(self.path, 0, "cannot read the header"), open(self.path, "rb") as f:
            raw = np.frombuffer(f.read(parsed.data_offset), dtype=np.uint8)
        header = _Header(raw, self.byte_order)
        self.fields: Mapping[str, ReaderField] = _Fields(header, parsed)
        with load_sync(_model_path(parsed), devices=[CpuDevice()], **options) as model:
            # The arrays keep their memory (and the file's mappings) alive past the close.
            self.tensors: list[ReaderTensor] = [
                _tensor(
                    header, info.info_offset, parsed.data_offset, model.raw(info.name), mode == "c"
                )
                for info in parsed.tensors
            ]

    def get_field(self, key: str) -> ReaderField | None:
        """The field ``key``, or ``None`` (as gguf-py's)."""
        return self.fields.get(key)

    def get_tensor(self, idx: int) -> ReaderTensor:
        """The tensor at ``idx`` in file order (as gguf-py's)."""
        return self.tensors[idx]


def _reraise_format(exc: GGUFFormatError) -> NoReturn:
    """``exc`` again, as a ``CompatFormatError`` (its traceback and cause kept)."""
    if isinstance(exc, CompatFormatError):
        raise exc
    error = CompatFormatError(exc.path, exc.offset, exc.field, exc.problem)
    raise error.with_traceback(exc.__traceback__) from exc.__cause__


def _reraise_os(exc: LoadError) -> NoReturn:
    """``exc`` again, as the ``CompatOSError`` of its ``OSError`` (the ``__cause__``) if
    it has one, or of a directory (refused before any ``OSError``); otherwise as is."""
    cause = exc.__cause__
    os_errno = strerror = None
    if isinstance(cause, OSError):
        os_errno, strerror = cause.errno, cause.strerror
    elif exc.path is not None and os.path.isdir(exc.path):
        os_errno, strerror = errno.EISDIR, os.strerror(errno.EISDIR)
    if os_errno is None or isinstance(exc, CompatOSError):
        raise exc
    kind = _OS_ERRORS.get(os_errno, CompatOSError)
    error = kind(exc.path, exc.offset, exc.problem, os_errno, strerror)
    raise error.with_traceback(exc.__traceback__) from cause


def _model_path(parsed: ParsedFile) -> str:
    """What to load for ``parsed``'s tensors: the file, or the first split of its set."""
    if not is_split(parsed):
        return parsed.path
    count, split_no = parsed.split_int("split.count"), parsed.split_int("split.no")
    assert count is not None
    return split_paths(parsed.path, split_no or 0, count)[0]


def _endianness(swapped: bool) -> GGUFEndian:
    """gguf-py's ``endianess``: the file's byte order."""
    host = GGUFEndian.LITTLE if sys.byteorder == "little" else GGUFEndian.BIG
    other = GGUFEndian.BIG if host is GGUFEndian.LITTLE else GGUFEndian.LITTLE
    return other if swapped else host


def _tensor(
    header: _Header, info_offset: int, data_start: int, raw: memoryview, writeable: bool
) -> ReaderTensor:
    field = header.tensor_field(info_offset)
    _, _, _, dims, raw_type, offset = field.parts
    ggml_type = GGMLQuantizationType(int(raw_type[0]))
    n_elements = int(np.prod(dims))
    shape: tuple[int, ...] = tuple(reversed(dims.tolist()))
    block_elems, block_bytes = GGML_QUANT_SIZES[ggml_type]
    dtype = _ELEMENTS.get(ggml_type)
    if dtype is None:
        dtype = np.uint8
        shape = (*shape[:-1], shape[-1] // block_elems * block_bytes)
    data = np.frombuffer(raw, dtype=np.uint8)
    if header.byte_order == "S" and block_elems == 1 and block_bytes > 1:
        # The load turned the elements of a file of the other byte order into this
        # host's (it takes no other types from such a file); gguf-py hands over the
        # file's own bytes, its dtype marked swapped, and its scripts rely on that
        # (gguf_new_metadata.py writes them out as they are).
        data = data.view(np.dtype(f"u{block_bytes}")).byteswap().view(np.uint8)
    data = header.as_read(data.view(dtype)).reshape(shape)
    # Mode "r" is read-only, as gguf-py's: so is a copy made above.
    data.flags.writeable = writeable and data.flags.writeable
    return ReaderTensor(
        name=field.name,
        tensor_type=ggml_type,
        shape=dims,
        n_elements=n_elements,
        n_bytes=n_elements * block_bytes // block_elems,
        data_offset=data_start + int(offset[0]),
        data=data,
        field=field,
    )
