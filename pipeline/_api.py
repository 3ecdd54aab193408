"""The public entry points: ``load`` (async) and ``load_sync`` (scripts); ``warm_up``
before serving, ``release_device_memory`` after."""

from __future__ import annotations

import functools
import gc
import importlib
import os
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import AsyncExitStack, contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, NoReturn

import anyio

# anyio imports its asyncio backend on its first call inside a running loop: on the loop's
# thread, where it stalls every task of the loop for tens of milliseconds (figures in
# docs/performance.md). Importing it with the loader moves that to ``import aiogguf``.
# (A trio loop would import its own backend the first time.)
import anyio._backends._asyncio
import numpy as np

from aiogguf._checks import PieceCheck
from aiogguf._config import Config, LoadMode, load_config
from aiogguf._core.engine import load_thread_count, one_error, run_load
from aiogguf._core.layout import Planner
from aiogguf._core.ready import ReadyTensors, TensorStream
from aiogguf._devices import enumerate_devices
from aiogguf._events import Progress, ProgressCallback, ProgressHub, Stage
from aiogguf._model import Model
from aiogguf._run import run
from aiogguf.errors import LoadError
from aiogguf.io._devices.base import Device, UploadTarget
from aiogguf.io._devices.pool import close_staging_pools, staging_pool
from aiogguf.io.buffers import memory_held_by_views
from aiogguf.io.ggml_types import GGML_TYPES
from aiogguf.io.opener import FileOpener
from aiogguf.io.workers import LoadThreads
from aiogguf.stages.read import most_readers

if TYPE_CHECKING:
    from aiogguf._core.rehearsal import RehearsalFile

__all__ = [
    "LoadHandle",
    "WarmUp",
    "load",
    "load_sync",
    "open_model",
    "release_device_memory",
    "release_device_memory_sync",
    "release_staging",
    "release_staging_sync",
    "warm_up",
    "warm_up_sync",
]


class LoadHandle:
    """``async with load(...) as model``: loads on enter, frees everything on exit.

    Progress: pass ``progress=callback``, or iterate ``handle.events()`` in another task
    while the ``async with`` runs.
    Tensors as they are ready: ``handle.tensors_as_ready()``.
    ``planner`` makes the load's plan from its index, devices and config (default
    ``make_plan``); a plan may place only part of the model, whose other tensors are then
    neither allocated nor read (a cluster node's part, ``aiogguf.cluster``).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        config: Config,
        progress: ProgressCallback | None = None,
        devices: Sequence[Device] | None = None,
        opener: FileOpener | None = None,
        planner: Planner | None = None,
    ) -> None:
        self.path: str = os.fspath(path)
        self._planner = planner
        self._opener = opener
        self.config = config
        self.hub: ProgressHub = ProgressHub(progress)
        self._devices = devices
        self.model: Model | None = None
        self._ready = ReadyTensors()
        self._started = False

    def events(self) -> AsyncIterator[Progress]:
        """This load's progress events; the iteration ends after the final one."""
        return self.hub.events()

    def tensors_as_ready(self) -> TensorStream:
        """``(name, array)`` for each tensor once it has landed and passed its checks,
        while the load goes on, in the order they become ready (not the index's):
        ``async with handle.tensors_as_ready() as tensors: async for name, array in
        tensors: ...`` runs the load while the block consumes; leaving the block ends it
        (a load still running is cancelled, the model closed). ``tensors.torch()``
        gives ``torch.Tensor``s instead. Each tensor comes once; a bad one never, and the
        iteration then raises the load's error (``TensorValidationError`` naming every
        bad tensor). Arrays are views of the model's buffers, as ``Model.tensors`` gives
        them. Iterated without ``async with``, it reads a load another task runs (``async
        with handle as model``), as ``events()`` does. docs/python.md has the details."""
        self._ready.wanted = True
        return TensorStream(self._ready, self._claim, self._enter, self._leave)

    def _claim(self) -> None:
        if self._started:
            raise RuntimeError("a LoadHandle loads once: call aiogguf.load(...) again")
        self._started = True

    async def _leave(self) -> None:
        await self.__aexit__(None, None, None)

    async def __aenter__(self) -> Model:
        self._claim()
        return await self._enter()

    async def _enter(self) -> Model:
        try:
            with one_error():
                return await self._load()
        except BaseException as exc:
            if isinstance(exc, anyio.get_cancelled_exc_class()):
                # Not the cancellation itself: an iteration in another task is not
                # cancelled, its load is.
                self._ready.fail(LoadError(self.path, None, "the load was cancelled"))
            else:
                self._ready.fail(exc)
            raise

    def __await__(self) -> NoReturn:
        # ``await aiogguf.load(...)`` would otherwise be Python's bare "object LoadHandle
        # can't be used in 'await' expression", which names neither way that works.
        raise TypeError(
            "aiogguf.load(...) is not awaited: use `async with aiogguf.load(...) as model`, "
            "or `model = await aiogguf.open_model(...)` (then `await model.aclose()`) for a "
            "model that outlives a block"
        )

    async def _load(self) -> Model:
        stack = AsyncExitStack()
        try:
            model = await run_load(
                self.path,
                self.config,
                self.hub,
                stack,
                devices=self._devices,
                opener=self._opener,
                ready=self._ready,
                planner=self._planner,
            )
        except BaseException as exc:
            # Release what the load holds even while being cancelled; the stack is told
            # why, so that the uploader frees its buffers rather than handing them over.
            with anyio.CancelScope(shield=True):
                await stack.__aexit__(type(exc), exc, exc.__traceback__)
            # Frames of cancelled tasks sit in reference cycles with their tracebacks and
            # can hold views of closed mappings and buffers, which are freed only when
            # the last view goes: collect them now, so a failed load leaves nothing behind.
            if memory_held_by_views():
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
            await self.model.aclose()


