"""Servers on loopback that are slow on purpose, for the remote reads' stop and pace:

- ``DripServer``: answers ranged GETs of one file's bytes, the first ``fast`` requests at
  once and every later one (status line, headers and body) ``chunk`` bytes every
  ``interval`` seconds (over TLS, each piece a record of its own); counts the
  connections it holds open (``open``), each ended as soon as its client closes it.
- ``DelayProxy``: relays TCP to another port, starting ``delay_s`` after each connection
  is accepted (a server that far away: a TLS handshake then waits that long for its
  answer).

Each runs an event loop on a thread of its own; ``stop()`` closes every connection.
"""

from __future__ import annotations

import asyncio
import re
import ssl
import threading
import time
from typing import Self

_RANGE = re.compile(rb"\r\nrange: *bytes=(\d+)-(\d+)", re.IGNORECASE)


class _LoopThread:
    """An event loop on a daemon thread, and the server ``_serve`` makes on it (over TLS
    with ``tls``)."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.tls = tls
        self.port = 0
        self.open = 0  # connections being served now
        self.connections = 0  # connections accepted so far
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def __enter__(self) -> Self:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def url(self, name: str = "m.gguf") -> str:
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://127.0.0.1:{self.port}/{name}"

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.tls)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)  # type: ignore[arg-type]
        self.open += 1
        self.connections += 1
        try:
            await self._handle(reader, writer)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        except asyncio.CancelledError:  # ``stop``: the connection is closed below
            pass
        finally:
            self.open -= 1
            writer.close()
            self._tasks.discard(task)  # type: ignore[arg-type]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    def wait_closed(self, timeout_s: float) -> float | None:
        """Seconds until no connection is open (None: still some after ``timeout_s``)."""
        began = time.monotonic()
        while time.monotonic() - began < timeout_s:
            if self.open == 0:
                return time.monotonic() - began
            time.sleep(0.01)
        return None

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.sleep(0)

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._loop.close()


class DripServer(_LoopThread):
    """Ranged GETs of ``data`` (any path), ETag ``"v1"``: see the module."""

    def __init__(
        self,
        data: bytes,
        *,
        fast: int = 1,
        chunk: int = 1,
        interval: float = 0.1,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        super().__init__(tls)
        self.data = data
        self.fast = fast
        self.chunk = chunk
        self.interval = interval
        self.requests = 0

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            match = _RANGE.search(head)
            size = len(self.data)
            first, last = (int(match[1]), int(match[2])) if match else (0, size - 1)
            last = min(last, size - 1)
            body = self.data[first : last + 1]
            self.requests += 1
            drip = self.requests > self.fast
            answer = (
                f"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {first}-{last}/{size}\r\n"
                f'Content-Length: {len(body)}\r\nETag: "v1"\r\n'
                f"Connection: {'close' if drip else 'keep-alive'}\r\n\r\n"
            ).encode() + body
            if not drip:
                writer.write(answer)
                await writer.drain()
                continue
            await self._drip(reader, writer, answer)
            return

    async def _drip(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, answer: bytes
    ) -> None:
        """``answer`` a little at a time, until its client closes the connection."""
        gone = asyncio.ensure_future(reader.read(1))
        try:
            for at in range(0, len(answer), self.chunk):
                if gone.done():
                    return
                writer.write(answer[at : at + self.chunk])
                await writer.drain()
                await asyncio.wait({gone}, timeout=self.interval)
        finally:
            gone.cancel()


class DelayProxy(_LoopThread):
    """Relays every connection to ``127.0.0.1:target`` after ``delay_s``."""

    def __init__(self, target: int, delay_s: float) -> None:
        super().__init__()
        self.target = target
        self.delay_s = delay_s

    def url(self, name: str = "m.gguf", scheme: str = "http") -> str:
        return f"{scheme}://127.0.0.1:{self.port}/{name}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(self.delay_s)
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            up_writer.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except OSError:
        writer.close()
