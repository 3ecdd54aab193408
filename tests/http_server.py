"""A real HTTP server on loopback for remote-source tests: aiohttp's ``FileResponse``
(Range, ETag, If-Match) on a thread of its own, with faults the tests switch on.

Faults apply to ranged requests of more than one byte after the first (which learns
the size and brings the header's bytes), each ``*_left`` counting down per request it
spoils:

- ``status_left``: answer ``status`` (503) instead;
- ``reset_left``: send half the body, then reset the connection;
- ``stall_left``: send half the body, then nothing for ``stall_s``;
- ``short``: every body is cut short (Content-Length promised, none of it sent);
- ``replace_after``: after that many ranged requests the file is rewritten (new ETag);
- ``redirect_to``: every request is redirected there (``Location`` + path);
- ``after``: the first that many ranged requests are spared (at least the first).

``headers`` keeps each request's headers, in order.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import socket
import ssl
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import pytest
from aiohttp import web


@dataclass
class Faults:
    status_left: int = 0
    status: int = 503
    reset_left: int = 0
    stall_left: int = 0
    stall_s: float = 30.0
    short: bool = False
    replace_after: int | None = None
    redirect_to: str | None = None
    after: int = 0
    headers: list[dict[str, str]] = field(default_factory=list)
    ranged: int = 0


class FileServer:
    """Serves the files of ``root`` at ``http://HOST:PORT/NAME`` (``https://`` with
    ``tls``); ``url(name)``."""

    def __init__(
        self, root: Path, host: str = "127.0.0.1", tls: ssl.SSLContext | None = None
    ) -> None:
        self.root = root
        self.host = host
        self.tls = tls
        self.faults = Faults()
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def url(self, name: str) -> str:
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://{self.host}:{self.port}/{name}"

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> Self:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _start(self) -> None:
        app = web.Application()
        self._routes(app)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0, ssl_context=self.tls)
        await site.start()
        server = site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    def _routes(self, app: web.Application) -> None:
        app.router.add_get("/{name}", self._handle)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        f = self.faults
        f.headers.append(dict(request.headers))
        if f.redirect_to is not None:
            raise web.HTTPFound(f.redirect_to + request.path)
        path = self.root / request.match_info["name"]
        rng = request.http_range
        ranged = rng.start is not None and rng.stop is not None and rng.stop - rng.start > 1
        if ranged:
            f.ranged += 1
            if f.replace_after is not None and f.ranged > f.replace_after:
                f.replace_after = None
                _rewrite(path)
            if f.ranged <= max(f.after, 1):
                return web.FileResponse(path)
            if f.status_left:
                f.status_left -= 1
                return web.Response(status=f.status)
            if f.reset_left or f.stall_left or f.short:
                return await self._spoiled(request, path, rng.start, rng.stop)
        return web.FileResponse(path)

    async def _spoiled(
        self, request: web.Request, path: Path, start: int, stop: int
    ) -> web.StreamResponse:
        f = self.faults
        size, data = _slice(path, start, stop)
        stop = start + len(data)
        response = web.StreamResponse(status=206)
        response.headers["Content-Range"] = f"bytes {start}-{stop - 1}/{size}"
        response.content_length = len(data)
        await response.prepare(request)
        if not f.short:
            await response.write(data[: len(data) // 2])
        transport = request.transport
        assert transport is not None
        if f.reset_left:
            f.reset_left -= 1
            transport.abort()
        elif f.stall_left:
            f.stall_left -= 1
            await asyncio.sleep(f.stall_s)
        else:
            transport.close()
        return response


# The one commit the stand-in hub knows, besides the branch "main" that points to it.
COMMIT = "0123456789abcdef0123456789abcdef01234567"


class HubServer(FileServer):
    """A stand-in for the hub's resolve endpoint, ``/OWNER/REPO/resolve/REV/FILE``
    (HEAD and GET), for the files of ``cdn`` (``files``: ``"OWNER/REPO/FILE"`` → name
    there): it answers as the hub does for a file kept in large-file storage, a redirect
    to the CDN carrying the commit, the linked ETag (the file's sha256, or ``etags[name]``)
    and the size. Knows the revisions ``main`` and ``COMMIT`` (any, with
    ``any_revision``), and names ``commit`` as theirs (a hostile hub: another one)."""

    def __init__(self, cdn: FileServer, files: dict[str, str]) -> None:
        super().__init__(cdn.root)
        self.cdn = cdn
        self.files = files
        self.etags: dict[str, str] = {}
        self.commit = COMMIT
        self.any_revision = False
        self._digests: dict[tuple[str, int, int], tuple[int, str]] = {}

    def _routes(self, app: web.Application) -> None:
        app.router.add_route("*", "/{owner}/{repo}/resolve/{rev}/{file:.+}", self._resolve)

    async def _resolve(self, request: web.Request) -> web.StreamResponse:
        self.faults.headers.append({"path": request.path, **request.headers})
        m = request.match_info
        if m["rev"] not in ("main", COMMIT) and not self.any_revision:
            return web.Response(
                status=404,
                headers={"X-Error-Code": "RevisionNotFound", "X-Error-Message": "Invalid rev id"},
            )
        name = self.files.get(f"{m['owner']}/{m['repo']}/{m['file']}")
        if name is None:
            return web.Response(
                status=404,
                headers={"X-Error-Code": "EntryNotFound", "X-Error-Message": "Entry not found"},
            )
        size, etag = self._digest(self.cdn.root / name)
        headers = {
            "X-Repo-Commit": self.commit,
            "X-Linked-Etag": f'"{self.etags.get(name) or etag}"',
            "X-Linked-Size": str(size),
            "ETag": '"pointer"',
            "Location": self.cdn.url(name),
        }
        return web.Response(status=302, headers=headers)

    def _digest(self, path: Path) -> tuple[int, str]:
        """The file's size and sha256, computed once per version (benchmarks serve GiBs)."""
        st = path.stat()
        key = (str(path), st.st_size, st.st_mtime_ns)
        if key not in self._digests:
            sha = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(16 << 20):
                    sha.update(chunk)
            self._digests[key] = (st.st_size, sha.hexdigest())
        return self._digests[key]


def self_signed(folder: Path, host: str = "127.0.0.1") -> tuple[Path, Path] | None:
    """A self-signed certificate for ``host`` (an IP address) and its key, written in
    ``folder`` by the ``cryptography`` package, else the ``openssl`` command; None where
    neither is here."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    try:
        _write_self_signed(cert, key, host)
    except ImportError:
        openssl = shutil.which("openssl")
        if openssl is None:
            return None
        subprocess.run(
            [
                *(openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256"),
                *("-nodes", "-days", "1", "-subj", f"/CN={host}"),
                *("-addext", f"subjectAltName=IP:{host}", "-keyout", str(key), "-out", str(cert)),
            ],
            check=True,
            capture_output=True,
            timeout=30,
        )
    return cert, key


def _write_self_signed(cert: Path, key: Path, host: str) -> None:
    import datetime
    import ipaddress

    from cryptography import x509  # pyright: ignore[reportMissingImports]  (optional: else openssl)
    from cryptography.hazmat.primitives import hashes, serialization  # pyright: ignore[reportMissingImports]  (optional: else openssl)
    from cryptography.hazmat.primitives.asymmetric import ec  # pyright: ignore[reportMissingImports]  (optional: else openssl)
    from cryptography.x509.oid import NameOID  # pyright: ignore[reportMissingImports]  (optional: else openssl)

    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(private.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(host))]),
            critical=False,
        )
        .sign(private, hashes.SHA256())
    )
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


def _slice(path: Path, start: int, stop: int) -> tuple[int, bytes]:
    """The file's size and its bytes ``[start, stop)`` (small test files: read whole)."""
    data = path.read_bytes()
    return len(data), data[start:stop]


def _rewrite(path: Path) -> None:
    """Another version of the file: the same bytes, a new modification time (a new
    ETag, as a file replaced by a new upload of the same size has)."""
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))


