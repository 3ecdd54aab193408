"""A load server's ``POST /models`` request, read and checked (``parse_request``): its
body, the client's config on top of the server's, its files opened beneath the roots
(or, for a remote name the server allows, by ``aiogguf.server._remote``) while the
descriptors they need are there, its devices and its share of the budget."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
from aiohttp import web

from aiogguf._config import Config
from aiogguf._devices import enumerate_devices
from aiogguf._units import parse_duration
from aiogguf.errors import ConfigError, GGUFError, LoadError, PathNotAllowedError
from aiogguf.io._devices.base import Device
from aiogguf.io.workers import LoadThreads
from aiogguf.remote._http_source import is_url, redact_url
from aiogguf.remote._hub import is_hub_name, parse_hub_name
from aiogguf.remote._sources import is_remote
from aiogguf.server._policy import (
    PreOpened,
    RequestRefused,
    ServerPolicy,
    exception_line,
    request_config,
)
from aiogguf.server._remote import RemoteFiles, remote_file_count
from aiogguf.stages.parse import split_count_from_name, split_paths

if TYPE_CHECKING:
    from aiogguf.server._app import LoaderRegistry

__all__ = ["BODY_KEYS", "LoadRequest", "parse_request", "prepare_body"]

# The keys of a ``POST /models`` body, and of a ``[[server.preload]]`` table.
BODY_KEYS = ("path", "config", "keep_alive", "pin")


@dataclass(frozen=True, slots=True)
class LoadRequest:
    """A validated ``POST /models`` body: what to load and what it may use."""

    path: str
    config: Config
    devices: tuple[Device, ...]
    readers: int
    staging_bytes: int
    # Every file of the load, opened (beneath the roots, or remote) at the request.
    opener: PreOpened | RemoteFiles
    nbytes: int  # file bytes the model will hold: every shard's real size
    # How long the model stays once idle (seconds, ``math.inf`` forever); None: as the
    # server's ``keep_alive`` says.
    keep_alive_s: float | None = None
    pin: bool | None = None  # never evicted; None: not said (False for a new load)
    # The local files' identities (``PreOpened.file_ids``): two requests share a model
    # only if they name the very same files.
    file_ids: tuple[tuple[int, int, int, int], ...] = ()


async def parse_request(request: web.Request, registry: LoaderRegistry) -> LoadRequest:
    """A ``POST /models`` request read, checked and prepared: its files opened beneath
    the roots, its devices found. Raises ``RequestRefused`` with the status to answer."""
    try:
        # A body trickled in byte by byte must not hold the request (and its connection)
        # for ever.
        with anyio.fail_after(registry.policy.request_timeout_s):
            raw = await request.read()
    except TimeoutError as exc:
        raise RequestRefused(
            f"request body not received within {registry.policy.request_timeout_s:g} s",
            status=408,
        ) from exc
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestRefused(f"request body is not valid JSON: {exception_line(exc)}") from exc
    except RecursionError as exc:
        raise RequestRefused("request body is not valid JSON: nested too deeply") from exc
    if not isinstance(body, dict):
        raise RequestRefused('expected a JSON object like {"path": "model.gguf"}')
    return await prepare_body(body, registry)


async def prepare_body(body: Mapping[str, Any], registry: LoaderRegistry) -> LoadRequest:
    """A ``POST /models`` body (or a ``[[server.preload]]`` table) checked and prepared:
    its files opened beneath the roots, its devices found. Raises ``RequestRefused``."""
    unknown = sorted(set(body) - set(BODY_KEYS))
    if unknown:
        raise RequestRefused(
            f"unknown field {unknown[0]!r}; expected {', '.join(map(repr, BODY_KEYS))}"
        )
    keep_alive_s = None
    if body.get("keep_alive") is not None:
        try:
            keep_alive_s = parse_duration(body["keep_alive"])
        except ValueError as exc:
            raise RequestRefused(f"'keep_alive': {exc}") from exc
    pin = body.get("pin")
    if pin is not None and not isinstance(pin, bool):
        raise RequestRefused("'pin' must be true or false")
    path = body.get("path")
    if not isinstance(path, str) or not path:
        raise RequestRefused("'path' is required: the GGUF file to load, as a string")
    overrides = body.get("config") or {}
    if not isinstance(overrides, dict):
        raise RequestRefused('\'config\' must be an object of config keys, like {"mode": "none"}')
    # Compiling a client's override patterns, opening the file and finding the devices
    # are blocking work: on a thread of the request's own, not on the loop.
    with _remote_slot(registry, path):
        async with LoadThreads(1, name="aiogguf-request") as threads:
            prepared = await _prepare_request(registry, path, overrides, threads)
    return dataclasses.replace(prepared, keep_alive_s=keep_alive_s, pin=pin)


@contextlib.contextmanager
def _remote_slot(registry: LoaderRegistry, path: str) -> Iterator[None]:
    """For a remote ``path``, one of the ``policy.max_remote_admissions`` requests that
    may be opening remote files at once (each holds a thread while it waits on another
    server, which may be slow on purpose): ``RequestRefused`` (503) when none is free,
    before the request takes a thread."""
    if not is_remote(path):
        yield
        return
    cap = registry.policy.max_remote_admissions
    if registry.remote_admissions >= cap:
        raise RequestRefused(
            f"this server is opening {cap} remote models already, its limit "
            "(max_remote_admissions); try again later",
            status=503,
        )
    registry.remote_admissions += 1
    try:
        yield
    finally:
        registry.remote_admissions -= 1


# Descriptors one load may hold at once, beyond those of the request's own files: a
# duplicate of each file in the load, a reopened one for O_DIRECT, and a few of its own.
_FDS_PER_FILE = 3
_FDS_PER_LOAD = 8


def _load_paths(path: str, policy: ServerPolicy) -> list[str]:
    """The files a load of ``path`` opens: every shard of a split set named as its first
    (``m-00001-of-00003.gguf``), else the one file. Raises ``RequestRefused`` (400) for a
    set of more than ``policy.max_shards`` shards, before any is opened."""
    count = split_count_from_name(path)
    if count > policy.max_shards:
        raise RequestRefused(
            f"{path}: a split set of {count} shards; this server loads at most {policy.max_shards}"
        )
    if count > 1 and path.endswith(f"-00001-of-{count:05d}.gguf"):
        return split_paths(path, 0, count)
    # A later shard's name: the load reads this file's header, and fails there if it is
    # one split of several.
    return [path]


def _open_files(registry: LoaderRegistry, paths: list[str]) -> PreOpened:
    """Open ``paths`` beneath the roots (blocking: on the request's thread), if the
    descriptors they need leave the reserve for serving whole; ``RequestRefused`` (403,
    400, or 503 when descriptors run short)."""
    need = len(paths) * _FDS_PER_FILE + _FDS_PER_LOAD
    with registry.admission_lock:
        room = registry.descriptor_budget().room(registry.connection_count())
        if room is not None and need > room:
            raise RequestRefused(
                f"this server is short of file descriptors: the load needs about {need}, "
                f"{max(room, 0)} are free beyond those kept for serving; unload a model or "
                "try again later",
                status=503,
            )
        try:
            return PreOpened(registry.opener, paths)
        except PathNotAllowedError as exc:
            # Said the same way whether or not the file exists: nothing leaks from outside.
            raise RequestRefused(str(exc), status=403) from exc
        except LoadError as exc:
            cause = exc.__cause__
            if isinstance(cause, OSError) and cause.errno in (errno.EMFILE, errno.ENFILE):
                raise RequestRefused(
                    "this server is out of file descriptors; try again later", status=503
                ) from exc
            raise RequestRefused(exception_line(exc)) from exc


def _remote_files(registry: LoaderRegistry, path: str, config: Config) -> RemoteFiles:
    """A remote load's files, not opened yet, if the server allows the name.
    ``RequestRefused``: 403 for a name the server does not allow, 400 for a bad name or
    a split set of more shards than it loads (before the descriptors so many would take
    are counted)."""
    access = registry.policy.remote
    reason = access.refusal(path)
    if reason is not None:
        raise RequestRefused(f"{_shown(path)}: {reason}", status=403)
    try:
        if is_hub_name(path):
            parse_hub_name(path)
        return RemoteFiles(access, path, config, registry.policy.max_shards)
    except GGUFError as exc:  # a bad hub name, a split set too big
        raise RequestRefused(exception_line(exc)) from exc


def _open_remote(registry: LoaderRegistry, files: RemoteFiles, config: Config) -> None:
    """Open a remote load's files (blocking: on the request's thread), if the descriptors
    their connections need leave the reserve for serving whole: each file's first
    request learns its size. ``RequestRefused``: 403 for an address the server does not
    allow, 503 short of descriptors, 502 when the remote server fails, 400 for names
    that cannot be made."""
    # A reader thread keeps a connection to each file it has read from.
    need = config.pipeline.remote_in_flight * remote_file_count(files.path) + _FDS_PER_LOAD
    with registry.admission_lock:
        room = registry.descriptor_budget().room(registry.connection_count())
    if room is not None and need > room:
        raise RequestRefused(
            f"this server is short of file descriptors: the load needs about {need}, "
            f"{max(room, 0)} are free beyond those kept for serving; try again later",
            status=503,
        )
    try:
        files.open_all()
    except PathNotAllowedError as exc:
        raise RequestRefused(exception_line(exc), status=403) from exc
    except LoadError as exc:
        # The remote side failed: refused, unknown to it, not ranged, the hub unreachable.
        raise RequestRefused(exception_line(exc), status=502) from exc
    except GGUFError as exc:  # a split set whose names cannot be made
        raise RequestRefused(exception_line(exc)) from exc


async def _admit_remote(
    registry: LoaderRegistry, path: str, config: Config, threads: LoadThreads
) -> RemoteFiles:
    """A remote load's files, opened on ``threads``. Cancelled (its client went away),
    the files are closed from here, which ends the request under way at once."""
    files = _remote_files(registry, path, config)
    try:
        await threads.run_sync(_open_remote, registry, files, config, on_cancel=files.close)
    except BaseException:
        files.close()
        raise
    return files


def _shown(path: str) -> str:
    return redact_url(path) if is_url(path) else path


async def _prepare_request(
    registry: LoaderRegistry, path: str, overrides: dict[str, Any], threads: LoadThreads
) -> LoadRequest:
    limiter = registry.limiter
    config = await threads.run_sync(request_config, registry.config, overrides, registry.policy)
    if config.pipeline.reader_count() > limiter.max_readers:
        config = config.with_settings({"readers": limiter.max_readers})
    opener: PreOpened | RemoteFiles
    # The local files' identities (``PreOpened.file_ids``): two requests share a model
    # only if they name the very same files.
    file_ids: tuple[tuple[int, int, int, int], ...] = ()
    if is_remote(path):
        # Its reader threads are the server's readers too.
        if config.pipeline.remote_in_flight > limiter.max_readers:
            config = config.with_settings({"remote_in_flight": limiter.max_readers})
        opener = await _admit_remote(registry, path, config, threads)
        splits = opener.files
        per_file = config.pipeline.remote_in_flight
    else:
        # A relative path is the server's directory's; ``~`` is not expanded.
        paths = _load_paths(path, registry.policy)
        # Every file is opened here, once, under the roots: the load reads these
        # descriptors, and the bytes held are counted from their real sizes.
        opener = await threads.run_sync(_open_files, registry, paths)
        file_ids = opener.file_ids
        splits = len(paths)
        per_file = config.pipeline.readers_for(path)
    try:
        try:
            devices = await threads.run_sync(enumerate_devices, config)
        except ConfigError as exc:
            raise RequestRefused(exception_line(exc)) from exc
        readers = per_file * splits
        gpus = sum(1 for d in devices if d.kind != "cpu")
        staging = 0
        if gpus and config.placement.n_gpu_layers != 0:
            staging = gpus * config.pipeline.staging_pool_bytes(readers)
        return LoadRequest(
            path,
            config,
            devices,
            readers,
            staging,
            opener,
            opener.size_bytes,
            file_ids=file_ids,
        )
    except BaseException:
        opener.close()
        raise
