"""A model file read over HTTP(S) by byte ranges: the remote ``ByteSource``.

``HttpSource`` reads with the standard library's ``http.client``: blocking calls on the
load's reader threads, one keep-alive connection per thread, each ranged body read by
``HTTPResponse.readinto`` straight into the caller's memory (no copy in between).

- **One version.** The first request learns the size and the ETag; every later request
  carries ``If-Match`` with it, so a file replaced during the load fails the load
  (``LoadError`` "changed during the load") instead of mixing two versions. Without a
  strong ETag, each response's ``Content-Range`` total must still equal the size.
- **Faults.** A reset, a timeout, a short body or a 5xx is retried with backoff, from the
  byte where the range stopped, ``retries`` times in a row at most; then the load fails
  naming the URL (credentials and query left out) and the offset.
- **Redirects** are followed (``MAX_REDIRECTS``); the ``Authorization`` header goes only
  to the host it was given for.
- **Round trips.** The first request asks for the file's first ``HEAD_BYTES``, which the
  header parse then reads without another request; the TLS context (the trusted
  certificates, read from disk) is made once per process.
- **Trust.** ``https`` trusts the system's certificate authorities, or those named by
  OpenSSL's ``SSL_CERT_FILE`` / ``SSL_CERT_DIR``; an untrusted certificate fails the load
  at once (no retries), saying so.
- **Addresses.** With an ``address_policy`` (a server's: ``aiogguf._addresses``),
  each host is resolved once per connection and only an address the policy accepts is
  connected to, by its number: what was checked is what is reached, after redirects too.
- **Stopping.** No socket call waits more than ``POLL_S`` (the kernel's or Python's
  timeout), and every return of a read calls ``raise_if_stopped``, whatever it brought:
  a cancelled load ends its reads within about ``POLL_S`` whether a server stalls or
  drips a byte every 0.1 s. ``close()``, from any thread, shuts every connection down.
- **Pace.** ``stall_s`` without a byte is a timeout, and so is a connection whose reads
  bring less than ``min_rate`` bytes a second, averaged over ``stall_s`` of waiting on
  it: a trickle is retried as a stall is, but the bytes it brings earn no more tries,
  so a server that drips ends the load in bounded time. The TLS handshake waits
  ``stall_s`` too.
- **Hostile servers.** Status line and headers are bounded by ``http.client`` (lines of
  64 KiB, 100 headers); ``Content-Range`` and ``Content-Length`` must match the range
  asked for exactly, and a range must come without a ``Content-Encoding`` (the file's
  own bytes, not their gzip).
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import http.client
import ipaddress
import os
import random
import re
import select
import socket
import ssl
import struct
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiogguf.errors import LoadError, PathNotAllowedError
from aiogguf.io.workers import raise_if_stopped

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from aiogguf._addresses import IPAddress

# Why an address may not be connected to (None: it may): see ``RemoteOptions``.
AddressPolicy = Callable[[str, "IPAddress"], str | None]
__all__ = ["AddressPolicy", "HttpSource", "RemoteOptions", "is_url", "redact_url"]

# A socket call waits this long at most: a stopped load is noticed at its return.
POLL_S = 0.25
# The most bytes one readinto asks for: a stop is noticed between pieces.
PIECE_BYTES = 4 << 20
MAX_REDIRECTS = 5
# The default floor of a connection's rate, in bytes a second averaged over ``stall_s``
# of waiting (``RemoteOptions.min_rate``): a link a thousand times slower than a slow
# home line still passes, a server that drips a byte at a time does not.
MIN_RATE = 1024
# The first request's bytes: a header of a model with a large vocabulary fits (the
# parse's growing reads are then answered from them), and a body this small costs
# little more than the round trip any first request costs.
HEAD_BYTES = 1 << 20
_CONTENT_RANGE = re.compile(r"bytes (\d{1,20})-(\d{1,20})/(\d{1,20})")
_STRONG_ETAG = re.compile(r'"[\x21\x23-\x7e\x80-\xff]{0,256}"')
# Faults worth another try: the link or the server, not the request.
_RETRIABLE = (OSError, http.client.HTTPException)


def is_url(path: object) -> bool:
    """True for an ``http://`` or ``https://`` address (any case)."""
    return isinstance(path, str) and path[:8].lower().startswith(("http://", "https://"))


