"""The attach protocol: how a client asks a server over its Unix socket for a resident
model, and how the server hands it over (docs/server.md, "Attach").

A message is a 4-byte big-endian length and that many bytes of one JSON object, at most
``MAX_MESSAGE_BYTES``; descriptors (``SCM_RIGHTS``, at most ``MAX_FDS``) travel only
from the server to the client, with the first byte of the message that says it carries
them (``"fds": N``). Once a message's first byte has arrived, the rest must arrive
within ``MESSAGE_TIMEOUT_S``.

The client sends one request, ``{"version": 1, "id": ID}`` or ``{"version": 1, "path":
PATH, "config": {...}}`` (``POST /models``'s body), and then nothing: closing the
connection ends its lease. The server answers with ``progress`` messages while the model
loads, then ``ready`` (with the descriptors) or ``error``; after ``ready``, ``ended``
when the model is unloaded under the client (a forced unload, the server's shutdown).
``error`` and ``ended`` are the server's last message: it closes the connection.

The client's side is blocking (``Connection``: for the load's own threads, never the
loop's); the server's runs on the loop over non-blocking sockets (``receive_request``,
``send_message``). Everything read is bounded in size, count and time.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import socket
import struct
import time
from collections.abc import Mapping, Sequence
from typing import Any

import anyio

__all__ = [
    "MAX_FDS",
    "MAX_MESSAGE_BYTES",
    "MESSAGE_TIMEOUT_S",
    "VERSION",
    "Connection",
    "FrameReader",
    "PeerGone",
    "ProtocolError",
    "encode",
    "one_line",
    "receive_request",
    "send_message",
]

VERSION = 1

# Line breaks and other control characters as escapes: a reason quotes what the client
# sent (a config key, a path), and a reply or log line must stay one line whatever it was.
_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, 0x85)} | {
    0x2028: "\\u2028",
    0x2029: "\\u2029",
}


def one_line(text: str) -> str:
    """``text`` on one line: control characters and line separators escaped."""
    return text.translate(_ESCAPES)


MAX_MESSAGE_BYTES = 1 << 20
MAX_FDS = 64
MESSAGE_TIMEOUT_S = 5.0
_HEADER = struct.Struct(">I")
_RECV_BYTES = 64 * 1024
# Room for the descriptors a server may pass; the kernel closes any beyond it.
_ANCILLARY = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)


class ProtocolError(Exception):
    """The peer broke the protocol: a one-line reason, safe to send back."""


class PeerGone(ProtocolError):
    """The peer closed its end (or reset it)."""


def encode(message: Mapping[str, Any]) -> bytes:
    """``message`` as one frame: its length, then its JSON."""
    payload = json.dumps(message, separators=(",", ":")).encode()
    if len(payload) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"a message of {len(payload)} bytes, over {MAX_MESSAGE_BYTES}")
    return _HEADER.pack(len(payload)) + payload


def decode(payload: bytes) -> dict[str, Any]:
    """One frame's JSON object; ``ProtocolError`` for anything else."""
    try:
        message = json.loads(payload)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError("a message that is not JSON") from exc
    if not isinstance(message, dict):
        raise ProtocolError("a message that is not a JSON object")
    return message