@contextmanager
def file_server(
    root: Path, host: str = "127.0.0.1", tls: ssl.SSLContext | None = None
) -> Iterator[FileServer]:
    server = FileServer(root, host, tls).start()
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def canned_server(answers: list[bytes]) -> Iterator[str]:
    """A raw server on loopback that answers its requests, one connection each, with
    ``answers`` in turn (whatever was asked); yields a URL of it (``/m.gguf``)."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)

    def serve() -> None:
        for answer in answers:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                conn.sendall(answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/m.gguf"
    finally:
        listener.close()
        thread.join(10)


def client_sockets(port: int) -> int:
    """This process's open TCP sockets connected to ``port`` (client ends)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if int(fields[2].rsplit(":", 1)[1], 16) == port:
                    inodes.add(fields[9])
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in inodes:
            count += 1
    return count


def tls_context(folder: Path) -> tuple[ssl.SSLContext, Path]:
    """A server's TLS context over a self-signed certificate for 127.0.0.1 made in
    ``folder``, and the certificate (for the client's ``SSL_CERT_FILE``); skips the test
    where neither the cryptography package nor the openssl command can make one."""
    made = self_signed(folder)
    if made is None:
        pytest.skip("neither the cryptography package nor the openssl command is here")
    cert, key = made
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    return context, cert
