"""The server's side of attach: its Unix socket (``aiogguf.resident._listener``'s
listener) over its registry's models.

* ``RegistrySource``: the listener's ``ModelSource`` over a ``LoaderRegistry``: a model
  by id, or a path and config that the registry finds (``same_load``) or loads
  (``submit``), with the load's progress sent meanwhile; a lease is the registry's.
* ``AttachListener``: the listener over a registry; ``running()`` makes the registry's
  loads shareable.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

import anyio

from aiogguf._model import Model
from aiogguf.resident._listener import (
    AttachAccess,
    Refused,
    bind_socket,
    peer_credentials,
)
from aiogguf.resident._listener import AttachListener as _Listener
from aiogguf.server._policy import RequestRefused
from aiogguf.server._requests import prepare_body
from aiogguf.server._transport import default_max_connections, descriptor_limit

if TYPE_CHECKING:
    from aiogguf.server._app import LoaderRegistry
    from aiogguf.server._entry import _Entry

__all__ = ["AttachAccess", "AttachListener", "RegistrySource", "bind_socket", "peer_credentials"]

# A waiting client hears from the server at least this often (a load queued behind
# others has nothing new to say), and at most this often while the load moves.
_KEEPALIVE_S = 5.0
_PROGRESS_EVERY_S = 0.2


class _EntryResident:
    """A registry entry as the listener holds it."""

    def __init__(self, registry: LoaderRegistry, entry: _Entry) -> None:
        self.registry = registry
        self.entry = entry

    @property
    def id(self) -> str:
        return self.entry.id

    @contextlib.contextmanager
    def lease(self) -> Iterator[Model]:
        entry = self.entry
        model = entry.model
        # Evicted, expired or unloaded, and not yet gone: no new lease on it.
        if model is None or entry.leaving or entry.unload.is_set():
            raise Refused(f"model {entry.id} is being unloaded")
        with self.registry.lease(entry):
            yield model

    async def gone(self) -> str:
        entry = self.entry
        why: list[str] = []
        async with anyio.create_task_group() as tg:

            async def unloaded() -> None:
                await entry.unload.wait()
                why.append(f"model {entry.id} was unloaded by the server")
                tg.cancel_scope.cancel()

            async def finished() -> None:
                await entry.finished.wait()
                why.append(f"model {entry.id} ended on the server ({entry.state.value})")
                tg.cancel_scope.cancel()

            tg.start_soon(unloaded)
            tg.start_soon(finished)
        return why[0]


class RegistrySource:
    """The models of ``registry``, for a listener."""

    def __init__(self, registry: LoaderRegistry) -> None:
        self.registry = registry
        self.max_connections = registry.policy.max_connections or default_max_connections(
            descriptor_limit()
        )

    @property
    def request_timeout_s(self) -> float:
        return self.registry.policy.request_timeout_s

    async def find(
        self,
        request: dict[str, Any],
        progress: Callable[[dict[str, Any]], Awaitable[None]],
    ) -> _EntryResident:
        """The entry the client asked for, loaded (its progress sent meanwhile)."""
        registry = self.registry
        if "id" in request:
            load_id = request["id"]
            entry = registry.entries.get(load_id) if isinstance(load_id, str) else None
            if entry is None:
                raise Refused(f"no model with id {load_id!r}"[:200])
        else:
            if not registry.accepting:
                raise Refused("the server is shutting down")
            body: dict[str, Any] = {k: request[k] for k in ("path", "config") if k in request}
            # What a client attaches to must be shareable: asked for here, so that a
            # client need not know (a config that is no object is refused below).
            if isinstance(body.get("config", {}), dict):
                body["config"] = {"shareable": True, **body.get("config", {})}
            try:
                parsed = await prepare_body(body, registry)
            except RequestRefused as exc:
                raise Refused(exc.reason) from None
            try:
                entry, _ = registry.admit(parsed)
            except (RequestRefused, RuntimeError) as exc:
                raise Refused(str(exc)) from None
        await _until_loaded(entry, progress)
        return _EntryResident(registry, entry)


async def _until_loaded(
    entry: _Entry, progress: Callable[[dict[str, Any]], Awaitable[None]]
) -> None:
    from aiogguf.server._app import LoadState

    sent = -_KEEPALIVE_S
    while True:
        changed = entry.changed  # taken before the state is looked at: no news lost
        if entry.state is not LoadState.LOADING:
            break
        # Every change wakes this loop; the client hears of them at most this often.
        if time.monotonic() - sent >= _PROGRESS_EVERY_S:
            await progress(_progress(entry))
            sent = time.monotonic()
        with anyio.move_on_after(_KEEPALIVE_S):
            await changed.wait()
    if entry.state is not LoadState.READY or entry.model is None:
        raise Refused(f"model {entry.id} is {entry.state.value}: {entry.error or ''}".rstrip(": "))


def _progress(entry: _Entry) -> dict[str, Any]:
    snapshot = entry.snapshot()
    keys = ("id", "state", "queued", "stage", "bytes_done", "bytes_total", "tensors_done")
    return {k: snapshot[k] for k in (*keys, "tensors_total", "message")}


class AttachListener(_Listener):
    """The listener over ``registry``'s models (``RegistrySource``)."""

    def __init__(
        self, registry: LoaderRegistry, path: str, access: AttachAccess | None = None
    ) -> None:
        super().__init__(RegistrySource(registry), path, access)
        self.registry = registry
        self.max_connections = self.source.max_connections

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[AttachListener]:
        """Bound and serving while the block runs; on exit, every connection ends.

        A server others attach to loads shareable (``[load] shareable``), so that a model
        posted over HTTP can be attached by id (a request may still ask for a plain load,
        which no client can attach to)."""
        registry = self.registry
        if not registry.config.load.shareable:
            registry.config = registry.config.with_settings({"shareable": True})
        async with super().running():
            yield self
