"""Engines on a node attach to that node's part: the node's loader serves its part on
a Unix socket of its own, with the attach server's listener
(``aiogguf.resident._listener``): the same protocol, socket rules (a private ``0700``
folder, a ``0600`` socket) and peer check (this uid only) as ``aiogguf serve
--socket``.

``NodeAttach`` is the listener's ``ModelSource`` and ``Resident`` at once: it holds one
model (the node's part), known by a random id made per load; a client asks for it by
that id (``aiogguf.attach(model_id, socket=path)``), never by path (a node loads only
what the driver tells it to). Closing it tells every attached client, in one line, that
the driver closed the model, then stops listening and removes the socket and folder.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import stat
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import anyio

from aiogguf._model import Model
from aiogguf.errors import AttachError
from aiogguf.resident._listener import AttachListener, Refused

__all__ = ["NodeAttach", "runtime_dir"]

# A client sends its request at once: it knows the id.
_REQUEST_TIMEOUT_S = 10.0
_MAX_CONNECTIONS = 256
# How long a close lets attached clients hear that the model goes (each is told at
# once; this bounds a client that does not read).
_TELL_S = 1.5


def runtime_dir() -> str:
    """Where a node's sockets go by default: ``$XDG_RUNTIME_DIR`` when it is this
    user's private folder, else the temporary folder."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        with contextlib.suppress(OSError):
            st = os.stat(runtime)
            if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
                return runtime
    return tempfile.gettempdir()


class NodeAttach:
    """Node ``node``'s part ``model``, served for attach in a private folder made under
    ``parent`` (None: ``runtime_dir()``). ``await start()`` binds (``AttachError`` when
    it cannot) and serves in a task of the actor's loop; ``await close()`` ends it."""

    def __init__(self, model: Model, node: str, parent: str | None = None) -> None:
        self.model = model
        self.node = node
        self.id = secrets.token_hex(16)
        self.leases = 0
        self.folder = ""
        self.path = ""
        self.parent = parent
        self._closing = anyio.Event()
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # ModelSource
    @property
    def request_timeout_s(self) -> float:
        return _REQUEST_TIMEOUT_S

    @property
    def max_connections(self) -> int:
        return _MAX_CONNECTIONS

    async def find(
        self,
        request: dict[str, Any],
        progress: Callable[[dict[str, Any]], Awaitable[None]],
    ) -> NodeAttach:
        if "id" not in request:
            raise Refused(f"node {self.node} serves its part of a cluster model only: attach by id")
        if request["id"] != self.id:
            raise Refused(f"node {self.node} holds no model with id {request['id']!r}"[:200])
        return self

    # Resident
    @contextlib.contextmanager
    def lease(self) -> Iterator[Model]:
        if self._closing.is_set():
            raise Refused(f"the cluster model is closing (node {self.node})")
        self.leases += 1
        try:
            yield self.model
        finally:
            self.leases -= 1

    async def gone(self) -> str:
        await self._closing.wait()
        return f"the cluster model was closed by its driver (node {self.node})"

    async def start(self) -> None:
        """Make the folder, bind the socket and serve. Raises ``AttachError``."""
        parent = self.parent if self.parent is not None else runtime_dir()
        try:
            self.folder = await anyio.to_thread.run_sync(
                lambda: tempfile.mkdtemp(prefix=f"aiogguf-{self.node[:16]}-", dir=parent)
            )
        except OSError as exc:
            raise AttachError(parent, None, f"cannot make a socket folder: {exc}") from exc
        self.path = os.path.join(self.folder, "model.sock")
        listener = AttachListener(self, self.path)
        bound = asyncio.Event()

        async def serve() -> None:
            async with listener.running():
                bound.set()
                await self._stop.wait()

        # The listener outlives the actor call that starts it (it serves until the
        # driver closes the model): a task of the actor's own loop, ended by ``close``.
        self._task = asyncio.get_running_loop().create_task(serve())
        waiter = asyncio.ensure_future(bound.wait())
        try:
            await asyncio.wait({self._task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if self._task.done():
            self._remove_folder()
            self._task.result()  # the bind's error

    async def close(self) -> None:
        """Tell attached clients the model goes (one line each), stop serving, remove
        the socket and its folder. Their mappings stay valid in their processes until
        they close them. Idempotent."""
        self._closing.set()
        with anyio.move_on_after(_TELL_S):
            while self.leases:  # noqa: ASYNC110  (bounded)
                await anyio.sleep(0.02)
        self._stop.set()
        task, self._task = self._task, None
        if task is not None:
            with contextlib.suppress(Exception), anyio.move_on_after(_TELL_S):
                await task
            task.cancel()
        self._remove_folder()

    def _remove_folder(self) -> None:
        if self.folder:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            with contextlib.suppress(OSError):
                os.rmdir(self.folder)
