"""Writes through one view of a mapped model, in a process of its own: a write into a
read-only page ends the process with SIGSEGV, which the parent sees in the exit status.

Usage: ``python mapped_write_worker.py PATH MODE WAY NAME OFFSET NBYTES``: load ``PATH``
in ``MODE`` (``mmap`` or ``mlock``), write through the view ``WAY`` (``WAYS``) into the
F32 tensor ``NAME`` (its bytes at ``OFFSET`` in the file), then load the file again while
the first model is open. One JSON line on
stdout:

- ``raised``: ``"Type: message"`` where the write raised, else None;
- ``landed``: the first model's own array shows what was written;
- ``second_sees_file``: the second load's bytes are the file's as read before the write;
- ``first_keeps_write``: the first model still shows the write after the second load;
- ``anon_before``/``anon_after``: bytes of process-own (anonymous) pages in the
  model's mappings of the file before and after the write (``/proc/self/smaps``);
- ``locked``: bytes locked in those mappings after the load.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import aiogguf

WAYS = (
    "numpy",  # model.tensors[name][...] = 7
    "raw",  # model.raw(name)[0] = 7
    "add",  # model.torch(name).add_(1)
    "index",  # model.torch_tensors()[name][0] = 7
    "copy",  # model.torch(name).copy_(torch.full_like(t, 7))
    "tensor_numpy",  # model.torch(name).numpy()[...] = 7
    "dlpack",  # torch.from_dlpack(model.tensors[name]).fill_(7)
    "from_numpy",  # torch.from_numpy(model.tensors[name]).fill_(7): torch warns first
    "stream",  # tensors_as_ready().torch(): the streamed tensor's fill_(7)
)
TORCH_WAYS = frozenset(WAYS) - {"numpy", "raw"}


def smaps(path: Path) -> dict[str, int]:
    """Anonymous and Locked bytes over this process's mappings of ``path``."""
    inode = os.stat(path).st_ino
    totals = {"Anonymous": 0, "Locked": 0}
    ours = False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" not in fields[0]:
                ours = len(fields) >= 6 and int(fields[4]) == inode
            elif ours and fields[0].rstrip(":") in totals:
                totals[fields[0].rstrip(":")] += int(fields[1]) * 1024
    return totals


def write(model: aiogguf.Model, way: str, name: str) -> Callable[[np.ndarray], np.ndarray]:
    """Write through ``way``; returns what the array should be after, from before."""
    if way == "numpy":
        model.tensors[name][...] = 7
    if way == "raw":
        model.raw(name)[0] = 7
    if way not in TORCH_WAYS:
        raise AssertionError(f"{way} did not raise")
    import torch

    sevens = lambda before: np.full_like(before, 7)  # noqa: E731
    if way == "add":
        model.torch(name).add_(1)
        return lambda before: before + 1
    if way == "index":
        model.torch_tensors()[name][0] = 7

        def first(before: np.ndarray) -> np.ndarray:
            after = before.copy()
            after[0] = 7
            return after

        return first
    if way == "copy":
        tensor = model.torch(name)
        tensor.copy_(torch.full_like(tensor, 7))
    elif way == "tensor_numpy":
        model.torch(name).numpy()[...] = 7
    elif way == "dlpack":
        torch.from_dlpack(model.tensors[name]).fill_(7)
    elif way == "from_numpy":
        torch.from_numpy(model.tensors[name]).fill_(7)
    return sevens


def stream(path: Path, mode: str, name: str) -> dict[str, Any]:
    """The ``stream`` way: the write goes through the streamed tensor, while the load
    that streams it is the first model."""
    import anyio

    async def main() -> dict[str, Any]:
        result: dict[str, Any] = {"raised": None}
        async with aiogguf.load(path, mode=mode, n_gpu_layers=0).tensors_as_ready() as ready:
            async for got, tensor in ready.torch():
                if got != name:
                    continue
                result["anon_before"] = smaps(path)["Anonymous"]
                tensor.fill_(7)
                result["anon_after"] = smaps(path)["Anonymous"]
                result["landed"] = bool((tensor == 7).all())
                async with aiogguf.load(path, mode=mode, n_gpu_layers=0) as second:
                    result["second"] = bytes(second.raw(name))
                result["first_keeps_write"] = bool((tensor == 7).all())
                result["locked"] = smaps(path)["Locked"]
        return result

    return anyio.run(main)


def main() -> None:
    path, mode, way, name = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    offset, nbytes = int(sys.argv[5]), int(sys.argv[6])
    if way not in WAYS:
        raise SystemExit(f"unknown way {way!r}")
    with open(path, "rb") as f:
        original = os.pread(f.fileno(), nbytes, offset)
    if way == "stream":
        result = stream(path, mode, name)
    else:
        result = {"raised": None}
        with aiogguf.load_sync(path, mode=mode, n_gpu_layers=0) as model:
            result["locked"] = smaps(path)["Locked"]
            before = np.array(model.tensors[name])
            result["anon_before"] = smaps(path)["Anonymous"]
            try:
                expected = write(model, way, name)
            except Exception as exc:
                result["raised"] = f"{type(exc).__name__}: {exc}"
                expected = lambda before: before  # noqa: E731
            result["anon_after"] = smaps(path)["Anonymous"]
            result["landed"] = np.array_equal(model.tensors[name], expected(before))
            with aiogguf.load_sync(path, mode=mode, n_gpu_layers=0) as second:
                result["second"] = bytes(second.raw(name))
            result["first_keeps_write"] = np.array_equal(model.tensors[name], expected(before))
    result["second_sees_file"] = result.pop("second") == original
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