def load(
    path: str | os.PathLike[str],
    config: Config | str | os.PathLike[str] | None = None,
    *,
    progress: ProgressCallback | None = None,
    devices: Sequence[Device] | None = None,
    opener: FileOpener | None = None,
    **overrides: Any,
) -> LoadHandle:
    """Load a GGUF model: ``async with aiogguf.load("m.gguf", mode="direct") as model``.

    ``config`` is a ``Config``, a TOML path or None (defaults); ``overrides`` are config
    keys by their plain names (``mode``, ``check_tensors``, ``n_gpu_layers``,
    ``chunk_size="16MiB"``, ``sim_gpus=["24GiB"]``, …). ``devices`` replaces device
    discovery (tests, embedding). ``opener`` opens each
    file of the load, once, and every read goes through that descriptor: pass
    ``aiogguf.RootedOpener(roots)`` to read only beneath ``roots`` (default:
    any path the process can read).

    Raises ``GGUFFormatError``/``SplitError`` for bad files, ``PlacementError``,
    ``ConfigError``, ``LoadError`` for I/O failures (``PathNotAllowedError`` for a file
    the ``opener`` refuses), ``TensorValidationError`` listing
    every bad tensor when ``check_tensors`` is on. ``manifest=PATH`` (or ``"auto"``:
    ``MODEL.gguf.manifest.json`` beside the model, if any) checks every byte against a
    hash manifest as it lands: ``ManifestMismatchError`` for one of another model,
    ``IntegrityError`` (a ``TensorValidationError``) naming every tensor that differs.
    ``path`` may be a URL or ``hf://OWNER/REPO/FILE.gguf[@REVISION]``: the latter is
    checked against the hub's sha256 (``IntegrityError``) and read from, or written to,
    the hub's cache unless ``cache=False`` (docs/remote.md).
    """
    return LoadHandle(path, load_config(config, **overrides), progress, devices, opener)


