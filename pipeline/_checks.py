"""ggml's tensor data checks (format §5.1, §5.2), vectorised: the validate stage's library.

Rules, per type (driven by the ``ScaleField``s of ``aiogguf.io.ggml_types``):

* an invalid (removed) type fails as "invalid type"; Q8_1 fails as "type not supported by
  validator" (ggml has no branch for it and returns false); a size that is not a whole
  number of blocks fails before anything else is looked at;
* F32, F16, BF16, F64: every element must be finite (F64 after narrowing to float32, so
  |x| > FLT_MAX counts as inf, as in ggml);
* quantized types: every *checked* scale field of every block must be finite (fp16 d, m,
  dmin; Q8_K's f32 d; IQ1_M's super-scale rebuilt from four top nibbles; MXFP4's e8m0
  e != 0xFF); payloads, sub-block scales, Q8_1's s and NVFP4's UE4M3 scales never are;
* integer types and NVFP4: the size check only.

Unlike ggml, which stops at the first bad value, we also count the bad blocks (or
elements), so a report says where the damage starts and how far it goes.

The array code is generic over the array module ``xp`` (numpy by default, CuPy for
device-resident tensors): it only uses operations both modules share, and never imports
CuPy itself. It assumes a little-endian host (multi-byte elements are viewed with native
dtypes because CuPy has no byte-swapped dtypes); big-endian files are converted first by
``aiogguf.io.byteswap``.

Three ways in: ``check_tensor`` (one whole tensor), ``TensorChecker`` (one tensor's
bytes in order, chunk by chunk) and ``PieceCheck`` (one tensor's pieces in any order,
from several threads); ``precheck`` is the type and size check alone.
"""

from __future__ import annotations

import functools
import threading
from bisect import bisect_left, bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from types import ModuleType
from typing import Any, TypeAlias

import numpy

from aiogguf.errors import TensorFailure
from aiogguf.io.ggml_types import GGMLType, ScaleField, ScaleKind, TypeKind

__all__ = ["HOST_SLICE_BYTES", "Bytes", "PieceCheck", "TensorChecker", "check_tensor", "precheck"]


# A 1-D uint8 array of ``xp`` (numpy.ndarray or cupy.ndarray). Typed loosely on purpose:
# CuPy has no type stubs, and the code below only uses operations both modules share.
Bytes: TypeAlias = Any
BoolArray: TypeAlias = Any

# Elements of the plain types are scanned in slices this large: small enough that the
# scratch arrays stay in L2 (the full scan is markedly slower from memory), large enough
# that the per-slice Python overhead stays in the noise.
HOST_SLICE_BYTES = 512 * 1024
# On a device each slice costs a kernel launch and a synchronising count: go big.
DEVICE_SLICE_BYTES = 64 * 1024 * 1024

# The smallest magnitude a float64 can have and still round to inf as float32:
# halfway between FLT_MAX (odd mantissa) and 2**128 rounds up (ties to even).
_F64_TO_F32_INF = 2.0**128 - 2.0**103


def _host_bytes(array: Bytes) -> bytes:
    """The bytes of a (small) array, copied to the host when it lives on a device."""
    if hasattr(array, "get"):  # CuPy: numpy arrays have no .get()
        array = array.get()
    return bytes(array.tobytes())


# ---------------------------------------------------------------------------------------
# Scale checkers, keyed by ScaleKind.
#
# ``bad(blocks, offset)`` maps a (nblocks, block_bytes) uint8 view to a bool mask of the
# blocks whose field at ``offset`` is not finite. It reads single byte columns only: the
# exponent of an fp16 sits in its high byte, so no unaligned u16 view is ever needed.
# ``describe(block, offset)`` names what was found in one block's bytes (host side, only
# for the first bad block).


def _fp16_bits(block: bytes, offset: int) -> int:
    return int.from_bytes(block[offset : offset + 2], "little")


def _iq1m_bits(block: bytes, offset: int) -> int:
    # The top nibbles of the u16 words at offset, +2, +4, +6 (i.e. of bytes +1, +3, +5,
    # +7) are the fp16's bits 0-3, 4-7, 8-11, 12-15 (format §4.2).
    return sum((block[offset + 2 * k + 1] >> 4) << (4 * k) for k in range(4))


