"""An HTTP load server: start, follow, cancel and unload model loads while serving.

Mount ``create_app()`` inside your own aiohttp application (``app.add_subapp("/gguf",
create_app())``) or run it alone with ``aiogguf serve``. Routes::

    POST   /models              {"path": ..., "config": {overrides}} → 201 {"id": ...}
    GET    /models              every load the server knows
    GET    /models/{id}         state, bytes and tensors done, error; the report once ready
    GET    /models/{id}/events  server-sent events: one ``data: {json}`` per progress
                                event, ending after the load's final state
    DELETE /models/{id}         cancel a load in flight, unload a ready model (freeing its
                                memory), or forget one that has ended
    GET    /healthz             liveness, with the limiter's counters

States: ``loading`` (``queued`` while it waits for the limiter), ``ready``, ``failed``,
``cancelled``, ``unloaded``. Bad requests get a 4xx with ``{"error": "one line"}``.

Every load runs as a task of one task group that the application owns: its startup
opens the group, its shutdown cancels every load and closes every model, and no load
outlives the application. A ready model stays open inside its task
(``async with handle as model: await unload.wait()``), so unloading is leaving that block.
Concurrent loads share a ``LoadLimiter``: a server-wide budget of loads, reader threads
and staging memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import os
import re
import signal
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import anyio
from aiohttp import web
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from aiogguf.api import LoadHandle, load
from aiogguf.config import Config, load_config
from aiogguf.devices import enumerate_devices
from aiogguf.errors import ConfigError, GGUFError
from aiogguf.events import Progress
from aiogguf.io.devices.base import Device
from aiogguf.model import Model
from aiogguf.report import LoadReport

__all__ = [
    "LimiterStats",
    "LoadLimiter",
    "LoadState",
    "LoaderRegistry",
    "create_app",
    "registry_of",
    "serve",
]

logger = logging.getLogger("aiogguf.server")

# The split naming pattern of gguf-split: a load of one shard reads all of them.
_SPLIT_NAME = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


class LoadState(StrEnum):
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    CANCELLED = "cancelled"
    UNLOADED = "unloaded"


# --- the shared limiter ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LimiterStats:
    loads: int
    readers: int
    staging_bytes: int
    waiting: int


class LoadLimiter:
    """A server-wide budget shared by concurrent loads: at most ``max_loads`` loads, at
    most ``max_readers`` reader threads and ``max_staging_bytes`` of staging buffers in
    use at once. A load reserves its share before it starts and returns it when it ends
    (a ready model holds no readers or staging buffers, so it holds no share either).

    Waiters are served first come, first served: a big load is not starved by small
    ones. A request larger than a whole budget is cut down to it (it then runs alone).
    """

    def __init__(
        self,
        max_loads: int = 4,
        max_readers: int = 8,
        max_staging_bytes: int = 1024**3,
    ) -> None:
        if max_loads < 1 or max_readers < 1 or max_staging_bytes < 0:
            raise ValueError(
                "LoadLimiter: expected max_loads >= 1, max_readers >= 1, "
                f"max_staging_bytes >= 0, got {max_loads}, {max_readers}, {max_staging_bytes}"
            )
        self.max_loads = max_loads
        self.max_readers = max_readers
        self.max_staging_bytes = max_staging_bytes
        self._loads = 0
        self._readers = 0
        self._staging = 0
        self._waiting = 0
        # FIFO order among waiters: only the holder of ``_turn`` checks for room. Both
        # are made on first use: a limiter may be built before the event loop runs.
        self._turn: anyio.Lock | None = None
        self._freed: anyio.Event | None = None

    def statistics(self) -> LimiterStats:
        return LimiterStats(self._loads, self._readers, self._staging, self._waiting)

    def _fits(self, readers: int, staging_bytes: int) -> bool:
        return (
            self._loads < self.max_loads
            and self._readers + readers <= self.max_readers
            and self._staging + staging_bytes <= self.max_staging_bytes
        )

    @contextlib.asynccontextmanager
    async def reserve(self, readers: int, staging_bytes: int = 0) -> AsyncIterator[None]:
        """Hold one load's share of the budget for the ``async with`` block."""
        readers = min(max(readers, 1), self.max_readers)
        staging_bytes = min(max(staging_bytes, 0), self.max_staging_bytes)
        if self._turn is None:
            self._turn = anyio.Lock()
        self._waiting += 1
        try:
            async with self._turn:
                while not self._fits(readers, staging_bytes):
                    if self._freed is None:
                        self._freed = anyio.Event()
                    await self._freed.wait()
        finally:
            self._waiting -= 1
        self._loads += 1
        self._readers += readers
        self._staging += staging_bytes
        try:
            yield
        finally:
            self._loads -= 1
            self._readers -= readers
            self._staging -= staging_bytes
            # Wake the head waiter; it makes a fresh event if it has to wait again.
            if self._freed is not None:
                self._freed.set()
                self._freed = None