class FrameReader:
    """Bytes in, whole frames out; refuses a length over ``MAX_MESSAGE_BYTES`` as soon
    as the header is in, before its bytes are waited for."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._need: int | None = None

    @property
    def started(self) -> bool:
        """Some bytes of a frame not yet whole have arrived."""
        return bool(self._buffer)

    def feed(self, data: bytes) -> None:
        self._buffer += data
        self._check()

    def _check(self) -> None:
        if self._need is None and len(self._buffer) >= _HEADER.size:
            (length,) = _HEADER.unpack_from(self._buffer)
            if length > MAX_MESSAGE_BYTES:
                raise ProtocolError(f"a message of {length} bytes, over {MAX_MESSAGE_BYTES}")
            self._need = length

    def frame(self) -> dict[str, Any] | None:
        """The next whole message, or None until its bytes are in."""
        if self._need is None or len(self._buffer) < _HEADER.size + self._need:
            return None
        end = _HEADER.size + self._need
        payload = bytes(self._buffer[_HEADER.size : end])
        del self._buffer[:end]
        self._need = None
        self._check()
        return decode(payload)


def _fds_of(ancillary: Sequence[tuple[int, int, bytes]]) -> list[int]:
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return list(fds)


def _close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


# --- the server's side: on the loop, over a non-blocking socket -------------------------


async def receive_request(sock: socket.socket, timeout_s: float) -> dict[str, Any]:
    """The client's one request, whole within ``timeout_s`` of the call. A descriptor
    the client sends is closed at once and refused; ``ProtocolError`` (``PeerGone`` at
    EOF), ``TimeoutError``."""
    reader = FrameReader()
    with anyio.fail_after(timeout_s):
        while (message := reader.frame()) is None:
            await anyio.wait_readable(sock)
            try:
                data, ancillary, _flags, _ = sock.recvmsg(_RECV_BYTES, _ANCILLARY)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError as exc:
                raise PeerGone(f"the connection failed: {exc.strerror or exc}") from exc
            passed = _fds_of(ancillary)
            if passed:
                _close_all(passed)
                raise ProtocolError("a client may not send descriptors")
            if not data:
                raise PeerGone("the client closed the connection")
            reader.feed(data)
    return message


async def send_message(
    sock: socket.socket,
    message: Mapping[str, Any],
    fds: Sequence[int] = (),
    timeout_s: float = MESSAGE_TIMEOUT_S,
) -> None:
    """Send ``message`` (with ``fds`` on its first byte) within ``timeout_s``: a client
    that does not read is dropped (``TimeoutError``); ``PeerGone`` when it has gone."""
    data = memoryview(encode(message))
    pending = list(fds)
    with anyio.fail_after(timeout_s):
        while data:
            await anyio.wait_writable(sock)
            try:
                if pending:
                    sent = socket.send_fds(sock, [data], pending)
                    pending = []
                else:
                    sent = sock.send(data)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError as exc:
                raise PeerGone(f"the connection failed: {exc.strerror or exc}") from exc
            data = data[sent:]


# --- the client's side: blocking, on the load's own threads ----------------------------


class Connection:
    """One client connection to a server's socket; blocking calls for one thread, and
    ``abort`` from any thread (a cancelled caller), which ends a call under way."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._reader = FrameReader()
        self._aborted = False
        # Descriptors received and not yet handed out, in order. One read may hold the
        # end of one message and the start of the next, descriptors and all: they go to
        # the message that says it carries them (``"fds": N``), not to the read's.
        self._fds: list[int] = []

    @classmethod
    def open(cls) -> Connection:
        """A connection not connected yet (``connect``): one that can be aborted."""
        return cls(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC))

    def connect(self, path: str, timeout_s: float = MESSAGE_TIMEOUT_S) -> None:
        """Connect to the socket at ``path`` within ``timeout_s``; ``OSError`` as the
        kernel says it. A server whose backlog is full is tried again every 50 ms, not
        waited on in the kernel: ``abort`` ends the wait at once."""
        deadline = time.monotonic() + timeout_s
        self._sock.settimeout(0)
        while True:
            try:
                self._sock.connect(path)
                break
            except BlockingIOError:  # the backlog is full (EAGAIN for a Unix socket)
                if self._aborted:
                    raise PeerGone("the attach was cancelled") from None
                if time.monotonic() > deadline:
                    raise ProtocolError(
                        "the server did not accept the connection in time"
                    ) from None
                time.sleep(0.05)
        self._sock.settimeout(timeout_s)

    def send(self, message: Mapping[str, Any]) -> None:
        """Send ``message`` whole within ``MESSAGE_TIMEOUT_S``."""
        self._sock.settimeout(MESSAGE_TIMEOUT_S)
        try:
            self._sock.sendall(encode(message))
        except TimeoutError as exc:
            raise ProtocolError("the server did not take the request in time") from exc
        except OSError as exc:
            raise PeerGone(f"the connection failed: {exc.strerror or exc}") from exc

    def receive(self, idle_timeout_s: float) -> tuple[dict[str, Any], list[int]]:
        """The next message and the descriptors it says it carries (``"fds": N``; the
        caller owns them): its first byte within ``idle_timeout_s``, the rest within
        ``MESSAGE_TIMEOUT_S`` of it. ``ProtocolError`` (``PeerGone`` at EOF or abort)."""
        deadline = time.monotonic() + idle_timeout_s
        while (message := self._reader.frame()) is None:
            if self._aborted:
                raise PeerGone("the attach was cancelled")
            left = deadline - time.monotonic()
            if left <= 0:
                raise ProtocolError("the server sent nothing in time")
            self._sock.settimeout(left)
            try:
                data, ancillary, flags, _ = self._sock.recvmsg(_RECV_BYTES, _ANCILLARY)
            except TimeoutError:
                continue  # the deadline's check above says it
            except OSError as exc:
                raise PeerGone(f"the connection failed: {exc.strerror or exc}") from exc
            self._fds += _fds_of(ancillary)
            if len(self._fds) > MAX_FDS or flags & socket.MSG_CTRUNC:
                raise ProtocolError(f"the server sent more than {MAX_FDS} descriptors")
            if not data:
                raise PeerGone("the server closed the connection")
            started = self._reader.started
            self._reader.feed(data)
            if not started:
                deadline = time.monotonic() + MESSAGE_TIMEOUT_S
        count = message.get("fds", 0)
        if not isinstance(count, int) or not 0 <= count <= len(self._fds):
            raise ProtocolError("the server's descriptors do not match its message")
        fds, self._fds = self._fds[:count], self._fds[count:]
        return message, fds

    def poll(self) -> dict[str, Any] | None:
        """The next whole message if one has arrived, without waiting (any thread that
        is not receiving); ``PeerGone`` once the server has closed its end."""
        self._sock.settimeout(0)  # a socket with a timeout would wait for it first
        while (message := self._reader.frame()) is None:
            try:
                data, ancillary, _flags, _ = self._sock.recvmsg(_RECV_BYTES, _ANCILLARY)
            except (BlockingIOError, InterruptedError):
                return None
            except OSError as exc:
                raise PeerGone(f"the connection failed: {exc.strerror or exc}") from exc
            _close_all(_fds_of(ancillary))  # none is due after ``ready``
            if not data:
                raise PeerGone("the server closed the connection")
            self._reader.feed(data)
        return message

    def abort(self) -> None:
        """End a ``receive`` or ``send`` under way on another thread (it raises
        ``PeerGone``); the connection is useless afterwards."""
        self._aborted = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Close the connection (the server ends the lease it held for it) and any
        descriptor received and not handed out."""
        self._sock.close()
        fds, self._fds = self._fds, []
        _close_all(fds)
