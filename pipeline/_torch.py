"""Loaded tensors as ``torch.Tensor``s that share the model's memory (the ``torch`` extra).

Nothing here imports torch until a tensor is asked for: ``import aiogguf`` stays free of
it, and a process that never calls ``Model.torch`` never pays its import (seconds).

A tensor reaches torch through DLPack, without a copy: a host array (numpy) becomes a
``cpu`` tensor, a device array (CuPy) a ``cuda:N`` tensor on its GPU. The dtypes are
ggml's: F32 ``float32``, F16 ``float16``, BF16 ``bfloat16`` (numpy has none, so its
``uint16`` bits are viewed as ``bfloat16``), F64 ``float64``, I8…I64 ``int8``…``int64``.
A quantized tensor is its rows of blocks as ``uint8``, shaped as gguf-py shapes it
(what ``gguf.quants``, vLLM's and llama.cpp's kernels take): ``(..., ne1, row_bytes)``
with ``row_bytes = ne0 / block_elems * block_bytes``; ``.view(*t.shape[:-1], -1,
block_bytes)`` gives one block per row of the last axis.

torch has no read-only tensor, so every tensor handed over is writable memory: a mapped
model (``mmap``, ``mlock``) gives torch its copy-on-write pages (``FileMapping``), where a
write lands in the process's own copy of the page; a read-only page would end the
process with SIGSEGV instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiogguf._records import TensorEntry

if TYPE_CHECKING:
    import torch

__all__ = ["to_torch"]


_TORCH_INSTALL = "pip install 'aiogguf[torch]'"


def to_torch(array: Any, entry: TensorEntry) -> torch.Tensor:
    """``array`` (``Model.tensors[entry.name]``: numpy or CuPy, in aiogguf's shape) as a
    torch tensor over the same memory, with ggml's dtype and gguf-py's shape.

    Torch tensors are always writable: ``array`` should be writable memory (for a mapped
    model, its copy-on-write pages: ``tensor_array(..., private=True)``).

    Raises ``ModuleNotFoundError`` saying how to install torch where it is missing."""
    try:
        import torch
    except ModuleNotFoundError as exc:
        # Only torch itself: a module missing inside torch is a broken install, not an
        # extra left out.
        if exc.name != "torch":
            raise
        raise ModuleNotFoundError(
            f"torch tensors need torch, which is not installed: {_TORCH_INSTALL}", name="torch"
        ) from exc

    if entry.type.element_dtype is None:
        # (..., ne1, n_blocks, block_bytes) -> (..., ne1, row_bytes): a view, no copy.
        array = array.reshape(*array.shape[:-2], array.shape[-2] * array.shape[-1])
    try:
        tensor = torch.from_dlpack(array)
    except BufferError:
        # numpy before 2.1 exports no read-only array through DLPack (it cannot flag it
        # read-only there); torch.from_numpy shares it, and warns that it is read-only.
        tensor = torch.from_numpy(array)
    if entry.type.name == "BF16":
        tensor = tensor.view(torch.bfloat16)
    return tensor