# --- one load -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Request:
    """A validated ``POST /models`` body: what to load and what it may use."""

    path: str
    config: Config
    devices: tuple[Device, ...]
    readers: int
    staging_bytes: int


class _Entry:
    """One load the server knows: its task's state, progress and subscribers."""

    def __init__(self, load_id: str, request: _Request) -> None:
        self.id = load_id
        self.request = request
        self.state = LoadState.LOADING
        self.queued = True
        self.progress: Progress | None = None
        self.report: LoadReport | None = None
        self.error: str | None = None
        self.scope = anyio.CancelScope()  # cancellable before its task even starts
        self.unload = anyio.Event()
        self.finished = anyio.Event()
        self._subscribers: list[MemoryObjectSendStream[dict[str, Any]]] = []
        # Set (and replaced) whenever subscribers may have something new.
        self.changed = anyio.Event()

    @property
    def settled(self) -> bool:
        """The load itself has ended: ready, or in a terminal state."""
        return self.state is not LoadState.LOADING

    def snapshot(self) -> dict[str, Any]:
        p = self.progress
        gbps = p.gbps if p is not None else math.nan
        data: dict[str, Any] = {
            "id": self.id,
            "path": self.request.path,
            "state": self.state.value,
            "queued": self.queued and self.state is LoadState.LOADING,
            "stage": p.stage.value if p is not None else None,
            "bytes_done": p.bytes_done if p is not None else 0,
            "bytes_total": p.bytes_total if p is not None else 0,
            "tensors_done": p.tensors_done if p is not None else 0,
            "tensors_total": p.tensors_total if p is not None else 0,
            "elapsed_s": p.elapsed_s if p is not None else 0.0,
            "gbps": None if math.isnan(gbps) else gbps,
            "message": p.message if p is not None else "",
            "error": self.error,
            "device_memory": _device_memory(self.request.devices),
        }
        if self.report is not None:
            data["report"] = _report_summary(self.report)
        return data

    # Progress arrives on the loop thread, from the load's own task.
    def on_progress(self, progress: Progress) -> None:
        self.progress = progress
        # The engine's final event (done / failed / cancelled) is followed at once by the state
        # change, which publishes the snapshot that ends the stream.
        if not progress.final:
            self.publish()

    def publish(self) -> None:
        snapshot = self.snapshot()
        final = self.settled
        for send in self._subscribers:
            stats = send.statistics()
            # The last place of every buffer is kept for the final snapshot; a slow
            # client misses intermediate ones, never the end, and never slows the load.
            if final or stats.current_buffer_used < stats.max_buffer_size - 1:
                with contextlib.suppress(
                    anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError
                ):
                    send.send_nowait(snapshot)
        if final:
            self.close_subscribers()
        self._notify()

    def subscribe(self, buffer: int = 32) -> MemoryObjectReceiveStream[dict[str, Any]]:
        """Snapshots from now on, starting with the current one; ends once settled."""
        send, receive = anyio.create_memory_object_stream[dict[str, Any]](buffer)
        send.send_nowait(self.snapshot())
        if self.settled:
            send.close()
        else:
            self._subscribers.append(send)
        return receive

    def close_subscribers(self) -> None:
        for send in self._subscribers:
            send.close()
        self._subscribers.clear()
        self._notify()

    def _notify(self) -> None:
        self.changed.set()
        self.changed = anyio.Event()


def _device_memory(devices: Sequence[Device]) -> dict[str, int]:
    """Bytes allocated right now per device that counts them (simulated GPUs)."""
    memory: dict[str, int] = {}
    for device in devices:
        live = getattr(device, "live", None)
        nbytes = getattr(live, "buffer_bytes", None)
        if isinstance(nbytes, int):
            memory[device.name] = nbytes
    return memory


def _report_summary(report: LoadReport) -> dict[str, Any]:
    return {
        "mode": report.mode,
        "total_s": report.total_s,
        "nbytes": report.nbytes,
        "n_tensors": report.n_tensors,
        "gbps": report.gbps,
        "validated": report.validated,
        "warnings": list(report.warnings),
        "buffers": [
            {
                "device": b.device,
                "buffer_type": b.buffer_type,
                "lazy": b.lazy,
                "nbytes": b.nbytes,
                "n_tensors": b.n_tensors,
            }
            for b in report.buffers
        ],
    }


