"""``GGUFReader``: a drop-in for gguf-py's reader whose tensor data aiogguf loads.

Code written against ``gguf.GGUFReader`` (vLLM's GGUF plugin, transformers, SGLang) runs
unchanged: ``fields`` (gguf-py's ``ReaderField``s, the same ``parts``, ``data``,
``types`` and ``contents()``), ``tensors`` (gguf-py's ``ReaderTensor``s in file order,
``data`` in gguf-py's shapes and dtypes, so that ``gguf.quants.dequantize(t.data,
t.tensor_type)`` works), ``get_field``, ``get_tensor``. The difference is where the
bytes come from: the constructor loads every tensor with ``aiogguf.load_sync`` (parallel
reads, every tensor checked), where gguf-py maps the file and leaves each page to fault
in when it is first touched. Needs the ``gguf`` extra (gguf-py's enums and tables).

Fields are made when first asked for: a vocabulary of 10^5 strings is 2·10^5 numpy
arrays in gguf-py's layout, which a reader that only wants the tensors never pays.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from aiogguf.api import load_sync, run
from aiogguf.io.byteswap import needs_swap
from aiogguf.io.devices.cpu import CpuDevice
from aiogguf.records import ParsedFile
from aiogguf.stages.parse import is_split, parse_file, split_paths

try:
    from gguf.constants import (
        GGML_QUANT_SIZES,
        GGMLQuantizationType,
        GGUFEndian,
        GGUFValueType,
    )
    from gguf.gguf_reader import ReaderField, ReaderTensor
except ImportError as exc:  # pragma: no cover - the extra is part of every test install
    raise ImportError(
        "aiogguf.compat needs gguf-py: pip install 'aiogguf[gguf]' (or pip install gguf)"
    ) from exc

__all__ = ["GGUFReader", "ReaderField", "ReaderTensor"]

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

    def get(self, offset: int, dtype: type[np.generic], count: int = 1) -> npt.NDArray[Any]:
        count = int(count)
        end = offset + np.dtype(dtype).itemsize * count
        array = self.raw[offset:end].view(dtype)[:count]
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
        indices: list[int] = []
        types: list[GGUFValueType] = [value_type]
        for i in range(int(length[0])):
            size, item_parts, item_indices, item_types = self.value_parts(at, int(item_type[0]))
            if i == 0:
                types += item_types
            indices += (j + len(parts) for j in item_indices)
            parts += item_parts
            at += size
        return at - offset, parts, indices, types

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
    ``aiogguf.load_sync`` raises (``GGUFFormatError`` for a malformed file,
    ``TensorValidationError`` for bad tensors).
    """

    def __init__(
        self,
        path: os.PathLike[str] | str,
        mode: Literal["r", "r+", "c"] = "r",
        **load_options: Any,
    ) -> None:
        if mode not in ("r", "c"):
            raise ValueError(f"mode {mode!r}: aiogguf's reader loads a copy; use 'r' or 'c'")
        self.path = os.fspath(path)
        options: dict[str, Any] = {"mode": "mmap" if mode == "r" else "none", "n_gpu_layers": 0}
        options.update(load_options)
        # This file's own header (a shard's, for a split model): what gguf-py reads.
        parsed: ParsedFile = run(functools.partial(parse_file, self.path), name="compat.GGUFReader")
        swapped = needs_swap(parsed.byte_order)
        self.byte_order: Literal["I", "S"] = "S" if swapped else "I"
        self.alignment: int = parsed.alignment
        self.data_offset: int = parsed.data_offset
        self.endianess = _endianness(swapped)
        with open(self.path, "rb") as f:
            raw = np.frombuffer(f.read(parsed.data_offset), dtype=np.uint8)
        header = _Header(raw, self.byte_order)
        self.fields: Mapping[str, ReaderField] = _Fields(header, parsed)
        with load_sync(_model_path(parsed), devices=[CpuDevice()], **options) as model:
            # The arrays keep their memory (and the file's mappings) alive past the close.
            self.tensors: list[ReaderTensor] = [
                _tensor(header, info.info_offset, parsed.data_offset, model.raw(info.name))
                for info in parsed.tensors
            ]

    def get_field(self, key: str) -> ReaderField | None:
        return self.fields.get(key)

    def get_tensor(self, idx: int) -> ReaderTensor:
        return self.tensors[idx]


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


def _tensor(header: _Header, info_offset: int, data_start: int, raw: memoryview) -> ReaderTensor:
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
    data = np.frombuffer(raw, dtype=np.uint8).view(dtype).reshape(shape)
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