async def open_model(
    path: str | os.PathLike[str],
    config: Config | str | os.PathLike[str] | None = None,
    *,
    progress: ProgressCallback | None = None,
    devices: Sequence[Device] | None = None,
    opener: FileOpener | None = None,
    **overrides: Any,
) -> Model:
    """Load a model that outlives any block: ``model = await aiogguf.open_model(path)``,
    and ``await model.aclose()`` when done (a server's registry of models). Takes what
    ``load`` takes and raises what it raises. A model collected while still open is
    said with a ``ResourceWarning``: its memory is freed then, on whatever thread the
    collector runs."""
    handle = load(path, config, progress=progress, devices=devices, opener=opener, **overrides)
    return await handle.__aenter__()


@contextmanager
def load_sync(
    path: str | os.PathLike[str],
    config: Config | str | os.PathLike[str] | None = None,
    *,
    progress: ProgressCallback | None = None,
    devices: Sequence[Device] | None = None,
    opener: FileOpener | None = None,
    **overrides: Any,
) -> Iterator[Model]:
    """``with aiogguf.load_sync(path) as model``: the same load, for code without a loop.
    Runs its own event loop (uvloop when installed); takes the same arguments as ``load``
    and raises what it raises."""
    handle = load(path, config, progress=progress, devices=devices, opener=opener, **overrides)

    async def enter() -> Model:
        return await handle.__aenter__()

    model = run(enter, name="load_sync")
    try:
        yield model
    finally:
        model.close()


@dataclass(frozen=True, slots=True)
class WarmUp:
    """What ``warm_up`` prepared: the devices that take uploads, the bytes of staging
    slots it pinned (0 when the pools already held them), and how long it took."""

    devices: tuple[str, ...]
    pinned_bytes: int
    seconds: float


async def warm_up(
    config: Config | str | os.PathLike[str] | None = None,
    *,
    devices: Sequence[Device] | None = None,
    **overrides: Any,
) -> WarmUp:
    """Prepare this process for loads with ``config`` (as ``load`` takes it), so that the
    first real load pays none of it: find the devices (CuPy's import and CUDA's start-up
    on a GPU machine), fill each device's staging pool with the slots such a load uses,
    run the checks once, start the threads such a load uses, and rehearse: load a model of
    40 KiB, built in memory, through the same stages and devices (``rehearsal``), so that
    the first real load runs on warm code. Last, once per process, it runs a full
    collection of the cyclic garbage collector: the objects the imports made are owed
    one, and unpaid it falls, with the GIL held for tens of milliseconds, into one of the
    first loads. Everything runs on the load threads; call it before serving (``aiogguf
    serve`` does), since part of CUDA's start-up and the collection hold the GIL.

    Raises ``ConfigError`` for a bad configuration, ``PlacementError`` for placement
    rules no model can follow, and ``LoadError`` when a device cannot pin memory.
    """
    began = time.perf_counter()
    resolved = load_config(config, **overrides)
    # As many threads as such a load takes, running: left, they wait in the pool, where
    # the rehearsal takes them.
    async with LoadThreads(load_thread_count(resolved), name="aiogguf-warm-up") as threads:
        await threads.all_running()
        targets, pinned = await threads.run_sync(_prepare_devices, resolved, devices)
        rehearsal = await threads.run_sync(_open_rehearsal)
    try:
        if rehearsal is not None:
            await _rehearse(resolved, devices, rehearsal)
    finally:
        if rehearsal is not None:
            async with LoadThreads(1, name="aiogguf-warm-up") as threads:
                await threads.run_sync(rehearsal.close)
    if not _collected:
        async with LoadThreads(1, name="aiogguf-warm-up") as threads:
            await threads.run_sync(_pay_collector_debt)
    return WarmUp(targets, pinned, time.perf_counter() - began)


def warm_up_sync(
    config: Config | str | os.PathLike[str] | None = None,
    *,
    devices: Sequence[Device] | None = None,
    **overrides: Any,
) -> WarmUp:
    """``warm_up`` for code without a loop (blocking; runs an event loop of its own)."""
    result: WarmUp = run(
        functools.partial(warm_up, config, devices=devices, **overrides), name="warm_up_sync"
    )
    return result