async def _close_model(model: Model) -> None:
    """Unmapping and freeing many GiB takes real time: off the loop, even when cancelled."""
    with anyio.CancelScope(shield=True):
        await anyio.to_thread.run_sync(model.close)


def _one_line(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


# --- the registry: every load of one application ----------------------------------------


class LoaderRegistry:
    """The loads of one application and the task group that runs them.

    ``start()`` opens the group in a supervisor task; ``aclose()`` cancels every load,
    waits until each has closed its model, and ends the supervisor.
    """

    def __init__(
        self, config: Config, limiter: LoadLimiter, roots: Sequence[str] | None = None
    ) -> None:
        self.config = config
        self.limiter = limiter
        self.roots = tuple(os.path.realpath(r) for r in roots) if roots is not None else None
        self.entries: dict[str, _Entry] = {}
        self._ids = itertools.count(1)
        self._tg: TaskGroup | None = None
        self._stop: anyio.Event | None = None  # made in ``start``, inside the loop
        self._supervisor: asyncio.Task[None] | None = None
        self._closing = False

    @property
    def accepting(self) -> bool:
        return self._tg is not None and not self._closing

    async def start(self) -> None:
        self._stop = anyio.Event()
        started = anyio.Event()
        # The one task the registry creates outside a task group; ``aclose`` joins it.
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise(started))
        await started.wait()

    async def _supervise(self, started: anyio.Event) -> None:
        assert self._stop is not None
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                started.set()
                await self._stop.wait()
                tg.cancel_scope.cancel()
        finally:
            self._tg = None

    async def aclose(self) -> None:
        """Cancel every load and close every model; idempotent."""
        self._closing = True
        if self._stop is not None:
            self._stop.set()
        if self._supervisor is not None:
            with anyio.CancelScope(shield=True):
                await self._supervisor
        for entry in self.entries.values():
            entry.close_subscribers()

    def submit(self, request: _Request) -> _Entry:
        if self._tg is None or self._closing:
            raise RuntimeError("the server is shutting down")
        entry = _Entry(str(next(self._ids)), request)
        self.entries[entry.id] = entry
        self._tg.start_soon(self._run, entry, name=f"aiogguf load {entry.id}")
        return entry

    async def _run(self, entry: _Entry) -> None:
        request = entry.request
        handle: LoadHandle = load(
            request.path, request.config, progress=entry.on_progress, devices=request.devices
        )
        try:
            with entry.scope:
                async with contextlib.AsyncExitStack() as stack:
                    # The share of the budget is held while loading only: a ready model
                    # uses no readers and no staging buffers.
                    async with self.limiter.reserve(request.readers, request.staging_bytes):
                        entry.queued = False
                        entry.publish()
                        model = await stack.enter_async_context(handle)
                    stack.push_async_callback(_close_model, model)
                    entry.report = model.report
                    entry.state = LoadState.READY
                    entry.publish()
                    await entry.unload.wait()
        except GGUFError as exc:
            entry.state, entry.error = LoadState.FAILED, _one_line(exc)
        except Exception as exc:
            # A bug, not a bad file: logged in full, and it must not end the other loads.
            logger.exception("load %s of %s failed", entry.id, request.path)
            entry.state, entry.error = LoadState.FAILED, f"{type(exc).__name__}: {_one_line(exc)}"
        finally:
            # Cancelled by DELETE (the scope swallowed it) or by shutdown (re-raised).
            if entry.state is LoadState.LOADING:
                entry.state = LoadState.CANCELLED
            elif entry.state is LoadState.READY:
                entry.state = LoadState.UNLOADED
            entry.finished.set()
            entry.publish()

    async def stop(self, entry: _Entry, timeout_s: float) -> bool:
        """Cancel or unload ``entry``; True once it has ended within ``timeout_s``."""
        if entry.state is LoadState.LOADING:
            entry.scope.cancel()
        else:
            entry.unload.set()
        with anyio.move_on_after(timeout_s):
            await entry.finished.wait()
        return entry.finished.is_set()


# --- request parsing -----------------------------------------------------------------


class _BadRequest(Exception):
    def __init__(self, reason: str, status: int = 400) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status


