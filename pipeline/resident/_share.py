"""STAND-IN for helper "share"'s module (issue 37): replaced by the real one at merge.

The contract the attach protocol codes against: ``share_model`` hands out what a client
needs to rebuild a resident model (a JSON ``description`` and descriptors to pass with
``SCM_RIGHTS``); ``open_shared_model`` rebuilds it in the client from them. This stand-in
shares only models loaded in mode ``mmap`` (or ``mlock``): the descriptors are the
model's files, opened again, and the client maps them copy-on-write by loading them in
mode ``mmap`` through those descriptors. The real module shares copied host buffers
(memfd) and device buffers as well.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

from aiogguf._api import load
from aiogguf._images import DeviceImage, HostImage
from aiogguf._model import Model
from aiogguf._run import run
from aiogguf.errors import LoadError
from aiogguf.io.files import open_readable

__all__ = ["ModelShare", "open_shared_model", "share_model"]

_KIND = "stand-in/mmap"


class ModelShare:
    """What one client is handed: ``description`` (JSON) and ``fds`` (owned here, closed
    on exit: ``send_fds`` duplicates them into the client)."""

    def __init__(self, description: bytes, fds: Sequence[int]) -> None:
        self.description = description
        self.fds: tuple[int, ...] = tuple(fds)

    def close(self) -> None:
        fds, self.fds = self.fds, ()
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def __enter__(self) -> ModelShare:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def share_model(model: Model) -> ModelShare:
    """What a client needs to map ``model``: blocking (opens its files), on a thread.
    Raises ``LoadError`` for a model not loaded shareable (here: not in a mapped mode)."""
    path = model.index.files[0].path
    images = model._images
    if any(isinstance(i, HostImage | DeviceImage) for i in images):
        raise LoadError(path, None, "the model was not loaded shareable (stand-in: mode mmap)")
    paths = [f.path for f in model.index.files]
    fds: list[int] = []
    try:
        for p in paths:
            fds.append(open_readable(p))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    description = json.dumps({"kind": _KIND, "paths": paths}).encode()
    return ModelShare(description, fds)


class _GivenFiles:
    """An opener over the descriptors a server passed: the paths it named, nothing else."""

    def __init__(self, fds: Mapping[str, int]) -> None:
        self._fds = dict(fds)

    def open(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:
            raise LoadError(path, None, "not a file the server shared")
        return os.dup(fd)


def open_shared_model(description: bytes, fds: Sequence[int]) -> Model:
    """The model ``description`` describes, over ``fds`` (taken: closed here). Blocking;
    runs its own event loop, so call it from a thread that runs none."""
    try:
        try:
            info: Any = json.loads(description)
        except ValueError as exc:
            raise LoadError(None, None, "a shared model's description is not JSON") from exc
        if not isinstance(info, dict) or info.get("kind") != _KIND:
            raise LoadError(None, None, "a shared model of a kind this client cannot open")
        paths = info.get("paths")
        if (
            not isinstance(paths, list)
            or not paths
            or len(paths) != len(fds)
            or not all(isinstance(p, str) for p in paths)
        ):
            raise LoadError(None, None, "a shared model's description does not match its files")
        opener = _GivenFiles(dict(zip(paths, fds, strict=True)))
        # The server checked the tensors as it loaded them.
        handle = load(paths[0], opener=opener, mode="mmap", n_gpu_layers=0, check_tensors=False)

        async def enter() -> Model:
            return await handle.__aenter__()

        model: Model = run(enter, name="attach")
        return model
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
