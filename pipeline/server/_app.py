"""An HTTP load server: start, follow, cancel and unload model loads while serving.

Mount ``create_app(roots=[...])`` inside your own aiohttp application
(``app.add_subapp("/gguf", create_app(roots=["/models"]))``) or run it alone with
``aiogguf serve``. Routes::

    POST   /models              {"path": ..., "config": {overrides}, "keep_alive": "5m",
                                "pin": false} → 201 {"id": ...}; 200 with the id of a
                                model of the same files and placement, loading or ready
    GET    /models              every load the server knows, and the budget used
    GET    /models/{id}         state, bytes and tensors done, error, leases, pin,
                                keep-alive, expiry, reload cost; the report once ready
    GET    /models/{id}/events  server-sent events: one ``data: {json}`` per progress
                                event, ending after the load's final state
    DELETE /models/{id}         cancel a load in flight, unload a ready model (freeing its
                                memory; 409 while leased unless ?force=true), or forget
                                one that has ended
    GET    /                    the status page (``aiogguf.server._status_page``)
    GET    /healthz             liveness, with the limiter's counters

The model manager (``aiogguf.server._manager``): a ready model stays until a DELETE,
its keep-alive after its last lease, or eviction; a load past ``max_models`` or
``max_loaded_bytes`` evicts idle, unpinned models, cheapest to reload first, and waits
for their memory.

States: ``loading`` (``queued`` while it waits for the limiter), ``ready``, ``failed``,
``cancelled``, ``unloaded``. Every error reply is JSON, ``{"error": "one line"}``.

What clients may do is the operator's choice (``aiogguf.server._policy``): files are read
only beneath the roots (each file opened once, under them, and read only through that
descriptor; a path outside gets 403 and learns nothing of the file), an optional bearer
token guards every route but ``/healthz``, a request's config may set only some keys,
only some modes, and no value above the server's own, and the models held and the
records kept are bounded. Model ids are 128 random bits. Remote names (``https://``,
``hf://``) are loaded only as the operator allows, and connect to no internal address
(``aiogguf.server._remote``).

Every load runs as a task of one task group that the application owns: its startup
opens the group, its shutdown cancels every load and closes every model, and no load
outlives the application. A ready model stays open inside its task
(``async with handle as model: await unload.wait()``), so unloading is leaving that block.
Concurrent loads share a ``LoadLimiter`` (``aiogguf.server._limiter``): a server-wide
budget of loads, reader threads and staging memory. A ``POST /models`` body is read,
checked and its files opened by ``aiogguf.server._requests``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import secrets
import signal
import threading
import time
from collections import OrderedDict
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterator,
    Mapping,
    Sequence,
)
from typing import Any

import anyio
from aiohttp import web
from anyio.abc import TaskGroup

from aiogguf._api import LoadHandle, load, warm_up
from aiogguf._config import Config, load_config
from aiogguf._model import Model
from aiogguf._units import counted, format_bytes, parse_duration
from aiogguf.errors import GGUFError
from aiogguf.io.opener import AnyPathOpener, FileOpener, RootedOpener
from aiogguf.io.workers import LoadThreads
from aiogguf.server._attach import AttachAccess, AttachListener
from aiogguf.server._entry import LoadState, _Entry, load_key
from aiogguf.server._limiter import LimiterStats, LoadLimiter
from aiogguf.server._manager import (
    ReloadRates,
    choose_victims,
    keep_alive_json,
    source_kind,
)
from aiogguf.server._policy import (
    HEALTH_ROUTE,
    STATUS_ROUTE,
    PreOpened,
    RequestRefused,
    ServerPolicy,
    auth_middleware,
    exception_line,
    json_errors_middleware,
    one_line,
    server_base_config,
)
from aiogguf.server._remote import NoLocalFiles, RemoteAccess
from aiogguf.server._requests import LoadRequest, parse_request, prepare_body
from aiogguf.server._status_page import status_page
from aiogguf.server._transport import (
    ConnectionGuard,
    DescriptorBudget,
    GuardedSite,
    default_max_connections,
    descriptor_limit,
    raise_descriptor_limit,
)

__all__ = [
    "LimiterStats",
    "LoadLimiter",
    "LoadState",
    "LoaderRegistry",
    "RemoteAccess",
    "ServerPolicy",
    "create_app",
    "registry_of",
    "serve",
]

logger: logging.Logger = logging.getLogger("aiogguf.server._app")


async def _note_source(entry: _Entry) -> None:
    """Where ``entry``'s bytes come from as its load begins (its files in the page cache
    or not): the rate it measures is that kind's. ``mincore`` over every page of the
    files takes about 18 ms per GiB, so it runs here, once a load starts, not for every
    request (most of which find their model resident)."""
    opener = entry.request.opener
    if isinstance(opener, PreOpened):
        async with LoadThreads(1, name="aiogguf-request") as threads:
            cached = await threads.run_sync(opener.cached_bytes)
        entry.kind = source_kind(False, cached, entry.request.nbytes)


async def _close_model(model: Model) -> None:
    """Unmapping and freeing many GiB takes real time: off the loop, even when cancelled."""
    with anyio.CancelScope(shield=True):
        async with LoadThreads(1, name="aiogguf-close") as threads:
            await threads.run_sync(model.close)


# --- the registry: every load of one application ----------------------------------------


class LoaderRegistry:
    """The loads of one application and the task group that runs them.

    ``start()`` opens the group in a supervisor task; ``aclose()`` cancels every load,
    waits until each has closed its model, and ends the supervisor.
    """

    def __init__(
        self,
        config: Config,
        limiter: LoadLimiter,
        opener: FileOpener,
        policy: ServerPolicy | None = None,
    ) -> None:
        self.config = config
        self.limiter = limiter
        self.opener = opener
        self.policy: ServerPolicy = policy if policy is not None else ServerPolicy()
        self.entries: dict[str, _Entry] = {}
        # Ended loads by id, least recently used first, with the time each ended.
        self._ended: OrderedDict[str, float] = OrderedDict()
        self._tg: TaskGroup | None = None
        self._stop: anyio.Event | None = None  # made in ``start``, inside the loop
        self._supervisor: asyncio.Task[None] | None = None
        self._closing = False
        self._close_by: float | None = None  # when ``aclose`` stops waiting for loads
        # Where ``serve`` runs the app: its open connections, which sit inside the
        # descriptors kept for serving (see ``descriptor_room``).
        self.connection_count: Callable[[], int] = lambda: 0
        # A request's descriptor check and its opening of files, one request at a time:
        # two requests must not both count the same free descriptors.
        self.admission_lock: threading.Lock = threading.Lock()
        # Remote loads whose files are being opened now (``policy.max_remote_admissions``);
        # changed on the loop's thread only.
        self.remote_admissions = 0
        # The model manager: the rates this server's loads measured (reload costs), the
        # keep-alive of a load that names none, and the event that wakes the task that
        # unloads idle models when their keep-alive ends (made in ``start``).
        self.rates = ReloadRates()
        self.keep_alive_s: float = (
            self.policy.keep_alive_s
            if self.policy.keep_alive_s is not None
            else parse_duration(config.server.keep_alive)
        )
        self._wake: anyio.Event | None = None

    @property
    def accepting(self) -> bool:
        return self._tg is not None and not self._closing

    async def start(self) -> None:
        """Start the task that supervises the loads (``aclose`` joins it)."""
        self._stop = anyio.Event()
        self._wake = anyio.Event()
        started = anyio.Event()
        # The one task the registry creates outside a task group; ``aclose`` joins it.
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise(started))
        await started.wait()

    async def _supervise(self, started: anyio.Event) -> None:
        assert self._stop is not None
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self._expire_idle, name="aiogguf keep-alive")
                started.set()
                await self._stop.wait()
                tg.cancel_scope.cancel()
        finally:
            self._tg = None

    async def aclose(self, timeout_s: float | None = None) -> bool:
        """Cancel every load and close every model; idempotent. Waits at most
        ``timeout_s`` (None: as long as it takes) for the loads to end; False when some
        have not (a thread blocked in a system call): they are left behind, logged."""
        self._closing = True
        if self._stop is not None:
            self._stop.set()
        # One wait for every call: the application's shutdown and its cleanup both
        # close the registry, and the second must not wait as long again.
        if timeout_s is not None and self._close_by is None:
            self._close_by = time.monotonic() + timeout_s
        ended = True
        if self._supervisor is not None and not self._supervisor.done():
            left = None if self._close_by is None else max(self._close_by - time.monotonic(), 0)
            with anyio.CancelScope(shield=True):
                # ``asyncio.wait``, not ``await task``: giving up the wait must not
                # cancel the supervisor, which is already winding the loads down.
                await asyncio.wait({self._supervisor}, timeout=left)
            ended = self._supervisor.done()
            if not ended and left != 0:  # said once, by the call that waited
                loading = sum(1 for e in self.entries.values() if not e.finished.is_set())
                logger.warning(
                    "%d loads did not stop within %.1f s of the shutdown", loading, timeout_s
                )
        for entry in self.entries.values():
            entry.close_subscribers()
        return ended

    def descriptor_budget(self) -> DescriptorBudget:
        """Descriptors kept for serving: as many as ``serve`` lets connections take
        (``policy.max_connections``, or its default for this process's limit)."""
        limit = descriptor_limit()
        connections = self.policy.max_connections or default_max_connections(limit)
        return DescriptorBudget.for_connections(connections, limit)

    def held(self) -> tuple[int, int]:
        """Models loading or ready, and the file bytes they hold or will hold."""
        holding = [e for e in self.entries.values() if e.holds_memory]
        return len(holding), sum(e.request.nbytes for e in holding)

    def _staying(self) -> tuple[int, int]:
        """``held()`` less the models on their way out (their memory is promised)."""
        staying = [e for e in self.entries.values() if e.holds_memory and not e.leaving]
        return len(staying), sum(e.request.nbytes for e in staying)

    def submit(self, request: LoadRequest) -> _Entry:
        """Start ``request``'s load, evicting idle models (cheapest to reload first) to
        make room under the limits; ``RequestRefused`` (429, 507) when evicting every
        idle, unpinned model would not be enough."""
        if self._tg is None or self._closing:
            raise RuntimeError("the server is shutting down")
        policy = self.policy
        models, nbytes = self._staying()
        free_models = 0 if policy.max_models is None else models + 1 - policy.max_models
        free_bytes = (
            0
            if policy.max_loaded_bytes is None
            else nbytes + request.nbytes - policy.max_loaded_bytes
        )
        candidates = [e for e in self.entries.values() if e.evictable]
        victims = choose_victims(candidates, free_bytes, free_models)
        if victims is None:
            raise self._refusal(request, models, nbytes, free_models > 0)
        self.prune()
        # 128 random bits: one client cannot guess, and so cannot DELETE, another's model.
        entry = _Entry(secrets.token_hex(16), request, self.rates, self._keep_alive(request))
        for victim in victims:
            self.let_go(victim, f"evicted for load {entry.id}")
            logger.info(
                "evicted %s (%s, reload %.1f s) for %s",
                victim.id,
                format_bytes(victim.nbytes),
                victim.reload_s,
                entry.id,
            )
        # Every model on its way out frees its memory before this load takes any.
        entry.after = tuple(
            e for e in self.entries.values() if e.leaving and not e.finished.is_set()
        )
        self.entries[entry.id] = entry
        self._tg.start_soon(self._run, entry, name=f"aiogguf load {entry.id}")
        return entry

    def _refusal(
        self, request: LoadRequest, models: int, nbytes: int, over_count: bool
    ) -> RequestRefused:
        kept = [e for e in self.entries.values() if e.holds_memory and not e.leaving]
        leased = sum(1 for e in kept if e.leases)
        pinned = sum(1 for e in kept if e.pinned and not e.leases)
        loading = sum(1 for e in kept if e.state is LoadState.LOADING)
        why = f"none can be evicted enough: {leased} leased, {pinned} pinned, {loading} loading"
        if over_count:
            return RequestRefused(
                f"this server holds {counted(models, 'model')}, its limit, and {why}; "
                "unload one first",
                status=429,
            )
        limit = self.policy.max_loaded_bytes
        if limit is not None and request.nbytes > limit:
            why = "it is over the limit on its own"
        return RequestRefused(
            f"{request.path}: {request.nbytes} bytes would take the models held to "
            f"{nbytes + request.nbytes} bytes, over this server's limit of {limit}, "
            f"and {why}",
            status=507,
        )

    def _keep_alive(self, request: LoadRequest) -> float:
        return self.keep_alive_s if request.keep_alive_s is None else request.keep_alive_s

    def update(self, entry: _Entry, request: LoadRequest) -> None:
        """A second request for ``entry``'s load: its ``keep_alive`` and ``pin``, where
        it gives them, replace the model's."""
        if request.keep_alive_s is not None:
            entry.keep_alive_s = request.keep_alive_s
        if request.pin is not None:
            entry.pinned = request.pin
        entry.last_used = time.monotonic()
        entry.publish()
        self._wake_up()

    def let_go(self, entry: _Entry, reason: str) -> None:
        """Unload ``entry`` (or cancel its load) for ``reason``; returns at once."""
        if not entry.leaving:
            entry.leaving = True
            entry.unload_reason = reason
        if entry.state is LoadState.LOADING:
            entry.scope.cancel()
        else:
            entry.unload.set()
        self._wake_up()

    def admit(self, request: LoadRequest) -> tuple[_Entry, bool]:
        """The same load (``update``d; False) or a new one (``submit``; True); the
        request's descriptors closed unless a new load took them."""
        existing = self.same_load(request)
        if existing is not None:
            request.opener.close()
            self.update(existing, request)
            return existing, False
        try:
            return self.submit(request), True
        except BaseException:
            request.opener.close()
            raise

    def same_load(self, request: LoadRequest) -> _Entry | None:
        """A load, loading or ready, of the same files in the same placement as
        ``request`` (the same path, config and devices): one resident model serves both.
        A model on its way out (unloaded, evicted, expired) is none."""
        key = load_key(request)
        for entry in self.entries.values():
            if (
                entry.holds_memory
                and not entry.leaving
                and not entry.finished.is_set()
                and load_key(entry.request) == key
            ):
                return entry
        return None

    @contextlib.contextmanager
    def lease(self, entry: _Entry) -> Iterator[None]:
        """Hold ``entry``'s model for a client while the block runs (on the loop's thread):
        it is not evicted or unloaded unless forced, and its keep-alive runs from the
        end of its last lease."""
        entry.leases += 1
        entry.last_used = time.monotonic()
        entry.publish()
        self._wake_up()
        try:
            yield
        finally:
            entry.leases -= 1
            entry.last_used = time.monotonic()
            entry.publish()
            self._wake_up()

    def _wake_up(self) -> None:
        """Tell the keep-alive task that a deadline may have changed."""
        if self._wake is not None:
            self._wake.set()
            self._wake = anyio.Event()

    async def _expire_idle(self) -> None:
        """Unload each idle model as its keep-alive ends: sleeps until the nearest end or
        until a lease, a load or a request changes one (``_wake_up``), never polls."""
        while True:
            assert self._wake is not None
            wake = self._wake
            now = time.monotonic()
            nearest = math.inf
            for entry in list(self.entries.values()):
                end = entry.deadline()
                if end is None:
                    continue
                if end <= now:
                    self.let_go(entry, "keep_alive expired")
                    logger.info("unloaded %s: idle for its keep_alive", entry.id)
                else:
                    nearest = min(nearest, end)
            with anyio.move_on_after(nearest - now):
                await wake.wait()

    def budget(self) -> dict[str, Any]:
        """What the models take of the server's limits, and the rates it has measured."""
        models, nbytes = self.held()
        return {
            "models": models,
            "max_models": self.policy.max_models,
            "bytes": nbytes,
            "max_loaded_bytes": self.policy.max_loaded_bytes,
            "keep_alive": keep_alive_json(self.keep_alive_s),
            "rates": self.rates.measured(),
        }

    def start_soon(
        self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any, name: str
    ) -> None:
        """Run ``fn(*args)`` in the registry's task group; RuntimeError once closing."""
        if self._tg is None or self._closing:
            raise RuntimeError("the server is shutting down")
        self._tg.start_soon(fn, *args, name=name)

    def record_failed(self, body: Mapping[str, Any], reason: str) -> None:
        """A load refused before it began (a preload), listed as a failed load."""
        request = LoadRequest(
            str(body.get("path")), self.config, (), 0, 0, PreOpened(self.opener, []), 0
        )
        entry = _Entry(secrets.token_hex(16), request, self.rates, self.keep_alive_s)
        entry.state, entry.error = LoadState.FAILED, reason
        entry.finished.set()
        self.entries[entry.id] = entry
        self._ended_now(entry)

    def touch(self, entry: _Entry) -> None:
        """A record was read: it is the last to go among the ended ones."""
        if entry.id in self._ended:
            self._ended.move_to_end(entry.id)

    def forget(self, entry: _Entry) -> None:
        """Drop the record of the load ``entry``."""
        self.entries.pop(entry.id, None)
        self._ended.pop(entry.id, None)

    def prune(self) -> None:
        """Drop records of ended loads older than the TTL, then the least recently used
        beyond ``max_finished``."""
        now = time.monotonic()
        ttl, keep = self.policy.finished_ttl_s, self.policy.max_finished
        for load_id, ended in list(self._ended.items()):
            if now - ended > ttl:
                del self._ended[load_id]
                self.entries.pop(load_id, None)
        while len(self._ended) > keep:
            load_id, _ = self._ended.popitem(last=False)
            self.entries.pop(load_id, None)

    def _ended_now(self, entry: _Entry) -> None:
        entry.holds_memory = False
        self._ended[entry.id] = time.monotonic()
        self.prune()

    async def _run(self, entry: _Entry) -> None:
        request = entry.request
        handle: LoadHandle = load(
            request.path,
            request.config,
            progress=entry.on_progress,
            devices=request.devices,
            opener=request.opener,
        )
        try:
            with entry.scope:
                # Memory promised by models on their way out is freed before this load
                # takes any: the limits are never overshot.
                for leaving in entry.after:
                    await leaving.finished.wait()
                entry.after = ()
                async with contextlib.AsyncExitStack() as stack:
                    # The share of the budget is held while loading only: a ready model
                    # uses no readers and no staging buffers.
                    async with self.limiter.reserve(request.readers, request.staging_bytes):
                        entry.queued = False
                        entry.publish()
                        await _note_source(entry)
                        model = await stack.enter_async_context(handle)
                    # Loaded: the model holds what it needs of the file (its own
                    # descriptors or copies); the request's descriptor can go.
                    request.opener.close()
                    stack.push_async_callback(_close_model, model)
                    entry.report = model.report
                    entry.model = model
                    entry.load_rate = self.rates.record(
                        entry.kind, request.nbytes, model.report.total_s
                    )
                    entry.last_used = time.monotonic()
                    entry.state = LoadState.READY
                    entry.publish()
                    self._wake_up()
                    await entry.unload.wait()
        except GGUFError as exc:
            entry.state, entry.error = LoadState.FAILED, exception_line(exc)
        except Exception as exc:
            # A bug, not a bad file: logged in full, and it must not end the other loads.
            logger.exception("load %s of %s failed", entry.id, request.path)
            entry.state, entry.error = (
                LoadState.FAILED,
                f"{type(exc).__name__}: {exception_line(exc)}",
            )
        finally:
            entry.model = None
            # Cancelled by DELETE (the scope swallowed it) or by shutdown (re-raised).
            if entry.state is LoadState.LOADING:
                entry.state = LoadState.CANCELLED
            elif entry.state is LoadState.READY:
                entry.state = LoadState.UNLOADED
            request.opener.close()
            entry.finished.set()
            self._ended_now(entry)
            entry.publish()
            self._wake_up()

    async def stop(self, entry: _Entry, timeout_s: float, reason: str = "DELETE") -> bool:
        """Cancel or unload ``entry``; True once it has ended within ``timeout_s``."""
        self.let_go(entry, reason)
        with anyio.move_on_after(timeout_s):
            await entry.finished.wait()
        return entry.finished.is_set()


async def _preload(registry: LoaderRegistry, tables: Sequence[Mapping[str, Any]]) -> None:
    """Load each of ``tables`` (``POST /models`` bodies, ``[[server.preload]]``) in the
    registry's task group; returns at once. One that fails is logged in one line and
    listed as failed; the server starts either way."""
    for table in tables:
        registry.start_soon(_preload_one, registry, dict(table), name="aiogguf preload")


async def _preload_one(registry: LoaderRegistry, body: dict[str, Any]) -> None:
    path = str(body.get("path"))
    try:
        entry = registry.submit(await prepare_body(body, registry))
    except RequestRefused as exc:
        logger.warning("preload %s refused (%d): %s", path, exc.status, exc.reason)
        registry.record_failed(body, exc.reason)
        return
    except RuntimeError:  # shutting down
        return
    while not entry.settled:  # no await between the look and the wait
        await entry.changed.wait()
    if entry.state is LoadState.FAILED:
        logger.warning("preload %s failed: %s", path, entry.error)


# --- handlers --------------------------------------------------------------------------

_REGISTRY = web.AppKey("aiogguf_registry", LoaderRegistry)

# How long DELETE waits for a load to wind down before answering 202.
_STOP_WAIT_S = 30.0
# How often a request being admitted looks whether its client is still connected.
_GONE_POLL_S = 0.1
# An event stream with nothing to say (a load queued behind others) says this often
# that it is alive.
_KEEPALIVE_S = 15.0


def _error(status: int, reason: str) -> web.Response:
    return web.json_response({"error": one_line(reason)}, status=status)


def _entry(request: web.Request) -> _Entry | web.Response:
    registry = request.app[_REGISTRY]
    registry.prune()
    load_id = request.match_info["id"]
    entry = registry.entries.get(load_id)
    if entry is None:
        return _error(404, f"no load with id {load_id!r}")
    registry.touch(entry)
    return entry


async def _post_model(request: web.Request) -> web.Response:
    registry = request.app[_REGISTRY]
    if not registry.accepting:
        return _error(503, "the server is shutting down")
    try:
        parsed = await _while_connected(request, lambda: parse_request(request, registry))
    except RequestRefused as exc:
        return _error(exc.status, exc.reason)
    if parsed is None or _gone(request):
        if parsed is not None:
            parsed.opener.close()
        return _error(499, "the client closed its connection before the load was admitted")
    # The same files in the same placement, loading or ready: that model, once.
    try:
        entry, new = registry.admit(parsed)
    except RequestRefused as exc:
        return _error(exc.status, exc.reason)
    except RuntimeError as exc:
        return _error(503, str(exc))
    return web.json_response(
        {"id": entry.id, "state": entry.state.value},
        status=201 if new else 200,
        headers={"Location": str(request.url.with_path(f"{request.path}/{entry.id}"))},
    )


def _gone(request: web.Request) -> bool:
    """Whether the request's client has closed its connection."""
    transport = request.transport
    return transport is None or transport.is_closing()


async def _while_connected(
    request: web.Request, fn: Callable[[], Awaitable[LoadRequest]]
) -> LoadRequest | None:
    """``fn()``, or None once the request's client has closed its connection (looked at
    every ``_GONE_POLL_S``), ``fn`` then cancelled: aiohttp goes on with a handler whose
    client went away, and a remote admission would go on waiting on a server for no
    one."""
    outcome: list[LoadRequest] = []
    error: Exception | None = None

    async def watch(scope: anyio.CancelScope) -> None:
        while not _gone(request):  # noqa: ASYNC110  (aiohttp has no event for it)
            await anyio.sleep(_GONE_POLL_S)
        scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch, tg.cancel_scope)
        try:
            outcome.append(await fn())
        except Exception as exc:  # raised below, outside the group: not wrapped in one
            error = exc
        tg.cancel_scope.cancel()
    if error is not None:
        raise error
    return outcome[0] if outcome else None