def _locate(path: str, roots: Sequence[str] | None) -> tuple[str, bool, bool]:
    """``path`` made absolute, whether it is a file, whether ``roots`` allow it."""
    full = os.path.abspath(os.path.expanduser(path))
    if roots is None:
        return full, os.path.isfile(full), True
    real = os.path.realpath(full)  # a symlink out of the roots does not count as inside
    allowed = any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in roots)
    return full, os.path.isfile(full), allowed


def _split_count(path: str) -> int:
    match = _SPLIT_NAME.search(os.path.basename(path))
    return int(match.group(2)) if match else 1


async def _parse_request(request: web.Request, registry: LoaderRegistry) -> _Request:
    try:
        body = json.loads(await request.read())
    except (ValueError, UnicodeDecodeError) as exc:
        raise _BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise _BadRequest('expected a JSON object like {"path": "model.gguf"}')
    unknown = sorted(set(body) - {"path", "config"})
    if unknown:
        raise _BadRequest(f"unknown field {unknown[0]!r}; expected 'path' and 'config'")
    path = body.get("path")
    if not isinstance(path, str) or not path:
        raise _BadRequest("'path' is required: the GGUF file to load, as a string")
    overrides = body.get("config") or {}
    if not isinstance(overrides, dict):
        raise _BadRequest('\'config\' must be an object of config keys, like {"mode": "none"}')
    limiter = registry.limiter
    try:
        config = registry.config.with_settings(overrides, origin="request config")
        if config.pipeline.reader_count() > limiter.max_readers:
            config = config.with_settings({"readers": limiter.max_readers})
    except ConfigError as exc:
        raise _BadRequest(_one_line(exc)) from exc
    except (TypeError, ValueError) as exc:  # a JSON value of a shape no key takes
        raise _BadRequest(f"request config: {_one_line(exc)}") from exc
    # A stat and device discovery (CuPy initialisation) may block: not on the loop.
    full, exists, allowed = await anyio.to_thread.run_sync(_locate, path, registry.roots)
    if not allowed:
        # Said the same way whether or not the file exists: nothing leaks from outside.
        raise _BadRequest(f"{path}: not under a served directory", status=403)
    if not exists:
        raise _BadRequest(f"{path}: no such file")
    path = full
    try:
        devices = await anyio.to_thread.run_sync(enumerate_devices, config)
    except ConfigError as exc:
        raise _BadRequest(_one_line(exc)) from exc
    readers = config.pipeline.readers_for(path) * _split_count(path)
    gpus = sum(1 for d in devices if d.kind != "cpu")
    staging = 0
    if gpus and config.placement.n_gpu_layers != 0:
        pipeline = config.pipeline
        staging = gpus * readers * pipeline.staging_buffers * pipeline.staging_bytes()
    return _Request(path, config, devices, readers, staging)


# --- handlers --------------------------------------------------------------------------

_REGISTRY = web.AppKey("aiogguf_registry", LoaderRegistry)

# How long DELETE waits for a load to wind down before answering 202.
_STOP_WAIT_S = 30.0
# An event stream with nothing to say (a load queued behind others) says this often
# that it is alive.
_KEEPALIVE_S = 15.0


def _error(status: int, reason: str) -> web.Response:
    return web.json_response({"error": reason}, status=status)


def _entry(request: web.Request) -> _Entry | web.Response:
    registry = request.app[_REGISTRY]
    load_id = request.match_info["id"]
    entry = registry.entries.get(load_id)
    if entry is None:
        return _error(404, f"no load with id {load_id!r}")
    return entry


async def _post_model(request: web.Request) -> web.Response:
    registry = request.app[_REGISTRY]
    if not registry.accepting:
        return _error(503, "the server is shutting down")
    try:
        parsed = await _parse_request(request, registry)
    except _BadRequest as exc:
        return _error(exc.status, exc.reason)
    entry = registry.submit(parsed)
    return web.json_response(
        {"id": entry.id, "state": entry.state.value},
        status=201,
        headers={"Location": str(request.url.with_path(f"{request.path}/{entry.id}"))},
    )


async def _list_models(request: web.Request) -> web.Response:
    registry = request.app[_REGISTRY]
    return web.json_response({"models": [e.snapshot() for e in registry.entries.values()]})


async def _get_model(request: web.Request) -> web.Response:
    entry = _entry(request)
    if isinstance(entry, web.Response):
        return entry
    return web.json_response(entry.snapshot())


