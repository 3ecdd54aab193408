"""The serving side of attach, for whoever holds resident models: a Unix socket over
which processes of the users it allows map those models (``aiogguf.attach``; the
protocol is ``aiogguf.resident._protocol``, docs/server.md "Attach").

* ``bind_socket``: the socket made safely: in a folder no one else may write to (unless
  sticky), never over a file that is not a stale socket of ours, ``0600`` from the
  moment it exists (umask while binding, then checked).
* ``AttachAccess``: who may attach besides this process's uid, by user or group; each
  peer is checked (``SO_PEERCRED``, ``SO_PEERGROUPS``) before a byte is read from it.
* ``AttachListener``: accepts connections, asks its ``ModelSource`` for the model each
  names (the source sends progress meanwhile), sends the model's share, and holds the
  source's lease while the connection lives. Two sources exist: a server's registry
  (``aiogguf.server._attach``) and a cluster node's loader (``aiogguf.cluster``).
"""

from __future__ import annotations

import array
import contextlib
import errno
import grp
import logging
import os
import pwd
import socket
import stat
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
from anyio.abc import TaskGroup

from aiogguf._model import Model
from aiogguf.errors import AttachError, GGUFError
from aiogguf.io.workers import LoadThreads
from aiogguf.resident._protocol import (
    MAX_FDS,
    VERSION,
    PeerGone,
    ProtocolError,
    one_line,
    receive_request,
    send_message,
)
from aiogguf.resident._share import share_model

__all__ = [
    "AttachAccess",
    "AttachListener",
    "ModelSource",
    "Refused",
    "Resident",
    "bind_socket",
    "peer_credentials",
]

logger: logging.Logger = logging.getLogger("aiogguf.resident._listener")

# The listener's last word to a client (a refusal, an unload) waits no longer than this.
_LAST_WORD_S = 1.0
# How long a shutdown lets attached clients hear that their model is going.
_CLOSE_GRACE_S = 0.3
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux >= 4.13


class Refused(Exception):
    """What to tell a client (one line) before closing its connection."""


class Resident(Protocol):
    """A model a source found for a client."""

    @property
    def id(self) -> str:
        """The id a client attaches to it by."""
        ...

    def lease(self) -> AbstractContextManager[Model]:
        """The model, held for the client while the block runs; ``Refused`` when it is
        on its way out."""
        ...

    async def gone(self) -> str:
        """Return, saying why in one line, once the model goes (unloaded, closed)."""
        ...


class ModelSource(Protocol):
    """Where a listener finds the models clients ask for."""

    @property
    def request_timeout_s(self) -> float:
        """How long a client may take to send its whole request."""
        ...

    @property
    def max_connections(self) -> int:
        """Connections served at once; more are closed on accept."""
        ...

    async def find(
        self,
        request: dict[str, Any],
        progress: Callable[[dict[str, Any]], Awaitable[None]],
    ) -> Resident:
        """The model ``request`` names (``id``, or ``path`` and ``config``: the fields
        beside ``version``), loaded: ``progress`` sends the client a progress message
        meanwhile. ``Refused`` with the reason the client is told."""
        ...


@dataclass(frozen=True, slots=True)
class AttachAccess:
    """Who may attach besides the server's own uid: these uids, and processes with any
    of these gids among their groups."""

    uids: frozenset[int] = frozenset()
    gids: frozenset[int] = frozenset()

    @classmethod
    def from_names(cls, users: Iterable[str | int], groups: Iterable[str | int]) -> AttachAccess:
        """Users and groups by name or number; ``ValueError`` naming one that does not
        exist."""
        return cls(
            frozenset(_resolve(u, "user", lambda n: pwd.getpwnam(n).pw_uid) for u in users),
            frozenset(_resolve(g, "group", lambda n: grp.getgrnam(n).gr_gid) for g in groups),
        )

    @property
    def others(self) -> bool:
        """Whether anyone but the server's own uid may attach (the socket is then
        ``0666``, and the peer check alone keeps others out)."""
        return bool(self.uids or self.gids)

    def refusal(self, uid: int, gid: int, groups: Iterable[int]) -> str | None:
        """Why a peer of ``uid``/``gid``/``groups`` may not attach; None if it may."""
        if uid == os.geteuid() or uid in self.uids:
            return None
        if self.gids and (gid in self.gids or not self.gids.isdisjoint(groups)):
            return None
        return f"uid {uid} may not attach to this server (attach_users, attach_groups)"


