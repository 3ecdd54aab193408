"""The public entry points: ``load`` (async) and ``load_sync`` (scripts)."""

from __future__ import annotations

import gc
import os
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import AsyncExitStack, contextmanager
from types import TracebackType
from typing import Any

import anyio

from aiogguf.config import Config, load_config
from aiogguf.engine import one_error, run_load
from aiogguf.events import Progress, ProgressCallback, ProgressHub, Stage
from aiogguf.io.devices.base import Device
from aiogguf.io.opener import FileOpener
from aiogguf.model import Model

__all__ = ["LoadHandle", "load", "load_sync"]


class LoadHandle:
    """``async with load(...) as model``: loads on enter, frees everything on exit.

    Progress: pass ``progress=callback``, or iterate ``handle.events()`` in another task
    while the ``async with`` runs.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        config: Config,
        progress: ProgressCallback | None = None,
        devices: Sequence[Device] | None = None,
        limiter: anyio.CapacityLimiter | None = None,
        opener: FileOpener | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self._limiter = limiter
        self._opener = opener
        self.config = config
        self.hub = ProgressHub(progress)
        self._devices = devices
        self.model: Model | None = None

    def events(self) -> AsyncIterator[Progress]:
        """This load's progress events; the iteration ends after the final one."""
        return self.hub.events()

    async def __aenter__(self) -> Model:
        with one_error():
            return await self._load()

    async def _load(self) -> Model:
        stack = AsyncExitStack()
        try:
            model = await run_load(
                self.path,
                self.config,
                self.hub,
                stack,
                devices=self._devices,
                limiter=self._limiter,
                opener=self._opener,
            )
        except BaseException as exc:
            # Release what the load holds even while being cancelled; the stack is told
            # why, so that the uploader frees its buffers rather than handing them over.
            with anyio.CancelScope(shield=True):
                await stack.__aexit__(type(exc), exc, exc.__traceback__)
            # Frames of cancelled tasks sit in reference cycles with their tracebacks and
            # can hold views of closed mappings and buffers, which are freed only when
            # the last view goes: collect them now, so a failed load leaves nothing behind.
            gc.collect()
            if isinstance(exc, anyio.get_cancelled_exc_class()):
                self.hub.end(Stage.CANCELLED, "cancelled")
            else:
                self.hub.end(Stage.FAILED, str(exc) or type(exc).__name__)
            raise
        with anyio.CancelScope(shield=True):
            await stack.aclose()  # files and staging rings; the model owns its buffers
        self.model = model
        return model

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.model is not None:
            # Unmapping and freeing many GiB takes a while: not on the loop's thread.
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self.model.close)


def load(
    path: str | os.PathLike[str],
    config: Config | str | os.PathLike[str] | None = None,
    *,
    progress: ProgressCallback | None = None,
    devices: Sequence[Device] | None = None,
    limiter: anyio.CapacityLimiter | None = None,
    opener: FileOpener | None = None,
    **overrides: Any,
) -> LoadHandle:
    """Load a GGUF model: ``async with aiogguf.load("m.gguf", mode="direct") as model``.

    ``config`` is a ``Config``, a TOML path or None (defaults); ``overrides`` are config
    keys by their plain names (``mode``, ``check_tensors``, ``n_gpu_layers``,
    ``chunk_size="16MiB"``, ``sim_gpus=["24GiB"]``, …). ``devices`` replaces device
    discovery (tests, embedding). ``limiter``, shared between loads, bounds their reads
    in flight together (a server loading several models at once). ``opener`` opens each
    file of the load, once, and every read goes through that descriptor: pass
    ``aiogguf.io.opener.RootedOpener(roots)`` to read only beneath ``roots`` (default:
    any path the process can read).

    Raises ``GGUFFormatError``/``SplitError`` for bad files, ``PlacementError``,
    ``ConfigError``, ``LoadError`` for I/O failures (``PathNotAllowedError`` for a file
    the ``opener`` refuses), ``TensorValidationError`` listing
    every bad tensor when ``check_tensors`` is on.
    """
    return LoadHandle(path, load_config(config, **overrides), progress, devices, limiter, opener)


@contextmanager
def load_sync(
    path: str | os.PathLike[str],
    config: Config | str | os.PathLike[str] | None = None,
    *,
    progress: ProgressCallback | None = None,
    devices: Sequence[Device] | None = None,
    **overrides: Any,
) -> Iterator[Model]:
    """``with aiogguf.load_sync(path) as model``: the same load, for code without a loop.
    Runs its own event loop (uvloop when installed); takes the same arguments as ``load``."""
    handle = load(path, config, progress=progress, devices=devices, **overrides)

    async def enter() -> Model:
        return await handle.__aenter__()

    model = run(enter)
    try:
        yield model
    finally:
        model.close()


def run(fn: Any, *args: Any) -> Any:
    """Run ``fn(*args)`` in a fresh event loop, on uvloop when it is installed."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return anyio.run(fn, *args)
    return anyio.run(fn, *args, backend_options={"use_uvloop": True})
