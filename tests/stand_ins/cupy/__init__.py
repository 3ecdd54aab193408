"""A stand-in for CuPy: CuPy's names over numpy and host memory, for dry runs on a
machine without a GPU (``PYTHONPATH=tests/stand_ins``).

It lets the CuPy backend, ``bench/gpu_check.py`` and the ``gpu`` tests run end to end on
a CPU, so that a mistake in them shows up before a GPU is lent, not on it. It proves
nothing about CUDA: device memory is host memory, a "device" array is a numpy array over
it (``ndarray``, a numpy subclass with a ``device``), every copy is a ``memmove`` done
when it is queued, so every event is complete as soon as it is recorded, and pinning
pins nothing (but takes its time: ``cuda``'s docstring says what CUDA's start-up and
pinning cost it). Kernels (ufuncs, reductions) refuse an array whose device is not the
current one, as CuPy's do. ``STAND_IN_CUPY_DEVICES`` says how many devices it shows (default 1);
``STAND_IN_CUPY_IMPORT_S`` makes its import sleep that long (default 0), as CuPy's own
import takes about a second on a GPU host: a first load that imports it on the event
loop's thread stalls the loop that long.
"""

from __future__ import annotations

import ctypes
import os
import time
from typing import Any

import numpy as _np

from . import cuda

time.sleep(float(os.environ.get("STAND_IN_CUPY_IMPORT_S", "0")))
__version__ = "0.0+stand-in"


class ndarray(_np.ndarray):  # CuPy's name
    """A "device" array: a numpy array over device memory, with the device it is on."""

    _device: cuda.Device
    _memory: Any

    @property  # type: ignore[override]
    def device(self) -> cuda.Device:  # numpy's own ``device`` is the array API's "cpu"
        return self._device

    def __new__(
        cls,
        shape: Any,
        dtype: Any = float,
        memptr: cuda.MemoryPointer | None = None,
        strides: Any = None,
        order: str = "C",
    ) -> ndarray:
        if memptr is None:
            array = _np.ndarray.__new__(cls, shape, dtype, strides=strides, order=order)
            array._device = cuda.Device(cuda.current())
            array._memory = None
            return array
        nbytes = int(_np.prod(shape)) * _np.dtype(dtype).itemsize
        raw = (ctypes.c_uint8 * max(nbytes, 1)).from_address(memptr.ptr)
        array = _np.ndarray.__new__(cls, shape, dtype, buffer=raw, strides=strides, order=order)
        array._device = cuda.Device(memptr.mem.device_id)
        array._memory = memptr.mem  # the device memory lives as long as its views
        return array

    @property  # type: ignore[override]
    def data(self) -> cuda.MemoryPointer:  # CuPy's ``data`` is a pointer, not a buffer
        return cuda.MemoryPointer.at(self._memory, self.__array_interface__["data"][0])

    def __array_finalize__(self, obj: Any) -> None:
        self._device = getattr(obj, "_device", None) or cuda.Device(cuda.current())
        self._memory = getattr(obj, "_memory", None)

    def get(self) -> _np.ndarray:
        """A host copy."""
        return _np.array(self.view(_np.ndarray))

    # A kernel runs on the current device: as CuPy does, an array on another device is
    # refused (views, slices and ``get`` run no kernel and work anywhere).
    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        out = kwargs.get("out", ())
        _on_current_device((*inputs, *(out if isinstance(out, tuple) else (out,))))
        inputs = tuple(_plain(x) for x in inputs)
        if "out" in kwargs:
            kwargs["out"] = tuple(_plain(x) for x in kwargs["out"])
        return getattr(ufunc, method)(*inputs, **kwargs)

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        flat = [y for x in args for y in (x if isinstance(x, list | tuple) else (x,))]
        _on_current_device((*flat, *kwargs.values()))
        return super().__array_function__(func, types, args, kwargs)


def _plain(x: Any) -> Any:
    return x.view(_np.ndarray) if isinstance(x, ndarray) else x


def _on_current_device(arrays: Any) -> None:
    now = cuda.current()
    for array in arrays:
        if isinstance(array, ndarray) and array._device.id != now:
            raise ValueError(
                f"The device where the array resides ({array._device.id}) is different "
                f"from the current device ({now})."
            )


def asnumpy(array: Any) -> _np.ndarray:
    return array.get() if isinstance(array, ndarray) else _np.asarray(array)


def __getattr__(name: str) -> Any:
    # CuPy mirrors numpy's namespace (dtypes, ufuncs, reductions); so does the stand-in.
    return getattr(_np, name)
