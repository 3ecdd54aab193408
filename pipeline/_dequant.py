"""Tensors as plain numbers on the host, through gguf-py's ``gguf.quants`` (the ``gguf``
extra): the slow path.

aiogguf keeps weights as the file stores them, since that is what the kernels that use
them take; this is for inspecting, testing or converting a few tensors. It is numpy on
the calling thread, with a full-size intermediate per tensor, and gguf-py has no kernel
for some types (``NotImplementedError``, raised as gguf-py raises it).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from aiogguf._records import TensorEntry

__all__ = ["dequantize"]


def dequantize(raw: memoryview, entry: TensorEntry, dtype: npt.DTypeLike) -> npt.NDArray[Any]:
    """The values of the tensor whose bytes are ``raw``, as a new array of ``dtype`` in
    numpy's shape (the reversed ggml shape)."""
    shape = tuple(reversed(entry.shape))
    data = np.frombuffer(raw, dtype=np.uint8)
    ggml = entry.type
    if ggml.element_dtype is not None and ggml.name != "BF16":
        return data.view(ggml.element_dtype).reshape(shape).astype(dtype)
    try:
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize as gguf_dequantize
    except ImportError as exc:
        raise ImportError(
            "Model.dequantize needs gguf-py's kernels: pip install 'aiogguf[gguf]'"
        ) from exc
    rows = data.reshape(*shape[:-1], -1) if shape else data
    values = gguf_dequantize(rows, GGMLQuantizationType(ggml.id))
    return np.asarray(values).reshape(shape).astype(dtype, copy=False)