def _fp16_class(bits: int) -> str:
    return "nan value" if bits & 0x03FF else "inf value"


def _f32_class(bits: int) -> str:
    return "nan value" if bits & 0x007FFFFF else "inf value"


def _fp16_bad(blocks: Bytes, offset: int) -> BoolArray:
    # fp16 exponent (mask 0x7C00) all ones <=> high byte & 0x7C == 0x7C.
    return (blocks[:, offset + 1] & 0x7C) == 0x7C


def _f32_bad(blocks: Bytes, offset: int) -> BoolArray:
    # f32 exponent (mask 0x7F800000): bits 0-6 of byte 3 and bit 7 of byte 2.
    return ((blocks[:, offset + 3] & 0x7F) == 0x7F) & ((blocks[:, offset + 2] & 0x80) != 0)


def _iq1m_bad(blocks: Bytes, offset: int) -> BoolArray:
    # Exponent bits 10-11 are bits 6-7 of byte +5; bits 12-14 are bits 4-6 of byte +7.
    return ((blocks[:, offset + 5] & 0xC0) == 0xC0) & ((blocks[:, offset + 7] & 0x70) == 0x70)


def _e8m0_bad(blocks: Bytes, offset: int) -> BoolArray:
    return blocks[:, offset] == 0xFF


@dataclass(frozen=True, slots=True)
class _Screen:
    """A one-pass test that clears a whole column of unsigned integers: no value reaches
    ``unsigned_min``, and none reaches ``signed_min`` when read as signed (None: skip).

    Two ``max`` reductions read the data and write nothing, which makes them several
    times faster than the mask-and-compare of the full scan (numpy's elementwise bitwise
    ops run at a fraction of its reductions' speed). A column the screen does not clear
    goes to the full scan, which alone decides; a screen may flag good data, never pass
    bad data. Host only: on a device each reduction would be a synchronising launch.
    """

    unsigned_min: int
    signed_min: int | None

    def clear(self, column: Bytes) -> bool:
        top = int(column.max())
        if top >= self.unsigned_min:
            return False
        if self.signed_min is None or top < self.signed_min:
            return True  # no value reaches signed_min, read either way
        signed = column.view(_SIGNED[column.dtype.itemsize])
        return int(signed.max()) < self.signed_min


_SIGNED = {1: numpy.int8, 2: numpy.int16, 4: numpy.int32}


@dataclass(frozen=True, slots=True)
class _ScaleCheck:
    bad: Callable[[Bytes, int], BoolArray]
    describe: Callable[[bytes, int], str]
    # Which byte of the field the screen reads (relative to its offset), and the screen.
    screen_byte: int
    screen: _Screen


_SCALE_CHECKS: dict[ScaleKind, _ScaleCheck] = {
    # The high byte's exponent bits 0x7C all set <=> the byte is in 0x7C-0x7F or 0xFC-0xFF.
    ScaleKind.FP16: _ScaleCheck(
        _fp16_bad, lambda b, o: _fp16_class(_fp16_bits(b, o)), 1, _Screen(0xFC, 0x7C)
    ),
    # Flags 0x7F/0xFF top bytes; the full scan then looks at byte +2 too.
    ScaleKind.F32: _ScaleCheck(
        _f32_bad,
        lambda b, o: _f32_class(int.from_bytes(b[o : o + 4], "little")),
        3,
        _Screen(0xFF, 0x7F),
    ),
    # Flags byte +5 >= 0xC0; the full scan then looks at byte +7 too.
    ScaleKind.IQ1M: _ScaleCheck(
        _iq1m_bad, lambda b, o: _fp16_class(_iq1m_bits(b, o)), 5, _Screen(0xC0, None)
    ),
    ScaleKind.E8M0: _ScaleCheck(
        _e8m0_bad, lambda b, o: f"invalid e8m0 value {b[o]}", 0, _Screen(0xFF, None)
    ),
    # UE4M3 has no entry: ggml considers every UE4M3 value valid.
}


# ---------------------------------------------------------------------------------------
# Per-slice results and the running tally of one tensor.


