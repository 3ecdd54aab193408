"""A load server's remote admissions against servers slow on purpose (issue 35, items 1
and 9): ``DELETE`` of a loading remote model ends it at once; a request whose client went
away stops opening its files; remote admissions in flight are capped; a split set past
the shard limit is a ``400`` whatever its size; the listen backlog holds a burst of
connections.

Real servers on loopback: ``create_app`` behind aiohttp (``server_helpers.running``) and
a drip server (``slow_servers.DripServer``).
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest
from server_helpers import post, running
from slow_servers import DripServer

from aiogguf.server._app import RemoteAccess, ServerPolicy, create_app
from aiogguf.testing.synth import write_synthetic_model

pytestmark = [pytest.mark.timeout(60), pytest.mark.anyio]

LOOPBACK = "127.0.0.1/32"


@pytest.fixture(scope="module")
def model_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("drip-server") / "m.gguf"
    write_synthetic_model(path, size_bytes="2MiB", seed=13, n_layer=2)
    return path.read_bytes()


@pytest.fixture
def drip(model_bytes: bytes) -> Iterator[DripServer]:
    """Every request drips (1 byte every 0.2 s), the admission's first too."""
    with DripServer(model_bytes, fast=0, chunk=1, interval=0.2) as server:
        yield server


def _app(server: DripServer, **policy: Any) -> Any:
    access = RemoteAccess.from_settings(url_prefixes=[server.url("models/")], networks=[LOOPBACK])
    return create_app(policy=ServerPolicy(remote=access, **policy))


def _request_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("aiogguf-")]


async def _settles(check: Any, within_s: float) -> bool:
    """Whether ``check()`` holds within ``within_s``, looked at every 20 ms."""
    with anyio.move_on_after(within_s):
        while not check():  # noqa: ASYNC110  (state of servers on other threads: no event)
            await anyio.sleep(0.02)
        return True
    return False


async def test_delete_of_a_loading_remote_model_ends_it_at_once(model_bytes: bytes) -> None:
    """The admission's probe comes at once, every read of the load drips: DELETE
    answers with the load cancelled (it waited 30 s and answered 202, still loading)."""
    with DripServer(model_bytes, fast=1, chunk=1, interval=0.1) as server:
        async with running(_app(server)) as base, aiohttp.ClientSession() as http:
            status, body = await post(http, base, server.url("models/m.gguf"))
            assert status == 201, body
            assert await _settles(lambda: server.requests > 1, 10.0)  # the load drips
            await anyio.sleep(0.5)
            began = time.monotonic()
            timeout = aiohttp.ClientTimeout(total=10)
            async with http.delete(f"{base}/models/{body['id']}", timeout=timeout) as r:
                state = await r.json()
            took = time.monotonic() - began
            assert r.status == 200, state
            assert state["state"] == "cancelled"
            assert took < 2.0, f"DELETE took {took:.2f} s"
            assert await _settles(lambda: server.open == 0, 2.0)
            assert _request_threads() == []


async def test_a_request_whose_client_went_away_stops_opening(drip: DripServer) -> None:
    """Clients that give up while their remote files are being opened (the first
    request drips for about 25 s): the openings end, their connections and threads
    with them."""
    async with running(_app(drip)) as base:
        for _ in range(5):
            await _abandon(base, drip.url("models/m.gguf"), drip)
        assert drip.connections == 5
        gone = await _settles(lambda: drip.open == 0 and not _request_threads(), 3.0)
        assert gone, f"{drip.open} connections and threads {_request_threads()} left"


async def test_remote_admissions_in_flight_are_capped(drip: DripServer) -> None:
    """Past ``max_remote_admissions`` a request is a 503 at once, in one line; once the
    clients in flight go away there is room again."""
    url = drip.url("models/m.gguf")
    async with running(_app(drip, max_remote_admissions=2)) as base:
        async with aiohttp.ClientSession() as waiting, anyio.create_task_group() as tg:
            for _ in range(2):
                tg.start_soon(_post_quietly, waiting, base, url)
            assert await _settles(lambda: drip.connections == 2, 5.0)
            async with aiohttp.ClientSession() as http:
                began = time.monotonic()
                status, body = await post(http, base, url)
                assert time.monotonic() - began < 5.0
            assert status == 503, body
            assert body == {
                "error": "this server is opening 2 remote models already, its limit "
                "(max_remote_admissions); try again later"
            }
            assert drip.connections == 2  # the refused one made no request
            tg.cancel_scope.cancel()  # the two waiting clients go away
        assert await _settles(lambda: drip.open == 0, 3.0)
        await _abandon(base, url, drip)  # admitted again: it opens (and drips)
        assert drip.connections == 3


async def _abandon(base: str, url: str, server: DripServer) -> None:
    """``POST /models`` of ``url``, given up (its connection closed) once the server
    is opening it: ``server`` has one more connection."""
    before = server.connections
    async with aiohttp.ClientSession() as http, anyio.create_task_group() as tg:
        tg.start_soon(_post_quietly, http, base, url)
        assert await _settles(lambda: server.connections > before, 10.0)
        tg.cancel_scope.cancel()


async def _post_quietly(http: aiohttp.ClientSession, base: str, url: str) -> None:
    async with http.post(f"{base}/models", json={"path": url}) as r:
        await r.read()


async def test_a_remote_split_set_past_the_shard_limit_is_a_400(drip: DripServer) -> None:
    """65,535 shards: refused for their count (400), not for the descriptors so many
    would take (503), and before any request."""
    async with running(_app(drip)) as base, aiohttp.ClientSession() as http:
        status, body = await post(http, base, drip.url("models/s-00001-of-65535.gguf"))
    assert status == 400, body
    assert "a split set of 65535 shards; this server loads at most 256" in body["error"]
    assert drip.connections == 0


async def test_a_burst_of_200_connects_is_held_by_the_listen_backlog(tmp_path: Path) -> None:
    """200 connects while the server's loop is busy: the kernel completes them all into
    the listen backlog (with 64, those past 65 had their SYN dropped and waited a second
    for its retransmission)."""
    backlog_cap = _somaxconn()
    if backlog_cap < 200:
        pytest.skip(f"net.core.somaxconn is {backlog_cap}: the kernel caps any backlog there")
    tmp_path.joinpath("m.gguf").write_bytes(b"")
    app = create_app(roots=[tmp_path])
    async with running(app, guarded=True) as base:
        port = int(base.rsplit(":", 1)[1])
        clients = [socket.socket() for _ in range(200)]
        try:
            # The loop is held here (no await): nothing is accepted meanwhile.
            for client in clients:
                client.setblocking(False)
                client.connect_ex(("127.0.0.1", port))
            connected = _connected_within(clients, 0.3)
            assert connected == 200, f"{200 - connected} connects waited on a full backlog"
        finally:
            for client in clients:
                client.close()


def _somaxconn() -> int:
    return int(Path("/proc/sys/net/core/somaxconn").read_text())


def _connected_within(clients: list[socket.socket], wait_s: float) -> int:
    """How many of ``clients`` (connecting, non-blocking) are connected ``wait_s`` on."""
    poller = select.poll()
    for client in clients:
        poller.register(client, select.POLLOUT)
    done: set[int] = set()
    deadline = time.monotonic() + wait_s
    while len(done) < len(clients) and (left := deadline - time.monotonic()) > 0:
        for fd, _ in poller.poll(left * 1000):
            poller.unregister(fd)
            done.add(fd)
    return sum(
        1
        for c in clients
        if c.fileno() in done and c.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
    )