def _resolve(name: str | int, kind: str, lookup: Any) -> int:
    if isinstance(name, int) or name.isdigit():
        return int(name)
    try:
        value: int = lookup(name)
    except KeyError:
        raise ValueError(f"attach: no {kind} named {name!r} on this machine") from None
    return value


def peer_credentials(sock: socket.socket, with_groups: bool) -> tuple[int, int, int, list[int]]:
    """The peer's pid, uid, gid (``SO_PEERCRED``: as it was when it connected) and, if
    ``with_groups``, its supplementary groups (``SO_PEERGROUPS``; empty where the kernel
    has none)."""
    creds = struct.Struct("3i")
    pid, uid, gid = creds.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, creds.size))
    groups = array.array("I")
    if with_groups:
        size = 256 * groups.itemsize
        while size <= 65536 * groups.itemsize:
            try:
                groups.frombytes(sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, size))
                break
            except OSError as exc:
                if exc.errno != errno.ERANGE:
                    break
                size *= 16
    return pid, uid, gid, list(groups)


def _refuse(path: str, problem: str) -> AttachError:
    return AttachError(path, None, problem)


def bind_socket(path: str, *, others: bool = False) -> socket.socket:
    """A listening, non-blocking Unix socket at ``path``: ``0600`` (``0666`` with
    ``others``: the peer check keeps the rest out). Blocking. Raises ``AttachError``
    for a folder others may write to (unless sticky), a file there that is not a
    socket, a socket of another user or one a server still listens on; a stale socket
    of ours is replaced."""
    path = os.path.abspath(path)
    if len(os.fsencode(path)) >= 108:
        raise _refuse(path, "a socket path must be shorter than 108 bytes")
    folder = os.path.dirname(path)
    try:
        st = os.stat(folder)
    except OSError as exc:
        raise _refuse(path, f"cannot use its folder: {exc.strerror or exc}") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(path, "its folder is not a directory")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        raise _refuse(
            path,
            f"its folder {folder} may be written by others (mode "
            f"{stat.S_IMODE(st.st_mode):04o}, not sticky): they could replace the socket",
        )
    try:
        old = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(old.st_mode):
            raise _refuse(path, "exists and is not a socket; refusing to replace it")
        if old.st_uid != os.geteuid():
            raise _refuse(path, f"a socket of uid {old.st_uid}; refusing to replace it")
        if _listening(path):
            raise _refuse(path, "another server listens on it")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        # The socket exists from ``bind`` on: with no permission for anyone else until
        # the server has checked it. (The umask is the process's: no other thread of the
        # server creates files while it starts.)
        mask = os.umask(0o177)
        try:
            sock.bind(path)
        finally:
            os.umask(mask)
        st = os.lstat(path)
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise _refuse(path, "the socket did not come out as this user's, mode 0600")
        if others:
            os.chmod(path, 0o666)
        sock.listen(128)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise _refuse(path, f"cannot listen: {exc.strerror or exc}") from exc
    except BaseException:
        sock.close()
        raise
    return sock


