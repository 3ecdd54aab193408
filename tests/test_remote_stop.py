"""Remote reads against servers slow on purpose (issue 35, items 1, 2 and 9): a cancelled
load ends within a second or so whatever rate the bytes come at, leaving no connection
and no thread; a trickle that is not cancelled fails under the configured floor; a TLS
handshake waits as long as a read does; an encoded range is refused.

Each load runs on a thread of its own with its own event loop, so that a load that does
not stop fails the test in bounded time (its server is then stopped, which ends it).
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from http_server import canned_server, client_sockets, file_server, tls_context
from slow_servers import DelayProxy, DripServer

import aiogguf
from aiogguf.errors import LoadError
from aiogguf.remote._http_source import HttpSource, RemoteOptions
from aiogguf.testing.synth import write_synthetic_model

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model larger than the first request's MiB: its tensors take more requests."""
    path = tmp_path_factory.mktemp("drip") / "m.gguf"
    write_synthetic_model(path, size_bytes="3MiB", seed=7, n_layer=2)
    return path


def _load_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("aiogguf-"))


class _LoadThread:
    """``aiogguf.load`` of ``url`` on a thread with its own loop, cancelled ``cancel_s``
    after it starts (None: never): ``ended`` when it returned, ``error`` what it raised."""

    def __init__(self, url: str, cancel_s: float | None, **overrides: Any) -> None:
        self.url, self.cancel_s, self.overrides = url, cancel_s, overrides
        self.began = self.ended = 0.0
        self.cancelled = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="test-load", daemon=True)

    def _run(self) -> None:
        async def main() -> None:
            with anyio.move_on_after(self.cancel_s if self.cancel_s is not None else 1e9) as s:
                async with aiogguf.load(self.url, **self.overrides):
                    pass
            self.cancelled = s.cancelled_caught

        try:
            anyio.run(main)
        except BaseException as exc:
            self.error = exc
        self.ended = time.monotonic()

    def run(self, within_s: float) -> bool:
        """Start, and wait up to ``within_s`` for the end; whether it ended."""
        self.began = time.monotonic()
        self._thread.start()
        self._thread.join(within_s)
        return not self._thread.is_alive()

    def join(self) -> None:
        self._thread.join(30)


@pytest.mark.parametrize("fast", [0, 1], ids=["while-opening", "while-reading"])
@pytest.mark.parametrize(("chunk", "interval"), [(1, 0.1), (2, 0.2)], ids=["1B/0.1s", "2B/0.2s"])
def test_a_cancelled_load_of_a_drip_ends_at_once_leaving_nothing(
    model: Path, fast: int, chunk: int, interval: float
) -> None:
    """10 B/s, never 0.25 s without a byte: the stop is looked at on a clock, not after
    silence. ``fast=0``: the first request drips (the load is opening the file);
    ``fast=1``: the header comes at once, the tensors' requests drip."""
    with DripServer(model.read_bytes(), fast=fast, chunk=chunk, interval=interval) as server:
        load = _LoadThread(server.url(), 1.0, remote_in_flight=4, chunk_size="256KiB")
        try:
            ended = load.run(within_s=1.0 + 8.0)
        finally:
            server.stop()  # ends a load that did not stop, so the test fails, not hangs
            load.join()
        assert ended, "the cancelled load had not ended 8 s after the cancel"
        assert load.error is None, repr(load.error)
        assert load.cancelled
        assert server.requests > fast  # it was reading the drip
        stopped_s = load.ended - load.began - 1.0
        assert stopped_s < 2.0, f"ended {stopped_s:.2f} s after the cancel"
        assert client_sockets(server.port) == 0
        assert _load_threads() == []


def test_a_cancelled_load_closes_the_servers_connections_within_a_second(model: Path) -> None:
    with DripServer(model.read_bytes(), fast=1, chunk=1, interval=0.1) as server:
        load = _LoadThread(server.url(), 1.0, remote_in_flight=4, chunk_size="256KiB")
        try:
            ended = load.run(within_s=1.0 + 8.0)
            closed_s = server.wait_closed(5.0)
        finally:
            server.stop()
            load.join()
        assert ended, "the cancelled load had not ended 8 s after the cancel"
        assert load.cancelled, repr(load.error)
        assert server.connections > 1
        assert closed_s is not None, "the server still had connections 5 s after the end"