def redact_url(url: str) -> str:
    """``url`` without user, password, query or fragment: fit for messages and logs
    (a signed URL's query is a credential)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))


@dataclass(frozen=True, slots=True)
class RemoteOptions:
    """How a remote file is read: ``retries`` in a row per range, the first after
    ``backoff_s`` (doubling, jittered), ``stall_s`` without a byte (or to connect) is a
    timeout, ``headers`` go with every request (``Authorization`` only to the first
    host). ``request_bytes``: the most one ranged request asks for (a longer read is
    several, one after the other). ``address_policy(host, address)``: why an address
    the host resolved to may not be connected to, or None; None: any address.
    ``head_bytes``: what the first request asks for (1: only the size and the ETag).
    ``min_rate``: bytes a second a connection's reads must bring, averaged over
    ``stall_s`` of waiting on it, or the try times out (0: no floor; the default passes
    a link of a few kilobytes a second). ``on_open(source)``: called as each source is
    made, before its first request, so that another thread may ``close()`` it (a server
    whose client went away) while that request waits."""

    retries: int = 4
    backoff_s: float = 0.25
    stall_s: float = 30.0
    headers: Mapping[str, str] | None = None
    request_bytes: int = 16 << 20
    address_policy: AddressPolicy | None = None
    head_bytes: int = HEAD_BYTES
    min_rate: int = MIN_RATE
    on_open: Callable[[HttpSource], None] | None = None


class AddressRefused(Exception):
    """The policy refused every address of a host: not a fault another try fixes."""


class _Changed(Exception):
    """The file is not the version the load began with."""


class _Fault(Exception):
    """A response that another try may fix (a 5xx, a short body)."""


class _TooSlow(TimeoutError):
    """A connection's reads brought less than the floor over a window."""


class _Pace:
    """The reads of one connection, timed: what a read brings and how long it waited.
    ``spent``/``got``: waiting and bytes in the current window; ``silent``: waiting
    since the last byte."""

    __slots__ = ("got", "min_rate", "silent", "spent", "stall_s")

    def __init__(self, stall_s: float, min_rate: int) -> None:
        self.stall_s = stall_s
        self.min_rate = min_rate
        self.spent = self.silent = 0.0
        self.got = 0

    def count(self, waited: float, got: int) -> None:
        """After a read that waited ``waited`` s and brought ``got`` bytes (-1: none, it
        timed out): raises ``Stopped`` for a stopped load, ``TimeoutError`` after
        ``stall_s`` without a byte, ``_TooSlow`` under the floor."""
        raise_if_stopped()
        self.spent += waited
        if got > 0:
            self.got += got
            self.silent = 0.0
        else:
            self.silent += waited
            if self.silent >= self.stall_s:
                raise TimeoutError(f"no byte for {self.stall_s:g} s")
        if self.spent >= self.stall_s:
            if self.got < self.min_rate * self.spent:
                raise _TooSlow(
                    f"{self.got} bytes in {self.spent:.1f} s of waiting, under "
                    f"remote_min_rate ({self.min_rate} B/s)"
                )
            self.spent, self.got = 0.0, 0


def _polled_recv(pace: _Pace, recv: Callable[..., int], *args: object) -> int:
    """``recv(*args)``, which waits ``POLL_S`` at most, until it brings bytes or the end;
    ``pace`` looks at the stop, the silence and the rate after every return."""
    clock = time.monotonic
    while True:
        began = clock()
        try:
            got = recv(*args)
        except (TimeoutError, BlockingIOError):  # Python's timeout, or the kernel's
            got = -1
        pace.count(clock() - began, got)
        if got >= 0:
            return got


class _PollingSocket(socket.socket):
    """A socket whose reads wait ``POLL_S`` at a time, paced by ``pace``."""

    pace: _Pace

    def recv_into(self, buffer: Buffer, nbytes: int = 0, flags: int = 0) -> int:
        return _polled_recv(self.pace, super().recv_into, buffer, nbytes, flags)


class _PollingSSLSocket(ssl.SSLSocket):
    pace: _Pace

    def recv_into(self, buffer: Buffer, nbytes: int | None = None, flags: int = 0) -> int:
        return _polled_recv(self.pace, super().recv_into, buffer, nbytes, flags)


_TLS_LOCK = threading.Lock()
_TLS: dict[tuple[str | None, str | None], ssl.SSLContext] = {}