@dataclass(frozen=True, slots=True)
class _Found:
    """What one slice scan found: bad units, the first one (slice-relative), its class."""

    count: int
    first: int
    what: str
    nans: int = 0


_NOTHING = _Found(0, 0, "")


@dataclass(slots=True)
class _Tally:
    """Bad units of one tensor so far; scans may be added in any order."""

    count: int = 0
    nans: int = 0
    first_index: int | None = None
    first_what: str = ""

    def add(self, found: _Found, base: int) -> None:
        """Add ``found``, a scan of the units starting at unit ``base``."""
        if not found.count:
            return
        self.count += found.count
        self.nans += found.nans
        first = base + found.first
        if self.first_index is None or first < self.first_index:
            self.first_index = first
            self.first_what = found.what

    def merge(self, other: _Tally) -> None:
        """Add another tally of other units of the same tensor."""
        if other.first_index is not None:
            self.add(_Found(other.count, other.first_index, other.first_what, other.nans), 0)


class _Scratch:
    """Reusable scratch arrays, so scanning a slice allocates nothing. One per thread."""

    def __init__(self, xp: ModuleType) -> None:
        self._xp = xp
        self._arrays: dict[str, Bytes] = {}

    def get(self, dtype: str, n: int) -> Bytes:
        array = self._arrays.get(dtype)
        if array is None or array.shape[0] < n:
            array = self._xp.empty(n, dtype=dtype)
            self._arrays[dtype] = array
        return array[:n]


# Exponent all ones, sign either way: the bit patterns from each ``signed_min`` up to the
# signed maximum, and from each ``unsigned_min`` up to the unsigned one.
_F16_SCREEN = _Screen(0xFC00, 0x7C00)
_BF16_SCREEN = _Screen(0xFF80, 0x7F80)
_F32_SCREEN = _Screen(0xFF800000, 0x7F800000)


# ---------------------------------------------------------------------------------------
# Element checkers for the plain float types, keyed by type name. ``scan`` takes a uint8
# slice holding whole elements; ``problem`` words the final report from the tally.


class _ElementCheck:
    def scan(self, data: Bytes, xp: ModuleType, scratch: _Scratch) -> _Found:
        raise NotImplementedError

    def clear(self, data: numpy.ndarray[Any, Any]) -> bool:
        """Host fast path: True only if every element of ``data`` is good."""
        return False

    def problem(self, tally: _Tally, n_elements: int, type_name: str) -> str:
        return f"found {tally.first_what}"


class _F16Elements(_ElementCheck):
    def scan(self, data: Bytes, xp: ModuleType, scratch: _Scratch) -> _Found:
        bits = data.view(xp.uint16)
        n = bits.shape[0]
        exponent = xp.bitwise_and(bits, 0x7C00, out=scratch.get("uint16", n))
        bad = xp.equal(exponent, 0x7C00, out=scratch.get("bool", n))
        count = int(xp.count_nonzero(bad))
        if not count:
            return _NOTHING
        first = int(xp.argmax(bad))
        return _Found(count, first, _fp16_class(int(bits[first])))

    def clear(self, data: numpy.ndarray[Any, Any]) -> bool:
        # Exponent all ones <=> bits in 0x7C00-0x7FFF or 0xFC00-0xFFFF.
        return _F16_SCREEN.clear(data.view(numpy.uint16))


class _F32Elements(_ElementCheck):
    def scan(self, data: Bytes, xp: ModuleType, scratch: _Scratch) -> _Found:
        values = data.view(xp.float32)
        n = values.shape[0]
        finite = xp.isfinite(values, out=scratch.get("bool", n))
        count = n - int(xp.count_nonzero(finite))
        if not count:
            return _NOTHING
        first = int(xp.argmin(finite))
        return _Found(count, first, _f32_class(int(data.view(xp.uint32)[first])))

    def clear(self, data: numpy.ndarray[Any, Any]) -> bool:
        return _F32_SCREEN.clear(data.view(numpy.uint32))