def test_a_cancelled_https_load_of_a_drip_ends_at_once(
    model: Path, tls_files: tuple[Path, ssl.SSLContext, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over TLS each dripped byte is a record of its own, which a read returns at once:
    the stop is looked at all the same."""
    _, context, cert = tls_files
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    with DripServer(model.read_bytes(), fast=1, chunk=1, interval=0.1, tls=context) as server:
        load = _LoadThread(server.url(), 1.0, remote_in_flight=4, chunk_size="256KiB")
        try:
            ended = load.run(within_s=1.0 + 8.0)
        finally:
            server.stop()
            load.join()
    assert ended, "the cancelled load had not ended 8 s after the cancel"
    assert load.cancelled, repr(load.error)
    assert server.requests > 1
    assert load.ended - load.began - 1.0 < 2.0
    assert _load_threads() == []


def test_a_trickle_fails_under_the_floor(model: Path) -> None:
    """2 B/s, never a second without a byte (so never a stall): the rate over
    ``remote_timeout`` is under ``remote_min_rate``, and each try fails, without the
    bytes that did arrive earning more tries."""
    with DripServer(model.read_bytes(), fast=1, chunk=1, interval=0.5) as server:
        load = _LoadThread(
            server.url(),
            None,
            remote_in_flight=1,
            chunk_size="256KiB",
            remote_timeout=1.0,
            remote_min_rate=64,
            remote_retries=1,
        )
        try:
            ended = load.run(within_s=20.0)
        finally:
            server.stop()
            load.join()
    assert ended, "a 2 B/s trickle was still loading after 20 s"
    error = load.error
    assert isinstance(error, LoadError), repr(error)
    message = str(error)
    assert message.startswith(f"{server.url()}: at offset ")
    assert error.offset is not None
    assert error.offset > 0  # a tensor's: the first request came at once
    assert "read failed after 2 tries" in message
    assert "under remote_min_rate (64 B/s)" in message
    assert "\n" not in message


def test_a_source_reads_through_a_slow_but_steady_link(model: Path) -> None:
    """Over the floor: a 4 KiB/s link (200 bytes every 0.05 s) is not refused by a floor
    of 1 KiB/s averaged over a second."""
    data = model.read_bytes()
    with DripServer(data, fast=1, chunk=200, interval=0.05) as server:
        options = RemoteOptions(stall_s=1.0, min_rate=1024, retries=0, head_bytes=64)
        source = HttpSource(server.url(), options)
        try:
            buf = bytearray(8000)  # with the headers: about 2 s of dripping
            source.read_into(buf, 1000)
        finally:
            source.close()
    assert bytes(buf) == data[1000:9000]


# --- TLS through a server 0.4 s away ----------------------------------------------------


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ssl.SSLContext, Path]:
    root = tmp_path_factory.mktemp("tls-delay")
    context, cert = tls_context(root)
    write_synthetic_model(root / "m.gguf", size_bytes="1MiB", seed=9, n_layer=2)
    return root, context, cert


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_a_server_0_4_s_away_loads_over_http_and_https(
    tls_files: tuple[Path, ssl.SSLContext, Path], scheme: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each connection waits 0.4 s before the server answers anything: the TLS handshake
    waits for it as a read does (it gave up after 0.25 s)."""
    root, context, cert = tls_files
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    with (
        file_server(root, tls=context if scheme == "https" else None) as server,
        DelayProxy(server.port, 0.4) as proxy,
    ):
        url = proxy.url(scheme=scheme)
        with (
            aiogguf.load_sync(url, remote_retries=0, remote_in_flight=2) as remote,
            aiogguf.load_sync(root / "m.gguf", mode="none") as local,
        ):
            names = [t.name for t in local.plan.tensors]
            assert names == [t.name for t in remote.plan.tensors]
            for name in names:
                assert bytes(remote.raw(name)) == bytes(local.raw(name)), name
        assert proxy.connections >= 1


def test_a_handshake_no_one_answers_stops_on_cancel() -> None:
    """A listener that accepts and says nothing: the handshake waits (``remote_timeout``),
    and a cancel ends it within about a second."""
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        url = f"https://127.0.0.1:{listener.getsockname()[1]}/m.gguf"
        load = _LoadThread(url, 0.6, remote_timeout=30.0)
        ended = load.run(within_s=0.6 + 8.0)
        load.join()
        assert ended, "the cancelled load had not ended 8 s after the cancel"
        assert load.cancelled, repr(load.error)
        assert load.ended - load.began - 0.6 < 2.0
    finally:
        listener.close()


# --- a range that is not the file's bytes -------------------------------------------------


def _partial(first: int, body: bytes, extra: str = "") -> bytes:
    head = (
        f"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {first}-{first + len(body) - 1}"
        f'/1000\r\nContent-Length: {len(body)}\r\nETag: "v1"\r\nConnection: close\r\n{extra}\r\n'
    )
    return head.encode() + body


@pytest.mark.parametrize("encoding", ["gzip", "br", "GZIP, identity"])
def test_an_encoded_range_is_an_error(encoding: str) -> None:
    """The file's bytes, gzip-compressed, are not the file's bytes: refused at once."""
    answers = [
        _partial(0, b"G" * 1000),
        _partial(100, b"x" * 10, f"Content-Encoding: {encoding}\r\n"),
    ]
    with canned_server(answers) as url:
        source = HttpSource(url, RemoteOptions(retries=3))
        try:
            with pytest.raises(LoadError) as caught:
                source.read_into(bytearray(10), 100)
        finally:
            source.close()
    assert caught.value.offset == 100
    assert f"Content-Encoding {encoding.lower()}" in str(caught.value)
    assert str(caught.value).startswith(f"{url}: at offset 100: ")


def test_identity_encoding_is_the_files_bytes() -> None:
    with canned_server([_partial(0, b"G" * 1000, "Content-Encoding: identity\r\n")]) as url:
        source = HttpSource(url)
        try:
            assert source.read_upto(0, 1000) == b"G" * 1000
        finally:
            source.close()