def _tls_context() -> ssl.SSLContext:
    """The context of ``https`` connections: the system's trusted certificates, or those
    that ``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` name. One per process and per value of
    those two: reading the certificates costs more than a round trip, per source."""
    key = (os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
    with _TLS_LOCK:
        context = _TLS.get(key)
        if context is None:
            context = ssl.create_default_context()
            context.sslsocket_class = _PollingSSLSocket
            _TLS[key] = context
    return context


def _allowed_addresses(host: str, port: int, policy: AddressPolicy) -> list[tuple[str, int]]:
    """The addresses of ``host`` that ``policy`` accepts, resolved once; raises
    ``AddressRefused`` when it accepts none."""
    found: list[tuple[str, int]] = []
    refusal = f"{host} resolves to no address"
    for _, _, _, _, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        address = ipaddress.ip_address(sockaddr[0])
        reason = policy(host, address)
        if reason is None:
            found.append((str(sockaddr[0]), port))
        else:
            refusal = reason
    if not found:
        raise AddressRefused(refusal)
    return found


def _connect(
    host: str,
    port: int,
    options: RemoteOptions,
    tls: ssl.SSLContext | None,
) -> socket.socket:
    stall_s, policy = options.stall_s, options.address_policy
    timeout = min(stall_s, 10.0)
    if policy is None:
        raw = _first_connection([(host, port)], timeout)
    else:
        raw = _first_connection(_allowed_addresses(host, port, policy), timeout)
    sock = _PollingSocket(fileno=raw.detach())
    sock.pace = _Pace(stall_s, options.min_rate)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if tls is None:
        # The kernel's timeouts, not Python's: a socket with a Python timeout polls
        # before each recv (two calls, and two GIL round trips, per read, contended by
        # every connection's thread); this one blocks in recv, which the kernel ends with
        # EAGAIN after POLL_S for a look at the stop.
        sock.settimeout(None)
        timeval = struct.pack("@ll", int(POLL_S), round(POLL_S % 1 * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
        return sock
    sock.settimeout(POLL_S)  # TLS reads its records through Python's timeout
    try:
        wrapped = tls.wrap_socket(sock, server_hostname=host, do_handshake_on_connect=False)
    except BaseException:
        sock.close()
        raise
    assert isinstance(wrapped, _PollingSSLSocket)
    wrapped.pace = _Pace(stall_s, options.min_rate)
    try:
        _handshake(wrapped, stall_s)
    except BaseException:
        wrapped.close()
        raise
    return wrapped


def _handshake(sock: ssl.SSLSocket, stall_s: float) -> None:
    """The TLS handshake, waited for ``stall_s`` as a read is, ``POLL_S`` at a time (a
    handshake that timed out resumes where it stopped), the stop looked at between."""
    deadline = time.monotonic() + stall_s
    while True:
        try:
            sock.do_handshake()
            return
        except TimeoutError:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no TLS handshake within {stall_s:g} s") from None
            raise_if_stopped()


def _first_connection(addresses: list[tuple[str, int]], timeout: float) -> socket.socket:
    """A connection to the first of ``addresses`` (numbers are not resolved again) that
    answers within ``timeout``."""
    error: OSError | None = None
    for host, port in addresses:
        for family, kind, proto, _, sockaddr in socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM
        ):
            try:
                return _connected(socket.socket(family, kind, proto), sockaddr, timeout)
            except OSError as exc:
                error = exc
    if error is None:
        raise OSError(f"{addresses[0][0]} resolves to no address")
    raise error


def _connected(sock: socket.socket, sockaddr: object, timeout: float) -> socket.socket:
    """``sock`` connected to ``sockaddr`` within ``timeout`` (closed if not). The connect
    is waited for ``POLL_S`` at a time, a stopped load noticed between: a server that
    never answers the handshake would otherwise hold a cancelled load for the timeout."""
    try:
        sock.setblocking(False)
        error = sock.connect_ex(sockaddr)  # type: ignore[arg-type]
        waited, poller = 0.0, select.poll()
        poller.register(sock, select.POLLOUT)
        while error in (errno.EINPROGRESS, errno.EAGAIN, errno.EALREADY):
            if poller.poll(POLL_S * 1000):
                error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                break
            waited += POLL_S
            if waited >= timeout:
                raise TimeoutError(f"no answer to the connect within {timeout:g} s")
            raise_if_stopped()
        if error:
            raise OSError(error, os.strerror(error))
        sock.setblocking(True)
        return sock
    except BaseException:
        sock.close()
        raise


class _Connection(http.client.HTTPConnection):
    """One keep-alive connection to one host, over a polling socket."""

    def __init__(self, scheme: str, host: str, port: int, options: RemoteOptions) -> None:
        super().__init__(host, port, timeout=POLL_S)
        self.key = (scheme, host, port)
        self._options = options

    def connect(self) -> None:
        tls = _tls_context() if self.key[0] == "https" else None
        self.sock = _connect(self.host, self.port, self._options, tls)


@dataclass(frozen=True, slots=True)
class _Target:
    scheme: str
    host: str
    port: int
    target: str  # path and query, as sent
    url: str

    @classmethod
    def parse(cls, url: str, shown: str) -> _Target:
        try:
            parts = urllib.parse.urlsplit(url)
            port = parts.port
        except ValueError as exc:
            raise LoadError(shown, None, f"not a usable URL: {exc}") from None
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https") or not parts.hostname:
            raise LoadError(shown, None, "not a usable URL: expected http:// or https://HOST/…")
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        if any(c in target for c in "\r\n\0 "):
            raise LoadError(shown, None, "not a usable URL: control characters in the path")
        default = 443 if scheme == "https" else 80
        return cls(scheme, parts.hostname, port or default, target, url)

    @property
    def origin(self) -> tuple[str, str, int]:
        return (self.scheme, self.host, self.port)


class HttpSource:
    """A remote file, read by ranges from any number of threads at once (one connection
    each). Opening it makes the first request (blocking): ``size_bytes`` and the ETag."""

    # What a load does with it (``ByteSource``): no page cache to bypass, nothing to
    # map; each read is a request, kept whole.
    direct_ok = False
    direct_refusal: str | None = None
    direct = None
    mappable = None
    local = False

    def __init__(self, url: str, options: RemoteOptions | None = None, *, name: str = "") -> None:
        self.options = options if options is not None else RemoteOptions()
        self.path = name or redact_url(url)  # ``name``: what messages call it instead
        self._first = _Target.parse(url, self.path)
        self._where = self._first  # where the last redirect led
        self._head = b""  # the file's first bytes, from the first request
        self._local = threading.local()
        self._lock = threading.Lock()
        self._connections: set[_Connection] = set()
        self._closed = False
        self.etag: str | None = None
        self.size_bytes = -1
        if self.options.on_open is not None:
            self.options.on_open(self)
        try:
            self._learn()
        except BaseException:
            self.close()
            raise

    @property
    def host(self) -> str:
        """The host the URL names (before any redirect)."""
        return self._first.host

    @property
    def piece_bytes(self) -> int:
        """One request: each request's bytes are checked while the other connections
        wait on the network (the checks of a job's bytes would otherwise all fall after
        its last request, when every connection finishes at once)."""
        return self.options.request_bytes

    def disk(self) -> str:
        """Its host: the reads queue on its connections."""
        return f"remote {self.host}"

    def __repr__(self) -> str:
        return f"<HttpSource {self.path!r} size={self.size_bytes} etag={self.etag!r}>"

    # -- the ByteSource protocol ---------------------------------------------------

    def read_into(self, dest: Buffer, offset: int, *, max_call: int = 0) -> None:
        """Fill all of ``dest`` with the bytes at ``offset`` (blocking), in requests of
        ``request_bytes`` (``max_call`` is a local file's); raises ``LoadError`` naming
        the URL and the offset where it failed."""
        view = builtins.memoryview(dest).cast("B")
        if view.readonly:
            raise ValueError("destination buffer is read-only")
        if not view:
            return
        end = offset + len(view)
        if offset < 0 or end > self.size_bytes:
            raise LoadError(
                self.path, offset, f"range up to byte {end} is past the end ({self.size_bytes})"
            )
        step = max(self.options.request_bytes, 1)
        for start in range(0, len(view), step):
            self._read_range(view[start : start + step], offset + start)

    def _read_range(self, view: builtins.memoryview, offset: int) -> None:
        """One ranged request's worth, retried from where it stops."""
        self._with_retries(offset, lambda done: self._fetch(view, offset, done))

    def read_upto(self, offset: int, nbytes: int) -> bytes:
        """Up to ``nbytes`` at ``offset``: fewer only at the end (the header parse); what
        the first request brought is not asked for again."""
        buf = bytearray(max(0, min(nbytes, self.size_bytes - offset)))
        known = self._head[offset : offset + len(buf)] if offset >= 0 else b""
        buf[: len(known)] = known
        if len(known) < len(buf):
            self.read_into(builtins.memoryview(buf)[len(known) :], offset + len(known))
        return bytes(buf)

    def check_unchanged(self) -> None:
        """Nothing to ask: every range already carried ``If-Match``."""

    def close(self) -> None:
        """Close every connection (a read in flight fails soon after); idempotent."""
        with self._lock:
            self._closed = True
            connections, self._connections = list(self._connections), set()
        for conn in connections:
            _shut(conn)

    # -- requests ------------------------------------------------------------------

    def _learn(self) -> None:
        """The first request: the size, the ETag and the first ``head_bytes``."""
        head = builtins.memoryview(bytearray(max(self.options.head_bytes, 1)))
        self._with_retries(0, lambda done: self._fetch(head, 0, done))
        self._head = bytes(head[: min(len(head), self.size_bytes)])

    def _with_retries(self, offset: int, attempt: Callable[[int], None]) -> None:
        """Run ``attempt(done)`` until it returns, resuming from where it stopped."""
        done = 0
        tries = 0
        while True:
            raise_if_stopped()
            try:
                attempt(done)
                return
            except _Progress as progress:
                if progress.done > done and not isinstance(progress.cause, _TooSlow):
                    tries = 0  # bytes arrived: the budget of tries is per stall
                done = progress.done
                fault = progress.cause
            if tries >= self.options.retries:
                raise LoadError(
                    self.path,
                    offset + done,
                    f"read failed after {tries + 1} tries: {fault}",
                ) from fault
            tries += 1
            delay = self.options.backoff_s * 2 ** (tries - 1)
            deadline = time.monotonic() + delay * (0.5 + random.random() / 2)
            while (left := deadline - time.monotonic()) > 0:
                raise_if_stopped()
                time.sleep(min(left, POLL_S))

    def _fetch(self, view: builtins.memoryview, offset: int, done: int) -> None:
        """One try: the range ``[offset + done, offset + len(view))`` into ``view[done:]``
        (the first request's view may reach past a small file's end: it is cut to the
        size learnt). Raises ``_Progress`` with how far it got on a fault worth another
        try, ``LoadError`` otherwise."""
        start, end = offset + done, offset + len(view)
        try:
            conn, response = self._request(start, end)
        except ssl.SSLCertVerificationError as exc:
            raise LoadError(self.path, start, _untrusted(exc)) from None
        except (*_RETRIABLE, _Fault) as exc:
            raise _Progress(done, exc) from exc
        except AddressRefused as exc:
            raise PathNotAllowedError(self.path, f"not connected: {exc}") from None
        try:
            self._check_response(response, start, end)
            view = view[: max(done, min(len(view), self.size_bytes - offset))]
            while done < len(view):
                raise_if_stopped()
                piece = view[done : min(len(view), done + PIECE_BYTES)]
                got = response.readinto(piece)
                if not got:
                    raise _Fault(f"the body ended early, at byte {offset + done}")
                done += got
            if response.read(1):
                raise _Fault("the body is longer than asked for")
        except _Changed as exc:
            self._drop(conn, response)
            raise LoadError(self.path, start, f"the file changed during the load: {exc}") from None
        except (*_RETRIABLE, _Fault) as exc:
            self._drop(conn, response)
            raise _Progress(done, exc) from exc
        except BaseException:
            self._drop(conn, response)  # stopped mid-body: the connection is mid-response
            raise
        if response.will_close:
            self._drop(conn, response)

    def _request(self, start: int, end: int) -> tuple[_Connection, http.client.HTTPResponse]:
        where = self._where
        for _ in range(MAX_REDIRECTS + 1):
            headers = {
                "Range": f"bytes={start}-{end - 1}",
                "Accept-Encoding": "identity",
                "User-Agent": "aiogguf",
            }
            if self.etag is not None:
                headers["If-Match"] = self.etag
            for name, value in (self.options.headers or {}).items():
                if name.lower() != "authorization" or where.origin == self._first.origin:
                    headers[name] = value
            conn, response = self._send(where, headers)
            if response.status not in (301, 302, 303, 307, 308):
                self._where = where
                return conn, response
            location = response.getheader("Location", "")
            if not _discard(response) or response.will_close:
                self._drop(conn, response)
            where = _Target.parse(urllib.parse.urljoin(where.url, location), self.path)
        raise LoadError(self.path, start, f"more than {MAX_REDIRECTS} redirects")

    def _send(
        self, where: _Target, headers: dict[str, str]
    ) -> tuple[_Connection, http.client.HTTPResponse]:
        conn = self._connection(where)
        reused = conn.sock is not None
        try:
            return conn, _exchange(conn, where.target, headers)
        except _STALE:
            self._drop(conn)
            if not reused:
                raise
        except BaseException:
            self._drop(conn)
            raise
        # The server had closed the idle keep-alive connection: a fresh one, at once.
        conn = self._connection(where)
        try:
            return conn, _exchange(conn, where.target, headers)
        except BaseException:
            self._drop(conn)
            raise

    def _check_response(self, response: http.client.HTTPResponse, start: int, end: int) -> None:
        status = response.status
        if status == 412:
            raise _Changed(f"the server no longer has version {self.etag}")
        if status >= 500 or status == 429:
            raise _Fault(f"the server answered {status} {response.reason}")
        if status != 206:
            raise LoadError(
                self.path,
                start,
                f"expected a partial response (206), got {status} {response.reason}",
            )
        encoding = response.getheader("Content-Encoding", "").strip().lower()
        if encoding not in ("", "identity"):
            raise LoadError(
                self.path,
                start,
                f"the range came with Content-Encoding {encoding}, not as the file's own "
                "bytes (it was asked for with Accept-Encoding: identity)",
            )
        match = _CONTENT_RANGE.fullmatch(response.getheader("Content-Range", "").strip())
        if match is None:
            raise LoadError(self.path, start, "the response has no usable Content-Range")
        first, last, total = (int(g) for g in match.groups())
        if self.size_bytes < 0:
            self.size_bytes, end = total, min(end, total)
            etag = response.getheader("ETag", "").strip()
            self.etag = etag if _STRONG_ETAG.fullmatch(etag) else None
        elif total != self.size_bytes:
            raise _Changed(f"it was {self.size_bytes} bytes, now {total}")
        elif self.etag is not None and response.getheader("ETag", self.etag).strip() != self.etag:
            raise _Changed(f"its ETag was {self.etag}, now another")
        if (first, last + 1) != (start, min(end, total)):
            raise LoadError(
                self.path, start, f"asked for bytes {start}-{end - 1}, got {first}-{last}"
            )
        length = response.getheader("Content-Length")
        if length is not None and length.strip() != str(last + 1 - first):
            raise LoadError(self.path, start, "Content-Length does not match Content-Range")

    def _connection(self, where: _Target) -> _Connection:
        if self._closed:  # a connection of this thread's would connect again
            raise LoadError(self.path, None, "the source is closed")
        conn: _Connection | None = getattr(self._local, "conn", None)
        if conn is not None and conn.key == where.origin:
            return conn
        if conn is not None:
            self._drop(conn)
        fresh = _Connection(where.scheme, where.host, where.port, self.options)
        with self._lock:
            if self._closed:
                raise LoadError(self.path, None, "the source is closed")
            self._connections.add(fresh)
        self._local.conn = fresh
        return fresh

    def _drop(self, conn: _Connection, response: http.client.HTTPResponse | None = None) -> None:
        """Close ``conn`` (and ``response``, whose reader holds its socket open)."""
        if response is not None:
            response.close()
        with self._lock:
            self._connections.discard(conn)
        if getattr(self._local, "conn", None) is conn:
            self._local.conn = None
        _shut(conn)


class _Progress(Exception):
    """A try that stopped at ``done`` bytes, for ``cause``."""

    def __init__(self, done: int, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.done = done
        self.cause = cause


_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)


def _exchange(conn: _Connection, target: str, headers: dict[str, str]) -> http.client.HTTPResponse:
    """Send one GET and read its status line and headers; the connection is dropped by
    the caller on failure."""
    conn.request("GET", target, headers=headers)
    return conn.getresponse()


def _untrusted(exc: ssl.SSLCertVerificationError) -> str:
    return (
        f"the server's certificate is not trusted ({exc.verify_message}); "
        "SSL_CERT_FILE can name a file of certificate authorities to trust"
    )


def _discard(response: http.client.HTTPResponse) -> bool:
    """Read a redirect's body if it is small; whether the connection can be used again."""
    try:
        response.read(64 << 10)
    except _RETRIABLE:
        return False
    return response.isclosed()


def _shut(conn: _Connection) -> None:
    sock = conn.sock
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
    conn.close()