async def _list_models(request: web.Request) -> web.Response:
    registry = request.app[_REGISTRY]
    registry.prune()
    return web.json_response(
        {
            "models": [e.snapshot() for e in registry.entries.values()],
            "budget": registry.budget(),
        }
    )


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
        registry.forget(entry)
        return web.json_response({**entry.snapshot(), "forgotten": True})
    force = request.query.get("force", "").lower() in ("1", "true", "yes")
    if entry.leases and not force:
        return _error(
            409,
            f"model {entry.id} is leased by {counted(entry.leases, 'client')}; "
            "DELETE with ?force=true unloads it anyway (its clients are told)",
        )
    reason = "DELETE" if not entry.leases else f"forced DELETE ({counted(entry.leases, 'lease')})"
    if not await registry.stop(entry, _STOP_WAIT_S, reason):
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


# How long a shutdown waits for the loads to end once cancelled (each stage of a load
# stops within a second of its cancellation), and then for replies under way.
_LOAD_STOP_GRACE_S = 1.0
_REPLY_GRACE_S = 0.3


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    registry = app[_REGISTRY]
    await registry.start()
    await _preload(
        registry, [p.model_dump(exclude_none=True) for p in registry.config.server.preload]
    )
    try:
        yield
    finally:
        await registry.aclose(_LOAD_STOP_GRACE_S)
        if isinstance(registry.opener, RootedOpener):
            registry.opener.close()