def _prepare_devices(
    config: Config, devices: Sequence[Device] | None
) -> tuple[tuple[str, ...], int]:
    """Blocking: the devices that take uploads, their staging pools filled, and the
    checks run once; returns the devices' names and the bytes pinned."""
    found = tuple(devices) if devices is not None else enumerate_devices(config)
    _import_wings(config)
    pipeline = config.pipeline
    threads = most_readers(config)
    pinned = 0
    targets = [d for d in found if isinstance(d, UploadTarget)]
    for target in targets:
        pool = staging_pool(target)
        lease = pool.lease(
            pipeline.staging_slots(threads),
            pipeline.staging_bytes(),
            pipeline.alignment,
            cap_bytes=pipeline.staging_pool_size,
            wait=False,
        )
        pinned += lease.pinned_bytes
        pool.give_back(lease)
    if config.load.check_tensors:
        # The first check of each type sets up numpy's paths for it.
        zeros = np.zeros(4096, dtype=np.uint8)
        for ggml_type in GGML_TYPES.values():
            if ggml_type.valid and ggml_type.block_bytes <= zeros.size:
                n = zeros.size - zeros.size % ggml_type.block_bytes
                PieceCheck("warm-up", ggml_type, n).finish(zeros[:n])
    return tuple(t.name for t in targets), pinned


def _import_wings(config: Config) -> None:
    """Blocking: the wings loads of ``config`` will use, imported now rather than by the
    first such load's thread: a manifest's checks, and the remote sources a server lets
    its clients name (a load imports them through ``aiogguf._core.assemble``)."""
    if config.load.manifest is not None:
        importlib.import_module("aiogguf.integrity._sink")
    server = config.server
    if server.allow_remote or server.allow_url_prefixes:
        importlib.import_module("aiogguf.remote._sources")


_collected = False


def _pay_collector_debt() -> None:
    """Blocking, once per process: a full collection, which the garbage collector owes
    every object made since the last one (``import aiogguf`` alone makes tens of
    thousands). A load frees what it makes, so after this one no load triggers a full
    pass; before it, the collector's next full pass came during a load."""
    global _collected
    _collected = True
    gc.collect()


def _open_rehearsal() -> RehearsalFile | None:
    """Blocking: the rehearsal model in memory; None where the system makes no anonymous
    files (no ``memfd_create``, or a sandbox refuses it): ``warm_up`` then does without a
    rehearsal, which only saves time."""
    if not hasattr(os, "memfd_create"):
        return None
    # Imported here, on a thread of ``warm_up``'s, not with the loader: only a server,
    # or a process that warms up, rehearses.
    from aiogguf._core.rehearsal import RehearsalFile

    try:
        return RehearsalFile()
    except OSError:
        return None


async def _rehearse(
    config: Config, devices: Sequence[Device] | None, rehearsal: RehearsalFile
) -> None:
    """Load the rehearsal model as ``config`` loads a model, and free it. An anonymous
    file takes no ``O_DIRECT``: mode ``direct`` rehearses with ``none``, its buffered
    path (the direct path reads whole aligned chunks into the same memory)."""
    if config.load.mode is LoadMode.DIRECT:
        config = config.with_overrides(mode="none")
    async with LoadHandle(rehearsal.name, config, devices=devices, opener=rehearsal):
        pass


async def release_device_memory() -> None:
    """Give back what loads keep for the next one, on a thread of its own: every
    device's idle device memory (the arena that closed models returned their buffers
    to, freed with ``cudaFree``), its pool of pinned staging slots, and the freed memory
    a simulated device keeps. Call it when no load runs and the process will load no
    more for a while (or another user of the GPU needs the memory); a later load
    allocates and pins again. Memory of a model still open is freed when it is closed.

    Raises ``LoadError`` when the device fails to free memory."""
    async with LoadThreads(1, name="aiogguf-release") as threads:
        await threads.run_sync(close_staging_pools)


def release_device_memory_sync() -> None:
    """``release_device_memory`` for code without a loop (blocking)."""
    close_staging_pools()


# The older names, kept: they free the same (staging slots and device memory).
release_staging = release_device_memory
release_staging_sync = release_device_memory_sync
