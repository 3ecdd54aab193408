"""The server's side of attach: a Unix socket beside (or instead of) HTTP, over which
processes of the users it allows map its resident models (``aiogguf.attach``; the
protocol is ``aiogguf.resident._protocol``, docs/server.md "Attach").

* ``bind_socket``: the socket made safely: in a folder no one else may write to (unless
  sticky), never over a file that is not a stale socket of ours, ``0600`` from the
  moment it exists (umask while binding, then checked).
* ``AttachAccess``: who may attach besides the server's own uid, by user or group; each
  peer is checked (``SO_PEERCRED``, ``SO_PEERGROUPS``) before a byte is read from it.
* ``AttachListener``: accepts connections, finds or loads the model each asks for (the
  registry's ``same_load`` or ``submit``), sends progress, then the model's share, and
  holds the registry's lease while the connection lives.
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
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
from anyio.abc import TaskGroup

from aiogguf.errors import AttachError, GGUFError
from aiogguf.io.workers import LoadThreads
from aiogguf.resident._protocol import (
    MAX_FDS,
    VERSION,
    PeerGone,
    ProtocolError,
    receive_request,
    send_message,
)
from aiogguf.resident._share import share_model
from aiogguf.server._policy import RequestRefused, exception_line, one_line
from aiogguf.server._requests import prepare_body
from aiogguf.server._transport import default_max_connections, descriptor_limit

if TYPE_CHECKING:
    from aiogguf.server._app import LoaderRegistry
    from aiogguf.server._entry import _Entry

__all__ = ["AttachAccess", "AttachListener", "bind_socket", "peer_credentials"]

logger: logging.Logger = logging.getLogger("aiogguf.server._app")

# A waiting client hears from the server at least this often (a load queued behind
# others has nothing new to say), and at most this often while the load moves.
_KEEPALIVE_S = 5.0
_PROGRESS_EVERY_S = 0.2
# The server's last word to a client (a refusal, an unload) waits no longer than this.
_LAST_WORD_S = 1.0
# How long a shutdown lets attached clients hear that their model is going.
_CLOSE_GRACE_S = 0.3
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux >= 4.13


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


class _Refusal(Exception):
    """What to tell a client before closing its connection."""


class AttachListener:
    """Serves attach requests for ``registry`` on the socket bound at ``path``.

    ``async with AttachListener(registry, path, access) as listener:`` binds (blocking,
    at once), accepts connections in a task group until the block ends, then tells
    attached clients, waits ``_CLOSE_GRACE_S`` at most, cancels them and removes the
    socket (if it is still the one bound)."""

    def __init__(
        self, registry: LoaderRegistry, path: str, access: AttachAccess | None = None
    ) -> None:
        self.registry = registry
        self.path = os.path.abspath(path)
        self.access = access if access is not None else AttachAccess()
        self.connections = 0
        self.max_connections = registry.policy.max_connections or default_max_connections(
            descriptor_limit()
        )
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
        """Bound and serving while the block runs; on exit, every connection ends.

        A server others attach to loads shareable (``[load] shareable``), so that a model
        posted over HTTP can be attached by id (a request may still ask for a plain load,
        which no client can attach to)."""
        registry = self.registry
        if not registry.config.load.shareable:
            registry.config = registry.config.with_settings({"shareable": True})
        async with self, anyio.create_task_group() as tg:
            tg.start_soon(self.serve)
            try:
                yield self
            finally:
                # Attached clients hear that the server stops; a client that is still
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
            if self.connections >= self.max_connections:
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
                raise _Refusal(refusal)
            try:
                request = await receive_request(conn, self.registry.policy.request_timeout_s)
            except TimeoutError:
                raise _Refusal("no whole request in time") from None
            entry = await self._find(conn, request)
            await self._hold(conn, entry)
        except PeerGone:
            return
        except (ProtocolError, _Refusal) as exc:
            with contextlib.suppress(ProtocolError, TimeoutError, OSError):
                await send_message(
                    conn, {"type": "error", "error": one_line(str(exc))}, (), _LAST_WORD_S
                )
        except TimeoutError:
            return  # a client that does not read what it is sent

    async def _find(self, conn: socket.socket, request: dict[str, Any]) -> _Entry:
        """The entry the client asked for, loaded (its progress sent meanwhile)."""
        registry = self.registry
        if request.get("version") != VERSION:
            raise _Refusal(f"protocol version {VERSION} expected")
        unknown = sorted(set(request) - {"version", "id", "path", "config"})
        if unknown:
            raise _Refusal(f"unknown field {unknown[0]!r}")
        if "id" in request:
            load_id = request["id"]
            entry = registry.entries.get(load_id) if isinstance(load_id, str) else None
            if entry is None:
                raise _Refusal(f"no model with id {load_id!r}"[:200])
        else:
            if not registry.accepting:
                raise _Refusal("the server is shutting down")
            body: dict[str, Any] = {k: request[k] for k in ("path", "config") if k in request}
            # What a client attaches to must be shareable: asked for here, so that a
            # client need not know (a config that is no object is refused below).
            if isinstance(body.get("config", {}), dict):
                body["config"] = {"shareable": True, **body.get("config", {})}
            try:
                parsed = await prepare_body(body, registry)
            except RequestRefused as exc:
                raise _Refusal(exc.reason) from None
            found = registry.same_load(parsed)
            if found is not None:
                parsed.opener.close()
                entry = found
            else:
                try:
                    entry = registry.submit(parsed)
                except (RequestRefused, RuntimeError) as exc:
                    parsed.opener.close()
                    raise _Refusal(str(exc)) from None
        await self._until_loaded(conn, entry)
        return entry

    async def _until_loaded(self, conn: socket.socket, entry: _Entry) -> None:
        from aiogguf.server._app import LoadState

        sent = -_KEEPALIVE_S
        while True:
            changed = entry.changed  # taken before the state is looked at: no news lost
            if entry.state is not LoadState.LOADING:
                break
            # Every change wakes this loop; the client hears of them at most this often.
            if time.monotonic() - sent >= _PROGRESS_EVERY_S:
                await send_message(conn, {"type": "progress", **_progress(entry)})
                sent = time.monotonic()
            with anyio.move_on_after(_KEEPALIVE_S):
                await changed.wait()
        if entry.state is not LoadState.READY or entry.model is None:
            raise _Refusal(
                f"model {entry.id} is {entry.state.value}: {entry.error or ''}".rstrip(": ")
            )

    async def _hold(self, conn: socket.socket, entry: _Entry) -> None:
        """Lease ``entry`` to the client until it goes, or the model does."""
        model = entry.model
        # Evicted, expired or unloaded, and not yet gone: no new lease on it.
        if model is None or entry.leaving or entry.unload.is_set():
            raise _Refusal(f"model {entry.id} is being unloaded")
        with self.registry.lease(entry):
            async with LoadThreads(1, name="aiogguf-attach") as threads:
                try:
                    share = await threads.run_sync(share_model, model)
                except GGUFError as exc:
                    raise _Refusal(exception_line(exc)) from None
            with share:
                if len(share.fds) > MAX_FDS:
                    raise _Refusal(f"the model needs {len(share.fds)} descriptors, over {MAX_FDS}")
                await send_message(
                    conn,
                    {
                        "type": "ready",
                        "id": entry.id,
                        "description": share.description.decode(),
                        "fds": len(share.fds),
                    },
                    share.fds,
                )
            assert self._stopping is not None
            ended = await _first_of(conn, entry, self._stopping)
            if ended is not None:
                with contextlib.suppress(ProtocolError, TimeoutError, OSError):
                    await send_message(conn, {"type": "ended", "reason": ended}, (), _LAST_WORD_S)


async def _first_of(conn: socket.socket, entry: _Entry, stopping: anyio.Event) -> str | None:
    """Wait until the client goes (None), or the model or the server does (why)."""
    outcome: list[str | None] = []

    async with anyio.create_task_group() as tg:

        async def client_gone() -> None:
            await anyio.wait_readable(conn)
            # EOF, a reset, or bytes the protocol does not allow: the lease ends.
            outcome.append(None)
            tg.cancel_scope.cancel()

        async def unloaded() -> None:
            await entry.unload.wait()
            outcome.append(f"model {entry.id} was unloaded by the server")
            tg.cancel_scope.cancel()

        async def finished() -> None:
            await entry.finished.wait()
            outcome.append(f"model {entry.id} ended on the server ({entry.state.value})")
            tg.cancel_scope.cancel()

        async def server_stops() -> None:
            await stopping.wait()
            outcome.append("the server is stopping")
            tg.cancel_scope.cancel()

        tg.start_soon(client_gone)
        tg.start_soon(server_stops)
        tg.start_soon(unloaded)
        tg.start_soon(finished)
    return outcome[0] if outcome else None


def _progress(entry: _Entry) -> dict[str, Any]:
    snapshot = entry.snapshot()
    keys = ("id", "state", "queued", "stage", "bytes_done", "bytes_total", "tensors_done")
    return {k: snapshot[k] for k in (*keys, "tensors_total", "message")}