async def _model_events(request: web.Request) -> web.StreamResponse:
    entry = _entry(request)
    if isinstance(entry, web.Response):
        return entry
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    async with entry.subscribe() as snapshots:
        try:
            while True:
                try:
                    snapshot = snapshots.receive_nowait()
                except anyio.EndOfStream:
                    break
                except anyio.WouldBlock:
                    # Wait for news on an event, not on the stream: a timeout that hit
                    # ``receive()`` just as a snapshot arrived would lose that snapshot.
                    with anyio.move_on_after(_KEEPALIVE_S) as idle:
                        await entry.changed.wait()
                    if idle.cancelled_caught:
                        await response.write(b": keep-alive\n\n")  # an SSE comment
                    continue
                await response.write(f"data: {json.dumps(snapshot)}\n\n".encode())
        except ConnectionError:
            return response  # the client left; the load goes on
    await response.write_eof()
    return response


async def _delete_model(request: web.Request) -> web.Response:
    registry = request.app[_REGISTRY]
    entry = _entry(request)
    if isinstance(entry, web.Response):
        return entry
    if entry.finished.is_set():
        # Already over: forget the record.
        del registry.entries[entry.id]
        return web.json_response({**entry.snapshot(), "forgotten": True})
    if not await registry.stop(entry, _STOP_WAIT_S):
        return web.json_response(entry.snapshot(), status=202)
    return web.json_response(entry.snapshot())


async def _healthz(request: web.Request) -> web.Response:
    registry = request.app[_REGISTRY]
    stats = registry.limiter.statistics()
    states = [e.state for e in registry.entries.values()]
    return web.json_response(
        {
            "ok": registry.accepting,
            "loading": states.count(LoadState.LOADING),
            "ready": states.count(LoadState.READY),
            "limiter": {
                "loads": stats.loads,
                "max_loads": registry.limiter.max_loads,
                "readers": stats.readers,
                "max_readers": registry.limiter.max_readers,
                "staging_bytes": stats.staging_bytes,
                "max_staging_bytes": registry.limiter.max_staging_bytes,
                "waiting": stats.waiting,
            },
        },
        status=200 if registry.accepting else 503,
    )


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    registry = app[_REGISTRY]
    await registry.start()
    yield
    await registry.aclose()


async def _on_shutdown(app: web.Application) -> None:
    # Before connections are drained: ends the event streams, which would otherwise
    # hold the shutdown until their loads finished.
    await app[_REGISTRY].aclose()


def create_app(
    *,
    config: Config | str | os.PathLike[str] | None = None,
    limiter: LoadLimiter | None = None,
    roots: Sequence[str | os.PathLike[str]] | None = None,
) -> web.Application:
    """The load server as an aiohttp application, standalone or mounted with
    ``parent.add_subapp(prefix, create_app())``.

    ``config``: the base of every load (a ``Config``, a TOML path or None); a request's
    ``config`` overrides keys of it. ``limiter``: the budget shared by the loads (pass
    the same one to several apps to share it); default ``LoadLimiter()``. ``roots``:
    directories whose files may be loaded (others get 403); None allows any path the
    process can read, so bind such a server to a trusted interface only.

    Raises ``ConfigError`` for a bad ``config``.
    """
    app = web.Application()
    registry = LoaderRegistry(
        load_config(config),
        limiter or LoadLimiter(),
        [os.fspath(r) for r in roots] if roots is not None else None,
    )
    app[_REGISTRY] = registry
    app.cleanup_ctx.append(_lifecycle)
    app.on_shutdown.append(_on_shutdown)
    app.router.add_post("/models", _post_model)
    app.router.add_get("/models", _list_models)
    app.router.add_get("/models/{id}", _get_model)
    app.router.add_get("/models/{id}/events", _model_events)
    app.router.add_delete("/models/{id}", _delete_model)
    app.router.add_get("/healthz", _healthz)
    return app


def registry_of(app: web.Application) -> LoaderRegistry:
    """The registry of an application made by ``create_app`` (for embedding code)."""
    return app[_REGISTRY]


async def serve(
    app: web.Application,
    *,
    host: str = "127.0.0.1",
    port: int = 8765,
    on_started: Callable[[Sequence[Any]], None] | None = None,
) -> None:
    """Serve ``app`` until SIGINT or SIGTERM (or cancellation), then shut it down:
    every load cancelled, every model closed. ``on_started`` gets the bound addresses."""
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        if on_started is not None:
            on_started(runner.addresses)
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as received:
            async for _ in received:
                break
    finally:
        with anyio.CancelScope(shield=True):
            await runner.cleanup()