class _F64Elements(_ElementCheck):
    def scan(self, data: Bytes, xp: ModuleType, scratch: _Scratch) -> _Found:
        # ggml narrows to float first; comparing magnitudes against the rounding threshold
        # gives the same verdict without a cast (and without numpy's overflow warning).
        # NaN compares false, so it lands on the bad side too.
        values = data.view(xp.float64)
        n = values.shape[0]
        magnitude = xp.abs(values, out=scratch.get("float64", n))
        ok = xp.less(magnitude, _F64_TO_F32_INF, out=scratch.get("bool", n))
        count = n - int(xp.count_nonzero(ok))
        if not count:
            return _NOTHING
        first = int(xp.argmin(ok))
        what = "nan value" if bool(xp.isnan(values[first])) else "inf value"
        return _Found(count, first, what)

    def clear(self, data: numpy.ndarray[Any, Any]) -> bool:
        # A NaN makes max() NaN and both comparisons false.
        values = data.view(numpy.float64)
        return bool(values.max() < _F64_TO_F32_INF) and bool(values.min() > -_F64_TO_F32_INF)


class _BF16Elements(_ElementCheck):
    def scan(self, data: Bytes, xp: ModuleType, scratch: _Scratch) -> _Found:
        bits = data.view(xp.uint16)
        n = bits.shape[0]
        magnitude = xp.bitwise_and(bits, 0x7FFF, out=scratch.get("uint16", n))
        bad = xp.greater_equal(magnitude, 0x7F80, out=scratch.get("bool", n))
        count = int(xp.count_nonzero(bad))
        if not count:
            return _NOTHING
        first = int(xp.argmax(bad))
        # Split NaN from Inf only on the failure path: the report prefers NaNs.
        nans = int(xp.count_nonzero(xp.greater(magnitude, 0x7F80, out=bad)))
        what = "nan value" if int(magnitude[first]) > 0x7F80 else "inf value"
        return _Found(count, first, what, nans=nans)

    def clear(self, data: numpy.ndarray[Any, Any]) -> bool:
        return _BF16_SCREEN.clear(data.view(numpy.uint16))

    def problem(self, tally: _Tally, n_elements: int, type_name: str) -> str:
        infs = tally.count - tally.nans
        if tally.nans:
            extra = f" and {infs} infinities" if infs else ""
            return f"found {tally.nans} NaNs{extra} in row of {n_elements} BF16 values"
        return f"found {infs} infinities in row of {n_elements} BF16 values"


_ELEMENT_CHECKS: dict[str, _ElementCheck] = {
    "F32": _F32Elements(),
    "F16": _F16Elements(),
    "BF16": _BF16Elements(),
    "F64": _F64Elements(),
}


# ---------------------------------------------------------------------------------------
# Whole-tensor checks that need no data.


def _failure(name: str, type: GGMLType, problem: str) -> TensorFailure:
    return TensorFailure(name, type.name, problem, None, 0)


def _type_failure(name: str, type: GGMLType) -> TensorFailure | None:
    if not type.valid:
        return _failure(name, type, f"invalid type {type.id}")
    if not type.validator_supported:
        return _failure(name, type, "type not supported by validator")
    return None


def _size_failure(name: str, type: GGMLType, nbytes: int) -> TensorFailure | None:
    if nbytes % type.block_bytes:
        problem = f"invalid size {nbytes} for type {type.name} (type size = {type.block_bytes})"
        return _failure(name, type, problem)
    return None


def precheck(name: str, type: GGMLType, nbytes: int) -> TensorFailure | None:
    """The checks that need no data: type validity and support, size divisibility.

    Returns the failure, or None when the data has to be scanned (or, for integer types
    and NVFP4, when nothing more is checked).
    """
    return _type_failure(name, type) or _size_failure(name, type, nbytes)


# ---------------------------------------------------------------------------------------
# The scanning core both checkers share.


class _Scan(Enum):
    NONE = "none"  # nothing to look at (integer types, NVFP4, failed types)
    ELEMENTS = "elements"
    SCALES = "scales"


