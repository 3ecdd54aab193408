"""Byte order conversion of big-endian tensor data."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from aiogguf.errors import BigEndianError, LoadError
from aiogguf.io.byteswap import can_convert, needs_swap, to_native
from aiogguf.io.ggml_types import GGML_TYPES, GGMLType
from aiogguf.io.ggml_types import ggml_type_by_name as by_name

# Type name → the big-endian numpy dtype a big-endian writer would have produced.
BIG_ENDIAN = {
    "F32": ">f4",
    "F16": ">f2",
    "BF16": ">u2",
    "F64": ">f8",
    "I8": ">i1",
    "I16": ">i2",
    "I32": ">i4",
    "I64": ">i8",
}


@pytest.mark.parametrize("name", list(BIG_ENDIAN))
def test_round_trip_against_numpy(name: str) -> None:
    type_ = by_name(name)
    rng = np.random.default_rng(7)
    native = rng.integers(0, 256, 64 * type_.block_bytes, dtype=np.uint8)
    assert type_.element_dtype is not None
    values = native.view(type_.element_dtype)
    big = values.astype(BIG_ENDIAN[name])  # what the file holds
    data = big.view(np.uint8).copy()
    if type_.block_bytes > 1:
        assert not np.array_equal(data, native)
    # Same as numpy's own byteswap of the element array.
    swapped = big.view(np.uint8).view(f"u{type_.block_bytes}").byteswap().view(np.uint8)
    to_native(type_, data, path="m.gguf", name="w")
    assert np.array_equal(data, native)
    assert np.array_equal(data, swapped)
    to_native(type_, data, path="m.gguf", name="w")  # swapping twice restores the file
    assert np.array_equal(data, big.view(np.uint8))


@pytest.mark.parametrize(
    "type_", [t for t in GGML_TYPES.values() if t.name not in BIG_ENDIAN], ids=lambda t: t.name
)
def test_block_and_invalid_types_are_refused(type_: GGMLType) -> None:
    assert not can_convert(type_)
    data = np.zeros(type_.block_bytes or 8, np.uint8)
    with pytest.raises(BigEndianError) as info:
        to_native(type_, data, path="/m/big.gguf", name="blk.0.attn_q.weight", offset=4096)
    assert str(info.value) == (
        f"/m/big.gguf: at offset 4096: big-endian GGUF: byte order of type {type_.name} "
        "cannot be converted (tensor 'blk.0.attn_q.weight')"
    )
    assert isinstance(info.value, LoadError)
    assert not data.any()  # untouched


def test_q4_k_error_names_type_and_tensor() -> None:
    with pytest.raises(BigEndianError, match=r"type Q4_K cannot be converted \(tensor 'out'\)"):
        to_native(by_name("Q4_K"), np.zeros(144, np.uint8), path=None, name="out")


def test_partial_element_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="whole F32 elements"):
        to_native(by_name("F32"), np.zeros(6, np.uint8), path=None, name="w")


def test_needs_swap() -> None:
    assert needs_swap(sys.byteorder) is False  # type: ignore[arg-type]
    assert needs_swap("big" if sys.byteorder == "little" else "little") is True
