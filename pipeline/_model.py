"""A loaded model: its metadata, its tensors where the plan put them, and the report."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from enum import Enum
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import numpy.typing as npt

from aiogguf._images import DeviceImage, Image, MappedImage
from aiogguf._jobs import TensorSlot
from aiogguf._records import MetadataValue, Plan, TensorEntry, WeightIndex
from aiogguf._report import LoadReport
from aiogguf.errors import ClosedResourceError, TensorFailure
from aiogguf.io.workers import LoadThreads

if TYPE_CHECKING:
    from torch import Tensor as TorchTensor
else:
    # torch is imported on first use, not with the model: at run time (get_type_hints,
    # documentation tools) the annotation resolves to Any.
    TorchTensor = Any

__all__ = ["Model", "ModelState", "array_shape", "tensor_array"]


class ModelState(Enum):
    """Whether a model's memory is still held."""

    OPEN = "open"
    CLOSED = "closed"


def array_shape(entry: TensorEntry) -> tuple[int, ...]:
    """numpy shape of a tensor: the reversed ggml shape for plain types; for quantized
    types the rows of blocks, ``(..., ne1, ne0 / block_elems, block_bytes)``."""
    t = entry.type
    dims = entry.shape or (1,)
    if t.element_dtype is not None:
        return tuple(reversed(dims))
    outer = tuple(reversed(dims[1:]))
    return (*outer, dims[0] // t.block_elems, t.block_bytes)


def tensor_array(
    image: Image, slot: TensorSlot, entry: TensorEntry, *, private: bool = False
) -> Any:
    """The tensor's array over ``image``, where its bytes lie (no copy): numpy for host
    memory, the device's array type otherwise, shaped as ``array_shape`` says.

    A mapped image's array is read-only; with ``private`` it is writable, over the
    mapping's copy-on-write pages (a write stays in the process: ``FileMapping``'s
    ``private_view``, which raises ``LoadError`` where the mapping is read-only)."""
    dtype = entry.type.element_dtype or "u1"
    shape = array_shape(entry)
    if isinstance(image, DeviceImage):
        data = image.buffer.array(slot.buffer_offset, slot.nbytes)
        return data.view(image.buffer.xp.dtype(dtype)).reshape(shape)
    if private and isinstance(image, MappedImage):
        mapping = image.mapping_at(slot.file_index, slot.file_offset)
        raw = np.frombuffer(mapping.private_view(slot.file_offset, slot.nbytes), dtype=np.uint8)
    else:
        raw = np.frombuffer(image.tensor_bytes(slot), dtype=np.uint8)
    return raw.view(np.dtype(dtype)).reshape(shape)


class _Tensors(Mapping[str, Any]):
    """Tensor name → array on its device (numpy for host memory, the device's array
    type otherwise). Arrays are views of the model's buffers: valid while it is open."""

    def __init__(self, model: Model) -> None:
        self._model = model

    def __getitem__(self, name: str) -> Any:
        return self._model._array(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._model._names)

    def __len__(self) -> int:
        return len(self._model._names)

    def __contains__(self, name: object) -> bool:
        return name in self._model._slots


class Model:
    """A loaded GGUF model. Close it (or leave its ``async with``) to free its memory.

    Loaded with ``mode="mmap"`` or ``"mlock"``, the host tensors *are* the file: private
    (copy-on-write) mappings of its page cache. Their numpy arrays and ``raw`` bytes are
    read-only; their torch tensors are writable, and a page written through one becomes
    the process's own copy (the file and other loads keep its bytes). If the file is
    truncated (or rewritten) while such a model is open, the next read of a page that is
    gone raises SIGBUS, which ends the process; Python cannot catch it. A load notices a
    change while it runs (it fails with ``LoadError``), but nothing can guard the model
    afterwards. When the files may change under you (a server, a shared model
    directory), load with ``mode="none"`` or ``"direct"``: the tensors are then copies in
    memory of the process's own.
    """

    def __init__(
        self,
        index: WeightIndex,
        plan: Plan,
        images: Sequence[Image | None],
        slots: Mapping[str, TensorSlot],
        report: LoadReport,
        *,
        failures: Sequence[TensorFailure] = (),
    ) -> None:
        self.index = index
        self.plan = plan
        self.report = report
        self.failures: tuple[TensorFailure, ...] = tuple(failures)
        self._images = list(images)
        self._slots = slots
        # The tensors the model holds, in the index's order: all of them, except for
        # one node's part of a model loaded over a cluster (``aiogguf.cluster``).
        self._names = tuple(t.name for t in index.tensors if t.name in slots)
        self._state = ModelState.OPEN
        self._on_close: list[Callable[[], None]] = []

    @property
    def tensors(self) -> Mapping[str, Any]:
        """Tensor name → array on its device, in the index's order (llama.cpp's load
        order, by layer; ``index.file_order`` is the files' own); arrays are views of
        the model's buffers, valid while it is open."""
        # Made on each access: a view kept as an attribute would be a reference cycle,
        # and a cycle leaves a closed model's records to the cyclic collector.
        return _Tensors(self)

    @property
    def metadata(self) -> Mapping[str, MetadataValue]:
        """Key → value of the first split's metadata (arrays as ``GGUFArray``)."""
        return {key: entry.value for key, entry in self.index.metadata.items()}

    @property
    def state(self) -> ModelState:
        return self._state

    def _image(self, name: str) -> tuple[Image, TensorSlot]:
        if self._state is ModelState.CLOSED:
            raise ClosedResourceError(f"model {self.index.files[0].path}")
        slot = self._slots.get(name)
        if slot is None:
            raise KeyError(name)
        image = self._images[slot.buffer_index]
        assert image is not None
        return image, slot

    def _array(self, name: str, *, private: bool = False) -> Any:
        image, slot = self._image(name)
        return tensor_array(image, slot, self.index[name], private=private)

    def torch(self, name: str) -> TorchTensor:
        """The tensor as a ``torch.Tensor`` sharing its memory (no copy), on its device
        (``cpu``, or ``cuda:N`` through DLPack from CuPy), with ggml's dtype (BF16 as
        ``bfloat16``); a quantized one as ``uint8`` rows of blocks ``(..., ne1,
        row_bytes)``, gguf-py's shape. Needs the ``torch`` extra; valid while the model
        is open.

        Host tensors of the mapped modes (``mmap``, ``mlock``) are over the file's pages
        mapped copy-on-write: writable (torch has no read-only tensor), and a page written
        becomes the process's own copy, seen by this model's arrays, not by the file or
        another load. ``mode="none"`` or ``"direct"`` gives tensors in memory of the
        process's own from the start.

        Raises ``ModuleNotFoundError`` (saying how to install it) without torch;
        ``LoadError`` for a mapped tensor where the kernel refused a copy-on-write
        mapping (its pages are then the file's, read-only, and a write would end the
        process).
        """
        from aiogguf._torch import to_torch

        return to_torch(self._array(name, private=True), self.index[name])

    def torch_tensors(self) -> dict[str, TorchTensor]:
        """Every tensor as ``torch(name)`` gives it, by name, in the order of ``tensors``;
        raises as ``torch`` does."""
        from aiogguf._torch import to_torch

        return {n: to_torch(self._array(n, private=True), self.index[n]) for n in self._names}

    def dequantize(self, name: str, dtype: npt.DTypeLike = np.float32) -> npt.NDArray[Any]:
        """The tensor's values as a new host numpy array of ``dtype``, in numpy's shape
        (the reversed ggml shape), through gguf-py's ``gguf.quants`` (the ``gguf``
        extra). The slow path: numpy on the calling thread, a device tensor copied back
        first; keep weights quantized where the consumer takes them so. Raises
        ``NotImplementedError`` for a type gguf-py has no kernel for."""
        from aiogguf._dequant import dequantize

        return dequantize(self.raw(name), self.index[name], dtype)

    def writable(self, name: str) -> bool:
        """Whether ``tensors[name]`` may be written: False for host tensors of the mapped
        modes (``mmap``, ``mlock``), whose arrays are read-only views of the file's pages
        (their ``torch`` tensors take writes, into the process's own copy)."""
        image, _ = self._image(name)
        return not isinstance(image, MappedImage)

    def raw(self, name: str) -> memoryview:
        """The tensor's exact bytes in host memory (copied back from a device if needed);
        read-only for host tensors of the mapped modes."""
        image, slot = self._image(name)
        if isinstance(image, DeviceImage):
            return image.buffer.to_host(slot.buffer_offset, slot.nbytes)
        return image.tensor_bytes(slot)

    def close(self) -> None:
        """Free every buffer and unmap every mapping. Arrays taken from ``tensors`` must
        not be used afterwards. Closing twice is harmless."""
        if self._state is ModelState.CLOSED:
            return
        self._state = ModelState.CLOSED
        images, self._images = self._images, []
        try:
            for image in images:
                if image is not None:
                    image.close()
        finally:
            callbacks, self._on_close = self._on_close, []
            for fn in callbacks:
                fn()

    def on_close(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` once when the model closes, after its memory is freed (what that
        memory was held by, such as a server's lease for ``aiogguf.attach``); at once
        if it is closed already."""
        if self._state is ModelState.CLOSED:
            fn()
        else:
            self._on_close.append(fn)

    async def aclose(self) -> None:
        """``close``, on a thread of the load pool (unmapping and freeing many GiB takes a
        while: not on the loop's thread), done even while the caller is cancelled."""
        if self._state is ModelState.CLOSED:
            return
        with anyio.CancelScope(shield=True):
            async with LoadThreads(1, name="aiogguf-close") as threads:
                await threads.run_sync(self.close)

    def __del__(self) -> None:
        if getattr(self, "_state", ModelState.CLOSED) is ModelState.OPEN:
            warnings.warn(
                f"model {self.index.files[0].path} was never closed (leave its `async with`, "
                "or call `model.close()` / `await model.aclose()`)",
                ResourceWarning,
                stacklevel=1,
            )
            # Its buffers and mappings would each say so too: once is enough.
            self.close()

    def __repr__(self) -> str:
        return (
            f"<Model {self.index.files[0].path} {len(self._names)} tensors "
            f"{self.report.nbytes} bytes {self._state.value}>"
        )
