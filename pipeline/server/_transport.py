"""What ``aiogguf.server._app.serve`` puts between its listening socket and aiohttp, so that
no client, however slow or numerous, can take the server's descriptors or its log.

* ``ConnectionGuard``: at most ``max_connections`` open connections. A new one beyond
  the cap closes the oldest connection that has not yet sent a whole request head (a
  slow or idle client), or, when every connection is busy with a request, is answered
  ``503`` in JSON and closed. A client that trickles its headers one byte at a time
  therefore holds a slot only until someone else needs it, and never past
  ``request_timeout_s`` (aiohttp's keep-alive timer, which runs from the moment a
  connection is made or its last reply was sent and is not reset by partial bytes, is
  that deadline here).
* ``GuardedHandler``: aiohttp's ``RequestHandler`` with the guard's bookkeeping, and its
  own replies (a header over 8,190 bytes, a bad request line) in JSON, logged in one line.
* ``GuardedSite``: a TCP site whose connections are made by ``GuardedHandler``.
* Descriptors: ``raise_descriptor_limit`` (the soft ``RLIMIT_NOFILE`` up to the hard one)
  and ``DescriptorBudget``, which keeps a reserve for connections that loads may not take.

aiohttp has no header timeout of its own and no hook for its parser's error replies
other than ``RequestHandler.handle_error``: both are done here, at the protocol.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, cast

from aiohttp import web
from aiohttp.web_request import BaseRequest

__all__ = [
    "ConnectionGuard",
    "DescriptorBudget",
    "GuardedHandler",
    "GuardedSite",
    "default_max_connections",
    "open_descriptors",
    "raise_descriptor_limit",
]

logger: logging.Logger = logging.getLogger("aiogguf.server._app")

# Descriptors the server uses besides connections and loads: the listening sockets,
# epoll, the loop's wake-up pipe, stdio, logs, CUDA's own.
_SERVER_OWN_FDS = 32
# The listen backlog: connections the kernel completes while the loop is busy (past it,
# a connect's SYN is dropped and the client waits a second to send it again), and those
# it hands over per accept wake-up, which hold a descriptor each until the guard has
# closed the ones over the cap. (The kernel caps it at net.core.somaxconn.)
ACCEPT_BACKLOG = 512


def raise_descriptor_limit() -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit; the new soft limit.

    The default soft limit (often 1,024) is far below what the kernel allows a process
    (the hard limit), and every connection and every mapped model needs one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        # "Unlimited" is refused by setrlimit beyond fs.nr_open: ask for that instead.
        try:
            with open("/proc/sys/fs/nr_open") as f:
                hard = int(f.read())
        except (OSError, ValueError):
            return soft
    if soft == resource.RLIM_INFINITY or soft >= hard:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (OSError, ValueError):
        return soft
    return hard


def descriptor_limit() -> int:
    """The soft ``RLIMIT_NOFILE``: how many descriptors this process may hold."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def open_descriptors() -> int | None:
    """How many descriptors this process holds now (None where ``/proc`` is absent)."""
    try:
        # The listing holds one descriptor of its own while it runs.
        return len(os.listdir("/proc/self/fd")) - 1
    except OSError:
        return None