def _listening(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except OSError:
        return False
    finally:
        probe.close()
    return True


class AttachListener:
    """Serves attach requests for the models of ``source`` on the socket bound at ``path``.

    ``async with AttachListener(source, path, access).running():`` binds (blocking, at
    once), accepts connections in a task group until the block ends, then tells
    attached clients, waits ``_CLOSE_GRACE_S`` at most, cancels them and removes the
    socket (if it is still the one bound)."""

    def __init__(self, source: ModelSource, path: str, access: AttachAccess | None = None) -> None:
        self.source = source
        self.path = os.path.abspath(path)
        self.access = access if access is not None else AttachAccess()
        self.connections = 0
        self._sock: socket.socket | None = None
        self._inode: tuple[int, int] | None = None
        self._stopping: anyio.Event | None = None

    async def __aenter__(self) -> AttachListener:
        self._stopping = anyio.Event()
        self._sock = bind_socket(self.path, others=self.access.others)
        st = os.lstat(self.path)
        self._inode = (st.st_dev, st.st_ino)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop listening and remove the socket file if it is still ours."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        with contextlib.suppress(OSError):
            st = os.lstat(self.path)
            if (st.st_dev, st.st_ino) == self._inode:
                os.unlink(self.path)

    async def serve(self) -> None:
        """Accept and serve connections until cancelled."""
        sock = self._sock
        assert sock is not None, "enter the listener first"
        async with anyio.create_task_group() as tg:
            await self._accept(sock, tg)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[AttachListener]:
        """Bound and serving while the block runs; on exit, every connection ends."""
        async with self, anyio.create_task_group() as tg:
            tg.start_soon(self.serve)
            try:
                yield self
            finally:
                # Attached clients hear that the listener stops; a client that is still
                # being served is cut off past the grace.
                if self._stopping is not None:
                    self._stopping.set()
                with anyio.CancelScope(shield=True), anyio.move_on_after(_CLOSE_GRACE_S):
                    while self.connections:  # noqa: ASYNC110  (bounded by the grace)
                        await anyio.sleep(0.02)
                tg.cancel_scope.cancel()

    async def _accept(self, sock: socket.socket, tg: TaskGroup) -> None:
        while True:
            await anyio.wait_readable(sock)
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                continue
            except OSError as exc:  # out of descriptors: leave the backlog a moment
                logger.warning("attach socket %s: accept failed: %s", self.path, exc)
                await anyio.sleep(0.1)
                continue
            conn.setblocking(False)
            if self.connections >= self.source.max_connections:
                conn.close()
                continue
            self.connections += 1
            tg.start_soon(self._serve_one, conn)

    async def _serve_one(self, conn: socket.socket) -> None:
        try:
            with conn:
                await self._conversation(conn)
        except Exception:
            # A bug, not a client: logged, and the other connections go on.
            logger.exception("attach socket %s: a connection failed", self.path)
        finally:
            self.connections -= 1

    async def _conversation(self, conn: socket.socket) -> None:
        try:
            _pid, uid, gid, groups = peer_credentials(conn, bool(self.access.gids))
            refusal = self.access.refusal(uid, gid, groups)
            if refusal is not None:
                raise Refused(refusal)
            try:
                request = await receive_request(conn, self.source.request_timeout_s)
            except TimeoutError:
                raise Refused("no whole request in time") from None
            if request.get("version") != VERSION:
                raise Refused(f"protocol version {VERSION} expected")
            unknown = sorted(set(request) - {"version", "id", "path", "config"})
            if unknown:
                raise Refused(f"unknown field {unknown[0]!r}")

            async def progress(message: dict[str, Any]) -> None:
                await send_message(conn, {"type": "progress", **message})

            resident = await self.source.find(request, progress)
            await self._hold(conn, resident)
        except PeerGone:
            return
        except (ProtocolError, Refused) as exc:
            with contextlib.suppress(ProtocolError, TimeoutError, OSError):
                await send_message(
                    conn, {"type": "error", "error": one_line(str(exc))}, (), _LAST_WORD_S
                )
        except TimeoutError:
            return  # a client that does not read what it is sent

    async def _hold(self, conn: socket.socket, resident: Resident) -> None:
        """Lease ``resident`` to the client until it goes, or the model does."""
        with resident.lease() as model:
            async with LoadThreads(1, name="aiogguf-attach") as threads:
                try:
                    share = await threads.run_sync(share_model, model)
                except GGUFError as exc:
                    raise Refused(_exception_line(exc)) from None
            with share:
                if len(share.fds) > MAX_FDS:
                    raise Refused(f"the model needs {len(share.fds)} descriptors, over {MAX_FDS}")
                await send_message(
                    conn,
                    {
                        "type": "ready",
                        "id": resident.id,
                        "description": share.description.decode(),
                        "fds": len(share.fds),
                    },
                    share.fds,
                )
            assert self._stopping is not None
            ended = await _first_of(conn, resident, self._stopping)
            if ended is not None:
                with contextlib.suppress(ProtocolError, TimeoutError, OSError):
                    await send_message(conn, {"type": "ended", "reason": ended}, (), _LAST_WORD_S)


def _exception_line(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


async def _first_of(conn: socket.socket, resident: Resident, stopping: anyio.Event) -> str | None:
    """Wait until the client goes (None), or the model or the listener does (why)."""
    outcome: list[str | None] = []

    async with anyio.create_task_group() as tg:

        async def client_gone() -> None:
            await anyio.wait_readable(conn)
            # EOF, a reset, or bytes the protocol does not allow: the lease ends.
            outcome.append(None)
            tg.cancel_scope.cancel()

        async def model_gone() -> None:
            outcome.append(await resident.gone())
            tg.cancel_scope.cancel()

        async def listener_stops() -> None:
            await stopping.wait()
            outcome.append("the server is stopping")
            tg.cancel_scope.cancel()

        tg.start_soon(client_gone)
        tg.start_soon(listener_stops)
        tg.start_soon(model_gone)
    return outcome[0] if outcome else None
