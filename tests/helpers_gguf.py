"""Small GGUF files for tests, written by llama.cpp's own writer (``gguf.GGUFWriter``).

    write_gguf(tmp_path / "t.gguf",
               {"general.architecture": "llama", "llama.block_count": np.uint32(2)},
               [("a.weight", np.ones((2, 32), np.float32)),
                ("q.weight", (raw_bytes, 12, (2, 256)))])   # Q4_K, numpy-order shape

Metadata values: ``(value, GGUFValueType)`` for an exact type, or a plain value typed by
gguf's rule (str → STRING, bool → BOOL, int → INT32, float → FLOAT32, list → ARRAY) or a
NumPy scalar (``np.uint32(7)`` → UINT32, ``np.uint64`` → UINT64, …).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, cast

import gguf
import numpy as np

__all__ = ["RawTensor", "TensorSource", "write_gguf"]

# (bytes, ggml type id, shape in NumPy order: outermost first, ne[0] last)
RawTensor = tuple[bytes, int, tuple[int, ...]]
TensorSource = np.ndarray[Any, Any] | RawTensor

_NUMPY_VALUE_TYPES: dict[type[np.generic], gguf.GGUFValueType] = {
    np.uint8: gguf.GGUFValueType.UINT8,
    np.int8: gguf.GGUFValueType.INT8,
    np.uint16: gguf.GGUFValueType.UINT16,
    np.int16: gguf.GGUFValueType.INT16,
    np.uint32: gguf.GGUFValueType.UINT32,
    np.int32: gguf.GGUFValueType.INT32,
    np.float32: gguf.GGUFValueType.FLOAT32,
    np.uint64: gguf.GGUFValueType.UINT64,
    np.int64: gguf.GGUFValueType.INT64,
    np.float64: gguf.GGUFValueType.FLOAT64,
    np.bool_: gguf.GGUFValueType.BOOL,
}


def _typed(value: Any) -> tuple[Any, gguf.GGUFValueType]:
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], gguf.GGUFValueType):
        return value[0], value[1]
    if isinstance(value, np.generic):
        return value.item(), _NUMPY_VALUE_TYPES[type(value)]
    return value, gguf.GGUFValueType.get_type(value)


def write_gguf(
    path: str | os.PathLike[str],
    kv: Mapping[str, Any],
    tensors: Sequence[tuple[str, TensorSource]] = (),
    *,
    endian: Literal["little", "big"] = "little",
    alignment: int | None = None,
) -> Path:
    """Write ``kv`` and ``tensors`` (in order) to ``path`` and return it.

    A NumPy array is written as its dtype (F32/F16/F64/I8–I64; native order, swapped for
    ``endian="big"``). A ``RawTensor`` is written byte for byte with any type id, even one
    gguf does not know (Q2_0 = 42); its bytes must already be in the file's byte order.
    ``general.architecture`` comes from ``kv`` only (the writer adds nothing by itself).
    ``alignment`` writes ``general.alignment`` and pads to it.
    """
    out = Path(path)
    byte_order = gguf.GGUFEndian.BIG if endian == "big" else gguf.GGUFEndian.LITTLE
    # An empty arch makes the writer skip general.architecture; it comes from kv if wanted.
    writer = gguf.GGUFWriter(out, "", endianess=byte_order)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, value in kv.items():
        plain, vtype = _typed(value)
        sub_type = None
        if vtype is gguf.GGUFValueType.ARRAY and plain and isinstance(plain[0], np.generic):
            sub_type = _NUMPY_VALUE_TYPES[type(plain[0])]
            plain = [v.item() for v in plain]
        writer.add_key_value(key, plain, vtype, sub_type=sub_type)
    for name, source in tensors:
        if isinstance(source, np.ndarray):
            writer.add_tensor(name, source)
            continue
        raw, type_id, shape = source
        # Any dtype but uint8 makes the writer take ``shape`` as element counts; the int
        # type id is packed as is, so ids newer than gguf's enum work too.
        writer.add_tensor_info(
            name, shape, np.dtype(np.float32), len(raw), raw_dtype=cast(Any, type_id)
        )
        writer.tensors[-1][name].tensor = np.frombuffer(raw, np.uint8)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return out