def default_max_connections(limit: int) -> int:
    """The connection cap for a process that may hold ``limit`` descriptors: a quarter
    of them, at least 16 and at most 512 (a load server has few clients)."""
    return max(16, min(512, limit // 4))


@dataclass(frozen=True, slots=True)
class DescriptorBudget:
    """Descriptors loads may take: ``limit`` less ``reserve``, which is kept for serving
    (every connection the guard allows, a listen backlog, the server's own)."""

    limit: int
    reserve: int

    @classmethod
    def for_connections(cls, max_connections: int, limit: int | None = None) -> DescriptorBudget:
        """The budget of a server that takes ``max_connections`` connections, out of
        ``limit`` descriptors (the process's limit if ``None``)."""
        limit = descriptor_limit() if limit is None else limit
        return cls(limit, max_connections + ACCEPT_BACKLOG + _SERVER_OWN_FDS)

    def room(self, connections: int) -> int | None:
        """Descriptors a new load may still take, with ``connections`` open now (they
        are inside the reserve); None when the count cannot be read."""
        held = open_descriptors()
        if held is None:
            return None
        return self.limit - self.reserve - max(held - connections, 0)


class ConnectionGuard:
    """The open connections of one server and the cap on them (see the module)."""

    def __init__(self, max_connections: int) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self.max_connections = max_connections
        self._open: set[GuardedHandler] = set()
        # Connections without a whole request head yet, oldest first: the ones to close
        # when a new connection needs a slot.
        self._silent: OrderedDict[GuardedHandler, asyncio.Transport] = OrderedDict()
        self.evicted: int = 0
        self.refused: int = 0

    @property
    def count(self) -> int:
        return len(self._open)

    def admit(self, handler: GuardedHandler, transport: asyncio.Transport) -> bool:
        """Take ``handler``'s connection in, closing the oldest silent one to make room;
        False (the caller answers 503 and closes) when every slot is busy."""
        if len(self._open) >= self.max_connections:
            if not self._silent:
                self.refused += 1
                return False
            oldest, old_transport = self._silent.popitem(last=False)
            self._open.discard(oldest)
            self.evicted += 1
            old_transport.abort()
        self._open.add(handler)
        self._silent[handler] = transport
        return True

    def heard(self, handler: GuardedHandler) -> None:
        """``handler`` has sent a whole request head: busy, not to be closed for room."""
        self._silent.pop(handler, None)

    def idle(self, handler: GuardedHandler, transport: asyncio.Transport) -> None:
        """``handler`` has been answered and waits for its next request (keep-alive)."""
        if handler in self._open:
            self._silent[handler] = transport
            self._silent.move_to_end(handler)

    def forget(self, handler: GuardedHandler) -> None:
        self._open.discard(handler)
        self._silent.pop(handler, None)

    def close_all(self) -> None:
        """Abort every connection (shutdown, past its grace)."""
        for handler in list(self._open):
            transport = handler.transport
            if transport is not None:
                transport.abort()
        self._open.clear()
        self._silent.clear()


_BUSY_REPLY = (
    b"HTTP/1.1 503 Service Unavailable\r\n"
    b"Content-Type: application/json; charset=utf-8\r\n"
    b"Connection: close\r\n"
)
_BUSY_BODY = json.dumps({"error": "too many open connections; try again later"}).encode()
_HEAD_END = b"\r\n\r\n"
# How long a connection refused for want of a slot stays, for the client to read its 503.
_REFUSED_LINGER_S = 0.2


def _one_line(text: str, limit: int = 200) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


class GuardedHandler(web.RequestHandler):
    """aiohttp's connection handler, counted by a ``ConnectionGuard``, whose own error
    replies are JSON and whose log lines carry no client-made traceback."""

    __slots__ = ("_guard", "_heard", "_refused", "_tail")

    def __init__(self, manager: web.Server, *, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = guard
        self._heard = False
        self._tail = b""
        self._refused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not subclasses of asyncio's: cast, as aiohttp does.
        transport = cast(asyncio.Transport, transport)
        if not self._guard.admit(self, transport):
            self._refused = True
            transport.write(
                _BUSY_REPLY + f"Content-Length: {len(_BUSY_BODY)}\r\n\r\n".encode() + _BUSY_BODY
            )
            # Closing now, with the client's request unread, would send a reset that can
            # overtake the reply: half-close, read and drop what comes, and end the
            # connection when the client does (aiohttp's eof_received lets the transport
            # close), or after a moment.
            if transport.can_write_eof():
                transport.write_eof()
            asyncio.get_running_loop().call_later(_REFUSED_LINGER_S, transport.abort)
            return
        super().connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if not self._heard:
            # The end of a request head may straddle two reads: keep its last 3 bytes.
            seen = self._tail + data
            if _HEAD_END in seen:
                self._heard = True
                self._tail = b""
                self._guard.heard(self)
            else:
                self._tail = seen[-3:]
        super().data_received(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._guard.forget(self)
        if self._refused:
            return
        super().connection_lost(exc)

    def log_access(
        self, request: BaseRequest, response: web.StreamResponse, time: float | None
    ) -> None:
        super().log_access(request, response, time)
        # Replied: the connection waits for its next request, and may make room again.
        # (Bytes of that next request already read count from here, as silence.)
        self._heard = False
        self._tail = b""
        if self.transport is not None:
            self._guard.idle(self, self.transport)

    def log_exception(self, *args: Any, **kw: Any) -> None:
        # aiohttp logs a client's malformed request with its traceback: one line here,
        # the traceback only when the logger is at DEBUG (``aiogguf serve --debug``).
        exc = kw.pop("exc_info", None)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(*args, exc_info=exc, **kw)
            return
        message = args[0] % args[1:] if len(args) > 1 else (args[0] if args else "")
        if isinstance(exc, BaseException):
            message = f"{message}: {type(exc).__name__}: {_one_line(str(exc))}"
        logger.warning("%s", _one_line(str(message), 400))

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp's reply to a request it could not parse or handle, as JSON."""
        self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
        if request.writer.output_size > 0:
            raise ConnectionError("a reply was under way; the connection is closed instead")
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = "error"
        reason = _one_line(message or "") if status < 500 else ""
        response = web.json_response(
            {"error": f"{phrase}: {reason}" if reason else phrase}, status=status
        )
        response.force_close()
        return response


class GuardedSite(web.BaseSite):
    """A TCP site whose connections are ``GuardedHandler``s of ``guard``."""

    __slots__ = ("_factory", "_host", "_port")

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        guard: ConnectionGuard,
        **handler_args: Any,
    ) -> None:
        super().__init__(runner, backlog=ACCEPT_BACKLOG)
        server = runner.server
        if server is None:
            raise RuntimeError("GuardedSite: call runner.setup() first")
        self._host = host
        self._port = port
        manager: web.Server = server

        def factory() -> GuardedHandler:
            return GuardedHandler(
                manager, guard=guard, loop=asyncio.get_running_loop(), **handler_args
            )

        self._factory: Callable[[], GuardedHandler] = factory

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._factory, self._host, self._port, backlog=self._backlog, reuse_address=True
        )
