"""Dry runs: ``inspect`` a model's headers, ``plan`` where its tensors would go.

Neither reads tensor data nor allocates a buffer: the headers are parsed and indexed as a
load parses them (design §1.1, §1.2), and the plan is the one a load of the same config
would follow (design §1.3). Of a URL or an ``hf://`` name, only the first request's
megabyte is read (more only for a larger header), and each later split's. Every blocking
step (reading a TOML config, finding the devices, opening and parsing the files,
planning, closing the files) runs on a thread the call borrows from the process's pool;
the loop's thread only awaits. The ``_sync`` twins run an event loop of their own, for
code without one (the CLI).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import anyio

from aiogguf._addresses import is_remote
from aiogguf._config import Config, load_config
from aiogguf._core.assemble import open_index
from aiogguf._devices import enumerate_devices
from aiogguf._records import Plan, WeightIndex
from aiogguf._run import run
from aiogguf.io._devices.base import Device
from aiogguf.io.opener import FileOpener, OpenFiles
from aiogguf.io.workers import LoadThreads
from aiogguf.stages.plan import make_plan

if TYPE_CHECKING:
    from aiogguf.remote._sources import RemoteModel

__all__ = ["inspect", "inspect_sync", "plan", "plan_sync"]


async def inspect(path: str | os.PathLike[str], *, opener: FileOpener | None = None) -> WeightIndex:
    """Parse and index a model's headers: ``index = await aiogguf.inspect("m.gguf")``.

    ``path``: a single-file model or the first split of a split set (every split is
    parsed); a URL or an ``hf://`` name as ``load`` takes it, of which only the headers'
    ranges are read (about a megabyte; the hub's cache, when it has the file).
    ``opener`` opens each file, as for ``load`` (default: any path the process can
    read). Returns the ``WeightIndex``: the files with their metadata, every tensor
    in llama.cpp's layer order with its absolute offset, and the totals.

    Raises ``GGUFFormatError`` for a malformed or truncated file, ``SplitError`` for an
    incomplete or mixed split set, ``PathNotAllowedError`` for a file the ``opener``
    refuses, ``LoadError`` for a file that cannot be read.
    """
    async with LoadThreads(1, name="aiogguf-inspect") as threads:
        index, _ = await _index(path, threads, opener, Config())
        return index


async def plan(
    path: str | os.PathLike[str],
    config: Config | str | os.PathLike[str] | None = None,
    *,
    devices: Sequence[Device] | None = None,
    opener: FileOpener | None = None,
    **overrides: Any,
) -> Plan:
    """Where a load would put every tensor, without loading: ``await aiogguf.plan("m.gguf",
    n_gpu_layers=30, sim_gpus=["24GiB"])``.

    ``path``, ``config``, ``devices``, ``opener`` and the overrides are those of ``load``
    (of a remote ``path``, only the headers' ranges are read, as ``inspect`` reads them)
    (placement keys such as ``n_gpu_layers``, ``split_mode``, ``main_gpu``,
    ``tensor_split``, ``override``, and ``mode``). Returns the ``Plan``: the devices and
    their memory, the device of each layer, the buffer type of each tensor, the buffers
    with their coalesced file ranges, the resolved mode and the warnings (such as too
    little memory).

    Raises ``ConfigError`` for a bad configuration, ``PlacementError`` for placement
    rules the model cannot follow, and what ``inspect`` raises for the files.
    """
    async with LoadThreads(1, name="aiogguf-plan") as threads:
        resolved = await threads.run_sync(functools.partial(load_config, config, **overrides))
        found = (
            tuple(devices)
            if devices is not None
            else await threads.run_sync(enumerate_devices, resolved)
        )
        index, resolved = await _index(path, threads, opener, resolved)
        return await threads.run_sync(make_plan, index, found, resolved)


def inspect_sync(path: str | os.PathLike[str], *, opener: FileOpener | None = None) -> WeightIndex:
    """``inspect`` for code without a loop (blocking; runs an event loop of its own)."""
    result: WeightIndex = run(functools.partial(inspect, path, opener=opener), name="inspect_sync")
    return result


def plan_sync(
    path: str | os.PathLike[str],
    config: Config | str | os.PathLike[str] | None = None,
    *,
    devices: Sequence[Device] | None = None,
    opener: FileOpener | None = None,
    **overrides: Any,
) -> Plan:
    """``plan`` for code without a loop (blocking; runs an event loop of its own)."""
    result: Plan = run(
        functools.partial(plan, path, config, devices=devices, opener=opener, **overrides),
        name="plan_sync",
    )
    return result


async def _index(
    path: str | os.PathLike[str], threads: LoadThreads, opener: FileOpener | None, config: Config
) -> tuple[WeightIndex, Config]:
    """The model's index, its files opened through ``opener`` and closed on a thread,
    and ``config`` as a load of ``path`` would resolve it. A remote name is read as a
    load reads it (``open_remote_model``), but only its headers' ranges; an ``hf://``
    name the hub's cache holds is read from there."""
    fspath = os.fspath(path)
    if is_remote(fspath):
        remote = await threads.run_sync(_open_remote, fspath, config, opener)
        try:
            if remote.index is not None:
                return remote.index, remote.config
        finally:
            # Closing sockets (and a hub file's cache records) is not the loop's work,
            # and is done even while the caller is being cancelled.
            with anyio.CancelScope(shield=True):
                await threads.run_sync(remote.close)
        assert remote.local is not None
        path = remote.local
    files = OpenFiles(opener)
    try:
        return await open_index(path, threads=threads, files=files), config
    finally:
        # Closing descriptors is a system call per file: not on the loop's thread, and
        # done even while the caller is being cancelled.
        with anyio.CancelScope(shield=True):
            await threads.run_sync(files.close)


def _open_remote(path: str, config: Config, opener: FileOpener | None) -> RemoteModel:
    """Blocking: ``open_remote_model``, its wing imported by the calling thread (a look
    at a local model never imports it)."""
    from aiogguf.remote._sources import open_remote_model

    return open_remote_model(path, config, opener)
