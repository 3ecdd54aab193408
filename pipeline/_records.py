"""Records that flow between the stages: frozen, slotted, and typed.

parse → ``ParsedFile``; index → ``WeightIndex`` of ``TensorEntry``; plan → ``Plan``.
The streaming stages' records (read jobs, chunks) live with the engine.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import Any, TypeAlias, overload

import numpy as np
import numpy.typing as npt

from aiogguf._fastinit import fast_init
from aiogguf.errors import GGUFFormatError, SplitError
from aiogguf.io._devices.base import DeviceKind
from aiogguf.io.byteswap import ByteOrder
from aiogguf.io.ggml_types import GGMLType

__all__ = [
    "BufferPlan",
    "ByteOrder",
    "DeviceSummary",
    "FileRange",
    "GGUFArray",
    "LayerAssignment",
    "LoadMode",
    "MetadataEntry",
    "MetadataValue",
    "ModeTraits",
    "MovedSummary",
    "ParsedFile",
    "Plan",
    "StringItems",
    "TensorClass",
    "TensorEntry",
    "TensorInfo",
    "TensorPlacement",
    "Totals",
    "ValueType",
    "WeightIndex",
]


class LoadMode(StrEnum):
    """How a load brings the file's bytes into memory (design §1.5); ``AUTO`` is resolved
    by the plan (``Plan.mode`` is never ``AUTO``). Members equal their strings
    (``LoadMode.MMAP == "mmap"``), and a config takes either."""

    AUTO = "auto"
    MMAP = "mmap"
    MLOCK = "mlock"
    NONE = "none"
    DIRECT = "direct"


class ValueType(IntEnum):
    """GGUF metadata value types (format §1.5.1)."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12

    @property
    def json_name(self) -> str:
        """Lower-case name used by ``inspect --json`` (``uint32``, ``string``, ``array``)."""
        return self.name.lower()


class StringItems(Sequence[str]):
    """The strings of a long metadata array (a vocabulary, its merges), decoded on first
    use: a load needs none of them, and decoding 10^5 of them one by one costs tens of
    milliseconds. The parse stage has walked every length already, so the items are
    known to be where they are; only their UTF-8 is checked on first use, which raises
    ``GGUFFormatError`` naming the item's offset. Compares equal to the tuple of its
    items."""

    __slots__ = ("_count", "_decoded", "_field", "_path", "_raw", "_start", "_unpack")

    def __init__(
        self, raw: bytes, count: int, *, byte_order: str, path: str, start: int, field: str
    ) -> None:
        """``raw``: the array's items as in the file (8-byte length, then the bytes),
        ``count`` of them, in byte order ``byte_order`` (``"<"`` or ``">"``); ``start``:
        the file offset of ``raw``, ``field`` the array's name (for messages)."""
        self._raw = raw
        self._count = count
        self._unpack = struct.Struct(byte_order + "Q").unpack_from
        self._path = path
        self._start = start
        self._field = field
        self._decoded: tuple[str, ...] | None = None

    def _items(self) -> tuple[str, ...]:
        if self._decoded is None:
            self._decoded = self._decode()
        return self._decoded

    def _decode(self) -> tuple[str, ...]:
        raw, unpack = self._raw, self._unpack
        items: list[str] = []
        append = items.append
        p = 0
        try:
            for _ in range(self._count):
                (length,) = unpack(raw, p)
                end = p + 8 + length
                append(raw[p + 8 : end].decode())
                p = end
        except UnicodeDecodeError as exc:
            raise GGUFFormatError(
                self._path,
                self._start + p + 8 + exc.start,
                f"{self._field}[{len(items)}]",
                f"not valid UTF-8 ({exc.reason})",
            ) from exc
        return tuple(items)

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[str, ...]: ...

    def __getitem__(self, index: int | slice) -> str | tuple[str, ...]:
        return self._items()[index]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StringItems):
            return self._items() == other._items()
        if isinstance(other, tuple):
            return self._items() == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._items())

    def __repr__(self) -> str:
        return f"<StringItems: {self._count} strings, {len(self._raw)} bytes>"


