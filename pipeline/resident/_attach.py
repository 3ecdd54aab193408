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
from collections.abc import Callable, Generator, Iterator, Mapping
from functools import partial
from types import TracebackType
from typing import Any

from aiogguf._model import Model
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
        self._made: list[Model] = []  # the model the conversation mapped

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
        """The attached model (the caller closes it: that ends the lease). The socket
        work runs on a thread of the load's own; the progress callback on the loop's."""
        async with LoadThreads(1, name="aiogguf-attach") as threads:
            conn = Connection.open()

            steps = self._conversation(conn)
            with self._failing(conn):
                outcome: Any = None
                failure: Exception | None = None
                while (call := _advance(steps, outcome, failure)) is not None:
                    outcome, failure = None, None
                    try:
                        outcome = await threads.run_sync(call, on_cancel=conn.abort)
                    except Exception as exc:  # for the conversation to handle, or raise
                        failure = exc
        return self._leased(conn)

    def open_blocking(self) -> Model:
        """``open`` on the calling thread, with no loop and no thread of its own: what
        ``attach_sync`` does (a fresh process attaches in a few milliseconds, and a
        loop and a thread would be a third of them)."""
        conn = Connection.open()
        steps = self._conversation(conn)
        with self._failing(conn):
            outcome: Any = None
            failure: Exception | None = None
            while (call := _advance(steps, outcome, failure)) is not None:
                outcome, failure = None, None
                try:
                    outcome = call()
                except Exception as exc:  # for the conversation to handle, or raise
                    failure = exc
        return self._leased(conn)

    @contextlib.contextmanager
    def _failing(self, conn: Connection) -> Iterator[None]:
        """A failed conversation closes the connection and any model it mapped (one
        mapped while the attach was cancelled); a broken protocol is an AttachError."""
        try:
            yield
            if len(self._made) != 1:
                raise ProtocolError("the server's answer does not describe a model")
        except BaseException as exc:
            for made in self._made:
                made.close()
            conn.close()
            if isinstance(exc, ProtocolError):
                raise AttachError(self._socket, self._name, str(exc)) from None
            raise

    def _leased(self, conn: Connection) -> Model:
        # The lease is the connection: it ends when the model closes.
        model = self._made[0]
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

    def _conversation(self, conn: Connection) -> Generator[Callable[[], Any], Any, None]:
        """The client's side of the protocol, without I/O of its own: it yields each
        blocking call (connect, send, receive, map) and is sent its result or thrown
        its exception, so that ``open`` runs the calls on a thread and ``open_blocking``
        on the caller's, through the same steps."""
        yield partial(_connect, conn, self._socket, self._name)
        try:
            yield partial(conn.send, self._request)
        except PeerGone:
            # A server that refuses a peer closes without reading its request: its one
            # line may be waiting all the same.
            message, fds = yield partial(conn.receive, 1.0)
            _close(fds)
            if message.get("type") == "error":
                raise AttachError(self._socket, self._name, _said(message.get("error"))) from None
            raise
        while True:
            message, fds = yield partial(conn.receive, _IDLE_S)
            kind = message.get("type")
            if kind == "ready":
                description = message.get("description")
                if not isinstance(description, str) or len(fds) != message.get("fds"):
                    _close(fds)
                    raise ProtocolError("the server's answer does not describe a model")
                yield partial(_open_shared, description, fds, self._made)
                return
            _close(fds)
            if kind == "progress":
                if self._progress is not None:
                    self._progress(message)
                continue
            if kind in ("error", "ended"):
                why = message.get("error", message.get("reason"))
                raise AttachError(self._socket, self._name, _said(why))
            raise ProtocolError("the server sent a message this client does not know")


def _open_shared(description: str, fds: list[int], made: list[Model]) -> None:
    """The shared model mapped here, into ``made`` (kept even if the caller was cancelled
    meanwhile, to be closed); ``open_shared_model`` takes the descriptors."""
    made.append(open_shared_model(description.encode(), fds))


def _advance(
    steps: Generator[Callable[[], Any], Any, None], outcome: Any, failure: Exception | None
) -> Callable[[], Any] | None:
    """The conversation's next blocking call, given the last one's outcome or failure;
    None once it has ended."""
    try:
        return steps.send(outcome) if failure is None else steps.throw(failure)
    except StopIteration:
        return None


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
    """``with aiogguf.attach_sync(...) as model``: ``attach`` for code without a loop,
    on the calling thread (no loop, no thread: ``Attach.open_blocking``)."""
    opened = Attach(model, socket, config, progress).open_blocking()
    try:
        yield opened
    finally:
        opened.close()