async def _on_shutdown(app: web.Application) -> None:
    # Before connections are drained: ends the event streams, which would otherwise
    # hold the shutdown until their loads finished.
    await app[_REGISTRY].aclose(_LOAD_STOP_GRACE_S)


def create_app(
    *,
    config: Config | str | os.PathLike[str] | None = None,
    limiter: LoadLimiter | None = None,
    roots: Sequence[str | os.PathLike[str]] | None = None,
    allow_any_path: bool = False,
    policy: ServerPolicy | None = None,
) -> web.Application:
    """The load server as an aiohttp application, standalone or mounted with
    ``parent.add_subapp(prefix, create_app(roots=[...]))``.

    ``config``: the base of every load (a ``Config``, a TOML path or None); a request's
    ``config`` overrides the keys ``policy`` allows, never above this config's values. Its
    mode ``auto`` becomes ``none`` (a copy: a mapped model dies with its file).
    ``limiter``: the budget shared by the loads (pass the same one to several apps to
    share it); default ``LoadLimiter()``. ``roots``: the directories whose files may be
    loaded, with those of the config's ``[server] roots``; a path beneath none gets 403.
    ``allow_any_path=True`` instead serves any file the process can read: only for a
    server that trusts every client. ``policy``: token, request keys, modes, limits and
    the remote names allowed, with those of the config's ``[server]`` (default:
    ``ServerPolicy()``, no token, nothing remote). A server that allows remote names
    needs no root: it then serves no local file.

    Raises ``ConfigError`` for a bad ``config``, ``ValueError`` when neither ``roots``,
    ``allow_any_path`` nor a remote name is allowed, or for a bad ``[server]`` remote
    setting, ``LoadError`` for a root that is not a directory.
    """
    base = server_base_config(load_config(config))
    policy = policy if policy is not None else ServerPolicy()
    remote = policy.remote.merged(RemoteAccess.from_config(base.server))
    policy = dataclasses.replace(policy, remote=remote)
    all_roots = [*(os.fspath(r) for r in roots or ()), *base.server.roots]
    opener: FileOpener
    if all_roots:
        opener = RootedOpener(all_roots)
    elif allow_any_path:
        opener = AnyPathOpener()
    elif remote.enabled:
        opener = NoLocalFiles()
    else:
        raise ValueError(
            "create_app: give roots=[...] (directories clients may load from), "
            "allow_any_path=True, or a remote source in policy.remote"
        )
    middlewares: list[Any] = [json_errors_middleware]
    if policy.token is not None:
        middlewares.append(auth_middleware(policy.token))
    app = web.Application(middlewares=middlewares)
    registry = LoaderRegistry(base, limiter or LoadLimiter(), opener, policy)
    app[_REGISTRY] = registry
    app.cleanup_ctx.append(_lifecycle)
    app.on_shutdown.append(_on_shutdown)
    app.router.add_post("/models", _post_model)
    app.router.add_get("/models", _list_models)
    app.router.add_get("/models/{id}", _get_model)
    app.router.add_get("/models/{id}/events", _model_events)
    app.router.add_delete("/models/{id}", _delete_model)
    app.router.add_get("/healthz", _healthz, name=HEALTH_ROUTE)
    app.router.add_get("/", status_page, name=STATUS_ROUTE)
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
    on_stopping: Callable[[int], None] | None = None,
    socket_path: str | None = None,
    attach: AttachAccess | None = None,
    http: bool = True,
) -> int | None:
    """Serve ``app`` until SIGINT or SIGTERM (or cancellation), then shut it down:
    every load cancelled, every model closed, every connection closed, within about
    1.3 s. ``on_started`` gets the bound addresses; ``on_stopping`` the signal, as the
    shutdown begins. Returns that signal (None when cancelled).

    Before it listens, the soft ``RLIMIT_NOFILE`` is raised to the hard limit and the
    connection cap set (``policy.max_connections``, by default a quarter of that limit,
    at most 512): a new connection past the cap closes the oldest one still silent (no
    whole request head), or gets 503; a request's head must arrive within
    ``policy.request_timeout_s`` of connecting or of the last reply. Then the process is
    warmed up for the app's configuration (devices found, staging pools filled): CUDA's
    start-up holds the GIL for part of its time, which no client should wait behind.

    ``socket_path``: also listen there for attach requests (``aiogguf.attach``; who may
    attach besides this uid: ``attach``), bound before HTTP; ``http=False``: the socket
    only (``on_started`` then gets no address)."""
    registry = registry_of(app)
    limit = raise_descriptor_limit()
    guard = ConnectionGuard(registry.policy.max_connections or default_max_connections(limit))
    registry.connection_count = lambda: guard.count
    await warm_up(registry.config)
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=_REPLY_GRACE_S)
    await runner.setup()
    received: int | None = None
    # The attach socket, bound before HTTP; closed after the models (which tell the
    # clients attached to them), outside the shield: its task group is not inside it.
    attach_socket = contextlib.AsyncExitStack()
    try:
        if socket_path is not None:
            listener = AttachListener(registry, socket_path, attach)
            await attach_socket.enter_async_context(listener.running())
            # Its connections hold descriptors too: a load's room is counted past them.
            registry.connection_count = lambda: guard.count + listener.connections
        site = GuardedSite(
            runner,
            host,
            port,
            guard,
            # aiohttp's keep-alive timer runs from the connection's start and from each
            # reply, and partial bytes do not reset it: the deadline for a request's head.
            keepalive_timeout=registry.policy.request_timeout_s,
        )
        if http:
            await site.start()
        if on_started is not None:
            on_started(runner.addresses)
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                received = int(signum)
                break
        if on_stopping is not None and received is not None:
            on_stopping(received)
    finally:
        with anyio.CancelScope(shield=True):
            await runner.cleanup()
            guard.close_all()
        await attach_socket.aclose()
    return received