@dataclass(frozen=True, slots=True)
class GGUFArray(Sequence[Any]):
    """A metadata array, a sequence of its items (``len``, ``[i]``, slices, ``for``,
    ``in``). Numeric items are a read-only numpy array in native byte order (an item is a
    numpy scalar, a slice a numpy array); strings are a tuple of ``str`` (long arrays:
    ``StringItems``, decoded on first use); nested arrays a tuple of ``GGUFArray``.
    ``to_python()`` gives plain Python values."""

    item_type: ValueType
    values: npt.NDArray[np.generic] | tuple[str, ...] | StringItems | tuple[GGUFArray, ...]

    def __len__(self) -> int:
        return len(self.values)

    @overload
    def __getitem__(self, index: int) -> Any: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Any]: ...

    def __getitem__(self, index: int | slice) -> Any:
        return self.values[index]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.values)

    def __repr__(self) -> str:
        # Short on purpose: vocabularies hold 10^5 items, and asyncio.run (3.11) reprs the
        # main task's result on its way out, which cost a tenth of a second per parse.
        if isinstance(self.values, StringItems):
            return f"GGUFArray({self.item_type.name}, {len(self)} items, not decoded yet)"
        first = self.values[:3]
        items = first.tolist() if isinstance(first, np.ndarray) else first
        more = ", ..." if len(self) > 3 else ""
        head = ", ".join(map(repr, items))
        return f"GGUFArray({self.item_type.name}, {len(self)} items: [{head}{more}])"

    def to_python(self) -> list[object]:
        """Plain Python values (ints, floats, bools, strs, nested lists)."""
        if isinstance(self.values, np.ndarray):
            return list(self.values.tolist())
        return [v.to_python() if isinstance(v, GGUFArray) else v for v in self.values]


MetadataValue: TypeAlias = int | float | bool | str | GGUFArray


@fast_init
@dataclass(frozen=True, slots=True)
class MetadataEntry:
    """One key/value record and the file offset of its key."""

    key: str
    type: ValueType
    value: MetadataValue
    offset: int


@fast_init
@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor-info record as stored in one file."""

    name: str
    type: GGMLType
    shape: tuple[int, ...]  # ggml order: ne[0] (row length) first
    offset: int  # relative to the file's data section
    nbytes: int
    n_elements: int
    info_offset: int  # where the record starts in the file


@dataclass(frozen=True, slots=True)
class ParsedFile:
    """Everything in one GGUF file's header. The data section is never read."""

    path: str
    version: int
    byte_order: ByteOrder
    alignment: int
    data_offset: int
    file_size: int
    metadata: Mapping[str, MetadataEntry]
    tensors: tuple[TensorInfo, ...]
    warnings: tuple[str, ...] = ()
    # llama.cpp's C reader rejects arrays of arrays; we parse them but say so.
    llama_cpp_loadable: bool = True

    def get(self, key: str) -> MetadataValue | None:
        """The value of a metadata key, or ``None`` where the file has no such key."""
        entry = self.metadata.get(key)
        return entry.value if entry is not None else None

    def split_int(self, key: str) -> int | None:
        """The integer value of a split key (``split.count``, ``split.no``,
        ``split.tensors.count``), or None when the file has none.

        Raises ``SplitError``: the key holds something other than an integer.
        """
        entry = self.metadata.get(key)
        if entry is None:
            return None
        value = entry.value
        if isinstance(value, bool) or not isinstance(value, int):
            raise SplitError(self.path, f"{key} must be an integer, found {entry.type.json_name}")
        return value


class TensorClass(StrEnum):
    """llama.cpp's layer classes (format §3.1)."""

    INPUT = "input"
    OUTPUT = "output"
    REPEATING = "repeating"


@fast_init
@dataclass(frozen=True, slots=True)
class TensorEntry:
    """A tensor of the model: where its bytes are and which layer it belongs to."""

    name: str
    type: GGMLType
    shape: tuple[int, ...]
    file_index: int  # split index (0 for single files)
    offset: int  # absolute byte offset of the data in that file
    nbytes: int
    n_elements: int
    layer: int | None  # N of ``blk.N.``; None for non-layer tensors
    tensor_class: TensorClass

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True, slots=True)
class Totals:
    """Counts over a model's tensors: how many, their bytes, elements and bits per weight."""

    n_tensors: int
    nbytes: int
    n_elements: int
    bpw: float


@dataclass(frozen=True, slots=True)
class WeightIndex:
    """All tensors of a (possibly split) model in layer order, checked against the files."""

    files: tuple[ParsedFile, ...]
    tensors: tuple[TensorEntry, ...]
    totals: Totals
    warnings: tuple[str, ...] = ()
    _by_name: Mapping[str, TensorEntry] = field(default_factory=dict, repr=False)

    @property
    def metadata(self) -> Mapping[str, MetadataEntry]:
        """The model's metadata: the first split's keys (the others carry only split.*)."""
        return self.files[0].metadata

    @property
    def architecture(self) -> str | None:
        arch = self.files[0].get("general.architecture")
        return arch if isinstance(arch, str) else None

    @property
    def n_layer(self) -> int | None:
        """``<arch>.block_count``, or None when the file has none."""
        arch = self.architecture
        value = self.files[0].get(f"{arch}.block_count") if arch else None
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def byte_order(self) -> ByteOrder:
        return self.files[0].byte_order

    @property
    def file_order(self) -> tuple[TensorEntry, ...]:
        """Every tensor in the files' own order (file by file, as their tensor infos list
        them, which is gguf-py's order); ``tensors`` is llama.cpp's load order (by layer,
        format §3.2), which a load, ``Model.tensors`` and ``inspect`` follow."""
        return tuple(self._by_name[info.name] for f in self.files for info in f.tensors)

    def __getitem__(self, name: str) -> TensorEntry:
        return self._by_name[name]

    def __contains__(self, name: object) -> bool:
        return name in self._by_name


