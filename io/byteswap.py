"""Byte order conversion of tensor data from files of the other byte order.

A big-endian GGUF file stores every multi-byte value big-endian, the fields inside
quantized blocks included (format §1.4). We convert what has one obvious element
layout — F32, F16, BF16, F64 and the integer types — and refuse every block type with a
``BigEndianError`` rather than hand out silently wrong data.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Literal, TypeAlias

import numpy as np
import numpy.typing as npt

from aiogguf.errors import BigEndianError
from aiogguf.io.ggml_types import GGMLType, TypeKind

__all__ = ["ByteOrder", "can_convert", "needs_swap", "to_native"]

ByteOrder: TypeAlias = Literal["little", "big"]
"""The byte order of a GGUF file."""

# Element width in bytes → an unsigned view to swap through. Width 1 (I8) needs nothing.
_SWAP_VIEWS: dict[int, type[np.unsignedinteger[Any]] | None] = {
    1: None,
    2: np.uint16,
    4: np.uint32,
    8: np.uint64,
}
_PLAIN = (TypeKind.FLOAT, TypeKind.INT)


def needs_swap(byte_order: ByteOrder) -> bool:
    """Whether data of a file in ``byte_order`` must be swapped on this host."""
    return byte_order != sys.byteorder


def can_convert(type: GGMLType) -> bool:
    """Whether ``to_native`` can convert tensors of ``type``."""
    return type.kind in _PLAIN and type.block_bytes in _SWAP_VIEWS


def to_native(
    type: GGMLType,
    data: npt.NDArray[np.uint8],
    *,
    path: str | os.PathLike[str] | None,
    name: str,
    offset: int | None = None,
) -> None:
    """Byte-swap one tensor's bytes in place, from the other byte order to this host's.

    ``type``: the tensor's ggml type.
    ``data``: its bytes, a writable 1-D uint8 array of whole elements.
    ``path``: the file it came from, for the error message.
    ``name``: the tensor's name, for the error message.
    ``offset``: the tensor's absolute file offset, for the error message.

    Raises ``BigEndianError`` if ``type`` is a block (quantized) or invalid type, whose byte
        order cannot be converted.
    Raises ``ValueError`` if ``data`` is not a 1-D uint8 array of whole elements.
    """
    if not can_convert(type):
        raise BigEndianError(
            path,
            offset,
            f"big-endian GGUF: byte order of type {type.name} cannot be converted "
            f"(tensor '{name}')",
        )
    if data.ndim != 1 or data.dtype != np.uint8 or data.size % type.block_bytes:
        raise ValueError(
            f"tensor '{name}': expected a 1-D uint8 array of whole {type.name} elements, "
            f"got {data.ndim}-D {data.dtype} of {data.size} items"
        )
    view = _SWAP_VIEWS[type.block_bytes]
    if view is not None:
        data.view(view).byteswap(inplace=True)