class _Scanner:
    """How to scan one type's units; holds no per-tensor state, so threads may share it.

    A unit is a block for quantized types, an element for plain ones.
    """

    def __init__(self, type: GGMLType, xp: ModuleType, slice_bytes: int) -> None:
        self.type = type
        self.xp = xp
        self.unit_bytes = max(type.block_bytes, 1)
        self.element_check = _ELEMENT_CHECKS.get(type.name)
        self.fields: tuple[tuple[ScaleField, _ScaleCheck], ...] = tuple(
            (field, _SCALE_CHECKS[field.kind])
            for field in type.scales
            if field.checked and field.kind in _SCALE_CHECKS
        )
        if _type_failure("", type) is not None:
            self.mode = _Scan.NONE
        elif type.kind is TypeKind.FLOAT and self.element_check is not None:
            self.mode = _Scan.ELEMENTS
        elif type.kind is TypeKind.QUANT and self.fields:
            self.mode = _Scan.SCALES
        else:
            self.mode = _Scan.NONE
        self.slice_bytes = max(slice_bytes // self.unit_bytes, 1) * self.unit_bytes
        self.host = xp is numpy
        # The host screens, each with the block column it reads (a field's screen byte).
        self.screens = tuple(
            (check.screen, field.offset + check.screen_byte) for field, check in self.fields
        )

    def scan(self, data: Bytes, scratch: _Scratch) -> _Found:
        """Scan ``data``, a whole number of units, slice by slice; indices relative to it.

        On the host, screened whole first: a screen is a few reductions over all of
        ``data`` whatever its size, where slices cost a few calls each, and every numpy
        call costs the GIL (design §1.7). Only data the screen does not clear is scanned
        slice by slice (the full scan writes scratch arrays, kept in the cache)."""
        if self.host and self._clear(data):
            return _NOTHING
        count = nans = 0
        first, what = 0, ""
        nbytes = int(data.shape[0])
        for start in range(0, nbytes, self.slice_bytes):
            found = self._scan_slice(data[start : start + self.slice_bytes], scratch)
            if found.count:
                if not count:  # slices go in order: the first hit is the minimum
                    first, what = start // self.unit_bytes + found.first, found.what
                count += found.count
                nans += found.nans
        return _Found(count, first, what, nans) if count else _NOTHING

    def _scan_slice(self, data: Bytes, scratch: _Scratch) -> _Found:
        if self.host and self._clear(data):
            return _NOTHING
        if self.mode is _Scan.ELEMENTS:
            assert self.element_check is not None
            return self.element_check.scan(data, self.xp, scratch)
        return self._scan_scales(data)

    def _clear(self, data: numpy.ndarray[Any, Any]) -> bool:
        """Host fast path: True only if every unit of ``data`` is good."""
        if self.mode is _Scan.ELEMENTS:
            assert self.element_check is not None
            return self.element_check.clear(data)
        return self._scales_clear(data)

    def _scales_clear(self, data: numpy.ndarray[Any, Any]) -> bool:
        """Host fast path: True only if every checked scale of every block is good."""
        blocks = data.reshape(-1, self.type.block_bytes)
        # The reductions stride through the blocks, one column each: each numpy call
        # costs the GIL twice (a release and a take, which can wait a switch interval
        # behind a busy thread), whatever its size, so no copy into a contiguous column
        # first (a 1-D strided reduction costs about what the copy does; a 2-D one over
        # two columns at once costs several times that).
        return all(screen.clear(blocks[:, column]) for screen, column in self.screens)

    def _scan_scales(self, data: Bytes) -> _Found:
        xp = self.xp
        blocks = data.reshape(-1, self.type.block_bytes)
        bad: BoolArray | None = None
        for field, check in self.fields:
            field_bad = check.bad(blocks, field.offset)
            bad = field_bad if bad is None else xp.logical_or(bad, field_bad, out=bad)
        count = int(xp.count_nonzero(bad))
        if not count:
            return _NOTHING
        first = int(xp.argmax(bad))
        block = _host_bytes(blocks[first])
        # Which field to name: the first bad one in table order (ggml tests d before m).
        for field, check in self.fields:
            if bool(check.bad(numpy.frombuffer(block, numpy.uint8)[None, :], field.offset)[0]):
                what = f"{check.describe(block, field.offset)} in scale '{field.name}'"
                return _Found(count, first, what)
        raise AssertionError("a bad block with no bad field")  # pragma: no cover

    def failure(self, name: str, nbytes: int, tally: _Tally) -> TensorFailure | None:
        """The verdict on a tensor of ``nbytes`` whose every unit went into ``tally``."""
        failure = precheck(name, self.type, nbytes)
        if failure is not None or not tally.count:
            return failure
        if self.mode is _Scan.ELEMENTS:
            assert self.element_check is not None
            n_units = nbytes // self.unit_bytes
            problem = self.element_check.problem(tally, n_units, self.type.name)
        else:
            problem = f"found {tally.first_what}"
        return TensorFailure(name, self.type.name, problem, tally.first_index, tally.count)


@functools.cache
def _scanner(type: GGMLType, xp: ModuleType, slice_bytes: int) -> _Scanner:
    """The scanner of a type: made once per process (a load makes a check per tensor)."""
    return _Scanner(type, xp, slice_bytes)


# ---------------------------------------------------------------------------------------
# The in-order checker.


class TensorChecker:
    """Checks one tensor's bytes chunk by chunk, as they land.

    Chunks may split the tensor anywhere: a block cut at a chunk boundary is carried
    (fewer than ``block_bytes`` bytes) and checked when the next chunk completes it.
    Indices in the report are global over the whole tensor. Not thread-safe: feed one
    tensor's chunks in order from one thread at a time.
    """

    def __init__(
        self,
        name: str,
        type: GGMLType,
        *,
        xp: ModuleType = numpy,
        slice_bytes: int | None = None,
    ) -> None:
        """Prepare to check tensor ``name`` of ``type``.

        ``name``: the tensor's name, for the report.
        ``type``: its ggml type row.
        ``xp``: the array module of the chunks (numpy, or cupy for device arrays).
        ``slice_bytes``: scan granularity; bounds scratch memory. Defaults to
            ``HOST_SLICE_BYTES`` for numpy, ``DEVICE_SLICE_BYTES`` otherwise.
        """
        self.name = name
        self.type = type
        self._xp = xp
        self._nbytes = 0
        self._done_units = 0  # blocks (or elements) scanned so far
        self._carry: Bytes | None = None
        self._tally = _Tally()
        self._finished = False
        self._scratch = _Scratch(xp)
        if slice_bytes is None:
            slice_bytes = HOST_SLICE_BYTES if xp is numpy else DEVICE_SLICE_BYTES
        self._scanner = _scanner(type, xp, slice_bytes)

    @property
    def nbytes(self) -> int:
        """Bytes fed so far."""
        return self._nbytes

    def update(self, chunk: Bytes) -> None:
        """Check the next ``chunk`` (a 1-D uint8 array of ``xp``) of the tensor's bytes.

        Raises ``RuntimeError`` after ``finish()``.
        Raises ``ValueError`` if the chunk is not a 1-D uint8 array.
        """
        if self._finished:
            raise RuntimeError(f"tensor '{self.name}': update() after finish()")
        if chunk.ndim != 1 or chunk.dtype != self._xp.uint8:
            raise ValueError(
                f"tensor '{self.name}': expected a 1-D uint8 array, "
                f"got {chunk.ndim}-D {chunk.dtype}"
            )
        n = int(chunk.shape[0])
        self._nbytes += n
        if self._scanner.mode is _Scan.NONE or n == 0:
            return
        unit = self.type.block_bytes
        if self._carry is not None:
            need = unit - int(self._carry.shape[0])
            if n < need:
                self._carry = self._xp.concatenate((self._carry, chunk))
                return
            self._scan_whole(self._xp.concatenate((self._carry, chunk[:need])))
            self._carry = None
            chunk = chunk[need:]
            n -= need
        whole = n - n % unit
        if whole:
            self._scan_whole(chunk[:whole])
        if whole < n:
            # A copy: the caller may reuse the chunk's buffer once we return.
            self._carry = chunk[whole:].copy()

    def _scan_whole(self, data: Bytes) -> None:
        """Scan ``data``, a whole number of units, and add it to the tally."""
        self._tally.add(self._scanner.scan(data, self._scratch), self._done_units)
        self._done_units += int(data.shape[0]) // self.type.block_bytes

    def finish(self) -> TensorFailure | None:
        """The verdict on everything fed: a ``TensorFailure``, or None if the tensor is good.

        A type or size failure takes precedence over bad values, as in ggml.
        """
        self._finished = True
        self._carry = None
        return self._scanner.failure(self.name, self._nbytes, self._tally)


def check_tensor(
    name: str, type: GGMLType, data: Bytes, xp: ModuleType = numpy
) -> TensorFailure | None:
    """Check one whole tensor's bytes by ggml's rules (format §5.2).

    ``name``: the tensor's name, for the report.
    ``type``: its ggml type row.
    ``data``: its bytes, without padding: a 1-D uint8 array of ``xp``.
    ``xp``: the array module of ``data`` (numpy, or cupy for a device array).

    Returns None if the tensor is good, else a ``TensorFailure`` with the problem, the
    index of the first bad block (quantized types) or element (plain types), and how many
    are bad.

    Raises ``ValueError`` if ``data`` is not a 1-D uint8 array.
    """
    failure = precheck(name, type, int(data.shape[0]))
    if failure is not None:
        return failure
    checker = TensorChecker(name, type, xp=xp)
    checker.update(data)
    return checker.finish()


# ---------------------------------------------------------------------------------------
# The piece checker: out of order, from several threads.

# Scratch arrays of the host scans that ``PieceCheck`` runs, one set per thread: a thread
# scans one slice at a time, so every PieceCheck may share its thread's set.
_thread_local = threading.local()


def _thread_scratch() -> _Scratch:
    scratch: _Scratch | None = getattr(_thread_local, "scratch", None)
    if scratch is None:
        scratch = _thread_local.scratch = _Scratch(numpy)
    return scratch


class _Coverage:
    """Disjoint unit intervals ``[start, end)``, kept sorted and merged when they touch."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []

    def claim(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """Mark ``[lo, hi)`` covered; return its parts that were not covered yet."""
        starts, ends = self._starts, self._ends
        # Intervals i..j-1 overlap or touch [lo, hi): end >= lo and start <= hi.
        i = bisect_left(ends, lo)
        j = bisect_right(starts, hi)
        gaps: list[tuple[int, int]] = []
        cursor = lo
        for k in range(i, j):
            if starts[k] > cursor:
                gaps.append((cursor, starts[k]))
            cursor = max(cursor, ends[k])
        if cursor < hi:
            gaps.append((cursor, hi))
        merged_start = min(lo, starts[i]) if i < j else lo
        merged_end = max(hi, ends[j - 1]) if i < j else hi
        starts[i:j] = [merged_start]
        ends[i:j] = [merged_end]
        return gaps

    @property
    def intervals(self) -> list[tuple[int, int]]:
        """The covered intervals, sorted."""
        return list(zip(self._starts, self._ends, strict=True))


class PieceCheck:
    """Validation of one tensor fed as pieces, in any order, from any thread.

    A reader thread calls ``check_piece`` on each piece right after reading it; the
    whole units inside the piece are checked there.
    ``finish`` then checks only the units no piece covered (those cut by a piece edge)
    and gives the same verdict as ``check_tensor`` on the whole tensor. Host memory only.
    """

    def __init__(self, name: str, type: GGMLType, nbytes: int, *, offset: int = 0) -> None:
        """Prepare to check tensor ``name`` of ``type``, ``nbytes`` long (without padding);
        ``offset``: where its bytes start in their file (kept for the caller).

        Raises ``ValueError`` if ``nbytes`` is negative.
        """
        if nbytes < 0:
            raise ValueError(f"tensor '{name}': negative size {nbytes}")
        self.name = name
        self.type = type
        self.nbytes = nbytes
        self.offset = offset
        self._scanner = _scanner(type, numpy, HOST_SLICE_BYTES)
        # A tensor that fails before any value is looked at needs no scan at all.
        self._scan = precheck(name, type, nbytes) is None and self._scanner.mode is not _Scan.NONE
        self._units = nbytes // self._scanner.unit_bytes
        self._lock = threading.Lock()  # guards the four fields below
        self._tally = _Tally()
        self._covered = _Coverage()
        self._finished = False
        # Set when a scan raised after its units were claimed: finish() rescans it all.
        self._broken = False

    def check_piece(self, data: numpy.ndarray[Any, Any], byte_offset: int) -> None:
        """Check the whole units in ``data``, the tensor's bytes from ``byte_offset`` on.

        Pieces may start and end anywhere (mid-block too) and come in any order from any
        thread. A unit covered by two pieces is scanned and counted once. The numpy work
        runs outside the lock, so threads check their pieces in parallel.

        Raises ``ValueError`` if ``data`` is not a 1-D uint8 array or lies outside the tensor.
        Raises ``RuntimeError`` after ``finish()``.
        """
        if self._finished:  # a caller bug, so an unlocked look is enough here
            raise RuntimeError(f"tensor '{self.name}': check_piece() after finish()")
        n = self._validate(data, "check_piece")
        if byte_offset < 0 or byte_offset + n > self.nbytes:
            raise ValueError(
                f"tensor '{self.name}': piece [{byte_offset}, {byte_offset + n}) lies "
                f"outside its {self.nbytes} bytes"
            )
        if not self._scan:
            return
        unit = self._scanner.unit_bytes
        lo = -(-byte_offset // unit)  # the first unit that starts inside the piece
        hi = (byte_offset + n) // unit  # one past the last unit that ends inside it
        if lo >= hi:
            return
        with self._lock:
            if self._finished:
                raise RuntimeError(f"tensor '{self.name}': check_piece() after finish()")
            gaps = self._covered.claim(lo, hi)
        try:
            self._scan_gaps(data, byte_offset, gaps)
        except BaseException:
            with self._lock:
                self._broken = True
            raise

    def finish(self, data: numpy.ndarray[Any, Any]) -> TensorFailure | None:
        """Check what no piece covered; the verdict of ``check_tensor(name, type, data)``.

        ``data`` is the whole tensor, every byte landed. Call it once every
        ``check_piece`` call has returned.

        Raises ``ValueError`` if ``data`` is not a 1-D uint8 array of ``nbytes`` bytes.
        """
        n = self._validate(data, "finish")
        if n != self.nbytes:
            raise ValueError(
                f"tensor '{self.name}': finish() got {n} bytes, expected {self.nbytes}"
            )
        return self.finish_from(lambda lo, hi: data[lo:hi])

    def finish_from(self, fetch: Callable[[int, int], Bytes]) -> TensorFailure | None:
        """``finish`` for a tensor not in host memory (on a device, or a mapped file's):
        ``fetch(lo, hi)`` returns its bytes ``[lo, hi)`` as a 1-D uint8 host array; asked
        only for units no piece covered, ``HOST_SLICE_BYTES`` at most (a fetch copies)."""
        with self._lock:
            self._finished = True
            if self._broken:
                self._tally = _Tally()
                gaps = [(0, self._units)] if self._scan and self._units else []
            else:
                gaps = self._covered.claim(0, self._units) if self._scan and self._units else []
        unit = self._scanner.unit_bytes
        step = max(1, HOST_SLICE_BYTES // unit)
        for lo, hi in ((at, min(at + step, end)) for g, end in gaps for at in range(g, end, step)):
            self._scan_gaps(fetch(lo * unit, hi * unit), lo * unit, [(lo, hi)])
        return self._scanner.failure(self.name, self.nbytes, self._tally)

    def _validate(self, data: numpy.ndarray[Any, Any], what: str) -> int:
        if data.ndim != 1 or data.dtype != numpy.uint8:
            raise ValueError(
                f"tensor '{self.name}': {what}() expected a 1-D uint8 array, "
                f"got {data.ndim}-D {data.dtype}"
            )
        return int(data.shape[0])

    def _scan_gaps(
        self, data: numpy.ndarray[Any, Any], byte_offset: int, gaps: list[tuple[int, int]]
    ) -> None:
        """Scan units ``[lo, hi)`` of each gap in ``data`` (which starts at ``byte_offset``)."""
        if not gaps:
            return
        unit = self._scanner.unit_bytes
        scratch = _thread_scratch()
        tally: _Tally | None = None  # made only when a scan finds something
        for lo, hi in gaps:
            start = lo * unit - byte_offset
            found = self._scanner.scan(data[start : start + (hi - lo) * unit], scratch)
            if found.count:
                tally = tally or _Tally()
                tally.add(found, lo)
        if tally is not None:
            with self._lock:
                self._tally.merge(tally)