# --- plan -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DeviceSummary:
    name: str
    kind: DeviceKind
    free: int
    total: int


@fast_init
@dataclass(frozen=True, slots=True)
class LayerAssignment:
    layer: int  # 0 … n_layer; n_layer is the output layer
    device: str


@fast_init
@dataclass(frozen=True, slots=True)
class TensorPlacement:
    """Where the plan puts one tensor: its device and buffer type, and whether it
    is loaded lazily or was moved from where it was asked for."""

    name: str
    layer: int | None
    tensor_class: TensorClass
    device: str
    buffer_type: str
    nbytes: int
    lazy: bool
    moved: bool


@fast_init
@dataclass(frozen=True, slots=True)
class FileRange:
    """A coalesced run of one file's bytes that lands in one buffer with one read."""

    file_index: int
    start: int  # absolute file offset of the first tensor's data
    end: int  # absolute file offset just past the last tensor's data
    tensors: tuple[str, ...]

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class BufferPlan:
    """One destination buffer: a (device, buffer type, lazy) group and its file ranges."""

    device: str
    buffer_type: str
    lazy: bool
    host: bool  # True when the buffer lives in host memory (CPU, pinned host)
    nbytes: int  # sum of its tensors' nbytes
    tensors: tuple[str, ...]
    ranges: tuple[FileRange, ...]


@dataclass(frozen=True, slots=True)
class MovedSummary:
    """The tensors placement moved off the device asked for: how many, and the first."""

    count: int
    first_name: str
    first_type: str
    first_from: str
    first_to: str


@dataclass(frozen=True, slots=True)
class ModeTraits:
    """What a resolved load mode means to the stages (design §1.5): made once, by the
    plan (``ModeTraits.of``), and read by every stage instead of the mode's name.

    ``mapped``: host images are mappings of the file (``mmap``, ``mlock``): what is
    read lands in the page cache, and a mapped tensor's check reads its file.
    ``locked``: mapped pages are locked as they are read in (``mlock``).
    ``direct``: files are opened with ``O_DIRECT`` and host jobs are aligned (``direct``).
    ``copies``: host tensors are read into memory of the load's own (``none``,
    ``direct``), where each is checked piece by piece as its bytes land.
    """

    name: LoadMode
    mapped: bool
    locked: bool
    direct: bool
    copies: bool

    @staticmethod
    def of(mode: LoadMode | str) -> ModeTraits:
        """The traits of a resolved mode; ``ValueError`` for ``auto`` (the plan resolves
        it) or a name that is no mode."""
        traits = _MODE_TRAITS.get(LoadMode(mode))
        if traits is None:
            raise ValueError(f"mode {mode!r} is resolved by the plan: it has no traits")
        return traits


_MODE_TRAITS: dict[LoadMode, ModeTraits] = {
    LoadMode.NONE: ModeTraits(LoadMode.NONE, mapped=False, locked=False, direct=False, copies=True),
    LoadMode.DIRECT: ModeTraits(
        LoadMode.DIRECT, mapped=False, locked=False, direct=True, copies=True
    ),
    LoadMode.MMAP: ModeTraits(LoadMode.MMAP, mapped=True, locked=False, direct=False, copies=False),
    LoadMode.MLOCK: ModeTraits(
        LoadMode.MLOCK, mapped=True, locked=True, direct=False, copies=False
    ),
}


@dataclass(frozen=True, slots=True)
class Plan:
    """Where every tensor goes, and which file ranges feed which buffer. No I/O was done."""

    devices: tuple[DeviceSummary, ...]
    input_device: str
    layers: tuple[LayerAssignment, ...]
    tensors: tuple[TensorPlacement, ...]
    buffers: tuple[BufferPlan, ...]
    moved: MovedSummary | None
    warnings: tuple[str, ...]
    traits: ModeTraits  # the resolved load mode, and what it means to each stage

    @property
    def mode(self) -> LoadMode:
        """The resolved load mode: never ``AUTO``."""
        return self.traits.name

    def placement(self, name: str) -> TensorPlacement:
        """The placement of the tensor ``name``; ``KeyError`` if the plan has none."""
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)
