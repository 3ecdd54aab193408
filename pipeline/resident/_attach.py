"""``aiogguf.attach``: a model resident in an ``aiogguf serve`` process, mapped into this
one over the server's Unix socket, without reading the file again.

``async with aiogguf.attach(model, socket=PATH) as m:`` asks the server for ``model`` (a
model id the server gave, or a path, with ``config`` overrides as ``POST /models``
takes them: the server finds the same load or starts it), waits while it loads, and
maps the memory the server shares. ``m`` is a ``Model`` like ``load``'s. While it is open
the server keeps the model (a lease); closing it, leaving the block or the process
ending releases the lease. The mapped memory stays valid if the server goes away.

The socket work is blocking and runs on the load's own threads; a cancelled attach
ends within a second.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterator, Mapping
from types import TracebackType
from typing import Any

from aiogguf._model import Model
from aiogguf._run import run
from aiogguf.errors import AttachError
from aiogguf.io.workers import LoadThreads
from aiogguf.resident._protocol import VERSION, Connection, PeerGone, ProtocolError
from aiogguf.resident._share import open_shared_model

__all__ = ["Attach", "attach", "attach_sync"]

# A server's model ids: 128 random bits in hex.
_MODEL_ID = re.compile(r"[0-9a-f]{32}")
# A server sends something (progress, or the same again) at least every 5 s while a
# model loads; silence for this long is a server that has stopped answering.
_IDLE_S = 30.0

ProgressCallback = Callable[[Mapping[str, Any]], None]


def _request(model: str | os.PathLike[str], config: Mapping[str, Any] | None) -> dict[str, Any]:
    if isinstance(model, str) and config is None and _MODEL_ID.fullmatch(model):
        return {"version": VERSION, "id": model}
    return {"version": VERSION, "path": os.path.abspath(model), "config": dict(config or {})}


def _connect(conn: Connection, path: str, model: str) -> None:
    try:
        conn.connect(path)
        return
    except FileNotFoundError:
        problem = "no such socket: is `aiogguf serve --socket` running?"
    except ConnectionRefusedError:
        problem = "no server listens on this socket"
    except PermissionError:
        problem = "permission denied: the socket is the server's user's (0600)"
    except OSError as exc:
        problem = f"cannot connect: {exc.strerror or exc}"
    raise AttachError(path, model, problem)


class Attach:
    """``async with aiogguf.attach(...) as model``: see ``attach``."""

    def __init__(
        self,
        model: str | os.PathLike[str],
        socket: str | os.PathLike[str],
        config: Mapping[str, Any] | None,
        progress: ProgressCallback | None,
    ) -> None:
        self._request = _request(model, config)
        self._name = os.fspath(model)
        self._socket = os.path.abspath(socket)
        self._progress = progress
        self._model: Model | None = None
        self._conn: Connection | None = None
        self._ended: str | None = None

    async def __aenter__(self) -> Model:
        self._model = await self.open()
        return self._model

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        model, self._model = self._model, None
        if model is not None:
            await model.aclose()

    async def open(self) -> Model:
        """The attached model (the caller closes it: that ends the lease)."""
        async with LoadThreads(1, name="aiogguf-attach") as threads:
            conn = Connection.open()
            try:
                await threads.run_sync(
                    _connect, conn, self._socket, self._name, on_cancel=conn.abort
                )
                model = await self._converse(conn, threads)
            except ProtocolError as exc:
                conn.close()
                raise AttachError(self._socket, self._name, str(exc)) from None
            except BaseException:
                conn.close()
                raise
        # The lease is the connection: it ends when the model closes.
        model.on_close(conn.close)
        self._conn = conn
        return model

    def lease_ended(self) -> str | None:
        """Why the server ended this client's lease (the model unloaded there, the
        server stopping or gone), or None while it holds; looks without waiting. The
        mapped model stays valid either way, until it is closed here."""
        conn = self._conn
        if self._ended is None and conn is not None:
            try:
                while (message := conn.poll()) is not None:
                    if message.get("type") == "ended":
                        self._ended = _said(message.get("reason"))
                        break
            except ProtocolError as exc:
                self._ended = str(exc)
        return self._ended

    async def _converse(self, conn: Connection, threads: LoadThreads) -> Model:
        try:
            await threads.run_sync(conn.send, self._request, on_cancel=conn.abort)
        except PeerGone:
            # A server that refuses a peer closes without reading its request: its one
            # line may be waiting all the same.
            message, fds = await threads.run_sync(conn.receive, 1.0, on_cancel=conn.abort)
            _close(fds)
            if message.get("type") == "error":
                raise AttachError(self._socket, self._name, _said(message.get("error"))) from None
            raise
        while True:
            message, fds = await threads.run_sync(conn.receive, _IDLE_S, on_cancel=conn.abort)
            kind = message.get("type")
            if kind == "ready":
                return await self._open_shared(message, fds, threads)
            _close(fds)
            if kind == "progress":
                if self._progress is not None:
                    self._progress(message)
                continue
            if kind in ("error", "ended"):
                why = message.get("error", message.get("reason"))
                raise AttachError(self._socket, self._name, _said(why))
            raise ProtocolError("the server sent a message this client does not know")

    async def _open_shared(
        self, message: Mapping[str, Any], fds: list[int], threads: LoadThreads
    ) -> Model:
        description = message.get("description")
        if not isinstance(description, str) or len(fds) != message.get("fds"):
            _close(fds)
            raise ProtocolError("the server's answer does not describe a model")
        opened: list[Model] = []

        def open_it() -> None:
            opened.append(open_shared_model(description.encode(), fds))

        try:
            # Runs to its end even when cancelled: the model it made is closed here.
            await threads.run_sync(open_it)
        except BaseException:
            for model in opened:
                model.close()
            raise
        return opened[0]


def _said(text: object) -> str:
    """What the server said, on one line and bounded: its words are not trusted."""
    shown = " ".join(str(text).split())
    return shown[:300] if shown else "the server refused without saying why"


def _close(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def attach(
    model: str | os.PathLike[str],
    *,
    socket: str | os.PathLike[str],
    config: Mapping[str, Any] | None = None,
    progress: ProgressCallback | None = None,
) -> Attach:
    """Attach to ``model`` resident in the server listening on ``socket``:
    ``async with aiogguf.attach("m.gguf", socket="/run/aiogguf.sock") as model``.

    ``model``: a model id the server gave (32 hex digits, without ``config``), or a path
    (made absolute here) with ``config``, the overrides ``POST /models`` takes: the
    server serves the same load of that path, config and devices if it holds one, or
    starts it. ``progress`` gets the server's progress messages while it loads.

    The model is the server's memory, mapped copy-on-write: a write stays in this
    process. The server keeps it while the model is open here; ``model.close()`` (or
    leaving the block) ends that. Raises ``AttachError`` naming the socket and the
    model: no server, refused (another user, a path outside its roots), the load failed,
    or the server broke the protocol.
    """
    return Attach(model, socket, config, progress)


@contextlib.contextmanager
def attach_sync(
    model: str | os.PathLike[str],
    *,
    socket: str | os.PathLike[str],
    config: Mapping[str, Any] | None = None,
    progress: ProgressCallback | None = None,
) -> Iterator[Model]:
    """``with aiogguf.attach_sync(...) as model``: ``attach`` for code without a loop
    (runs its own, like ``load_sync``)."""
    handle = Attach(model, socket, config, progress)
    opened: Model = run(handle.open, name="attach_sync")
    try:
        yield opened
    finally:
        opened.close()
