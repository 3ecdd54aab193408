"""A split set loaded over HTTP opens and parses its later splits at once, against a
real server on loopback (``http_server.FileServer``) that holds the first request of
chosen files (``GatedServer``): a load that finishes while the server holds ``k`` of
those requests together had them in flight together. No assertion is about time: a
hold ends after ``HOLD_S`` at the latest and marks the request ``late``, which fails
the test instead of hanging it.

The oracle is the same set loaded from disk: every tensor's bytes must be equal.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import anyio
import pytest
from aiohttp import web
from http_server import FileServer, HubServer, client_sockets
from test_remote import _same_bytes

import aiogguf
from aiogguf.errors import GGUFFormatError, LoadError
from aiogguf.testing.synth import write_synthetic_model

pytestmark = pytest.mark.timeout(60)

COUNT = 5
NAMES = [f"s-{i:05d}-of-{COUNT:05d}.gguf" for i in range(1, COUNT + 1)]
LATER = NAMES[1:]
# The longest a held request waits for its gate; one let go so is ``late``.
HOLD_S = 10.0
SMALL = {"chunk_size": "256KiB"}


def _split_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("aiogguf-split")]


def _aiogguf_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("aiogguf"))


class GatedServer(FileServer):
    """A ``FileServer`` that holds the first request for each file of ``gated`` until
    ``k`` of them wait together (or ``release``), and answers 404 for ``missing`` (after
    the hold). Records the most requests held together, and the most split threads of
    the load alive while it served."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.arm()

    def arm(self, gated: Iterable[str] = (), k: int = 10**6, missing: Iterable[str] = ()) -> None:
        self.gated, self.k, self.missing = set(gated), k, set(missing)
        self.seen: set[str] = set()
        self.waiting: set[str] = set()
        self.answered: set[str] = set()
        self.together = 0
        self.split_threads = 0
        self.released = False
        self.late: list[str] = []
        self.all_held = threading.Event()  # every gated file's request waits at once
        self._cond = asyncio.Condition()

    def release(self) -> None:
        """From the test's thread: let every held request go."""
        asyncio.run_coroutine_threadsafe(self._release(), self._loop).result(10)

    async def _release(self) -> None:
        async with self._cond:
            self.released = True
            self._cond.notify_all()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        self.split_threads = max(self.split_threads, len(_split_threads()))
        if name in self.gated and name not in self.seen:
            self.seen.add(name)
            await self._hold(name)
        try:
            if name in self.missing:
                return web.Response(status=404)
            return await super()._handle(request)
        finally:
            self.answered.add(name)

    async def _hold(self, name: str) -> None:
        async with self._cond:
            self.waiting.add(name)
            self.together = max(self.together, len(self.waiting))
            if self.waiting == self.gated:
                self.all_held.set()
            self.released = self.released or len(self.waiting) >= self.k
            self._cond.notify_all()
            try:
                await asyncio.wait_for(self._cond.wait_for(lambda: self.released), HOLD_S)
            except TimeoutError:
                self.late.append(name)
            finally:
                self.waiting.discard(name)


@pytest.fixture(scope="module")
def split_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("splits")
    write_synthetic_model(root / "s.gguf", size_bytes="3MiB", seed=7, split_count=COUNT)
    assert sorted(p.name for p in root.iterdir()) == NAMES
    # "b-…": the same set with a third split whose header is not GGUF.
    for name in NAMES:
        shutil.copyfile(root / name, root / ("b" + name[1:]))
    (root / ("b" + NAMES[2][1:])).write_bytes(b"NOTGGUF!" * 4096)
    return root


@pytest.fixture
def server(split_root: Path) -> Iterator[GatedServer]:
    gated = GatedServer(split_root).start()
    try:
        yield gated
    finally:
        gated.release()
        gated.stop()


@pytest.mark.parametrize("in_flight", [4, 2])
def test_the_later_splits_are_in_flight_together_up_to_the_bound(
    server: GatedServer, split_root: Path, in_flight: int
) -> None:
    server.arm(gated=LATER, k=in_flight)
    url = server.url(NAMES[0])
    with aiogguf.load_sync(url, remote_in_flight=in_flight, **SMALL) as model:
        assert len(model.report.files) == COUNT
        assert [f.path for f in model.report.files] == [server.url(n) for n in NAMES]
        _same_bytes(model, split_root / NAMES[0])
    assert not server.late  # each wave of first requests was let go by the gate
    assert server.together == in_flight
    assert server.seen == set(LATER)
    assert server.split_threads == in_flight  # never more than the bound
    assert not _split_threads()


def test_a_hub_split_set_resolves_and_opens_its_later_splits_together(
    server: GatedServer, split_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("huggingface_hub")
    server.arm(gated=LATER, k=len(LATER))
    with HubServer(server, {f"own/repo/{n}": n for n in NAMES}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{hub.port}")
        with aiogguf.load_sync(f"hf://own/repo/{NAMES[0]}@main", **SMALL) as model:
            _same_bytes(model, split_root / NAMES[0])
    assert not server.late
    assert server.together == len(LATER)


def _release_when(server: GatedServer, ready: Callable[[], bool]) -> threading.Thread:
    """A thread that releases ``server``'s held requests once ``ready()`` (or after
    ``HOLD_S``: the hold then marks them late)."""

    def watch() -> None:
        deadline = time.monotonic() + HOLD_S
        while not ready() and time.monotonic() < deadline:
            time.sleep(0.01)
        if ready():
            server.release()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_the_lowest_failing_split_is_named_though_a_later_one_fails_first(
    server: GatedServer,
) -> None:
    # Split 2's answer waits until split 4 has been answered its 404: split 4 fails
    # first, and the load still names split 2.
    server.arm(gated=[NAMES[1]], missing=[NAMES[1], NAMES[3]])
    watcher = _release_when(server, lambda: NAMES[3] in server.answered)
    with pytest.raises(LoadError) as caught:
        aiogguf.load_sync(server.url(NAMES[0]), remote_in_flight=4).__enter__()
    watcher.join(HOLD_S)
    assert not server.late
    assert str(caught.value).startswith(f"{server.url(NAMES[1])}: ")
    assert "404" in str(caught.value)
    assert client_sockets(server.port) == 0
    assert not _split_threads()


@pytest.mark.parametrize("broken", ["missing", "not gguf"])
def test_a_failing_split_stops_the_later_ones_and_leaves_nothing(
    server: GatedServer, broken: str
) -> None:
    before = _aiogguf_threads()
    prefix = "s" if broken == "missing" else "b"
    names = [prefix + n[1:] for n in NAMES]
    # The third split fails; the fourth and fifth are held until the load has returned.
    server.arm(gated=names[3:], missing=[names[2]] if broken == "missing" else [])
    error = LoadError if broken == "missing" else GGUFFormatError
    with pytest.raises(error) as caught:
        aiogguf.load_sync(server.url(names[0]), remote_in_flight=4).__enter__()
    assert not server.late  # the held splits were stopped, not waited for
    assert server.url(names[2]) in str(caught.value)
    assert client_sockets(server.port) == 0
    assert not _split_threads()
    assert _aiogguf_threads() == before


@pytest.mark.anyio
async def test_a_load_cancelled_while_its_splits_open_leaves_nothing(
    server: GatedServer,
) -> None:
    before = _aiogguf_threads()
    server.arm(gated=LATER)  # held until released: the load is cancelled meanwhile

    async def load() -> None:
        async with aiogguf.load(server.url(NAMES[0]), remote_in_flight=4):
            pytest.fail("every later split is held")

    async with anyio.create_task_group() as tg:
        tg.start_soon(load)
        assert await anyio.to_thread.run_sync(server.all_held.wait, HOLD_S / 2)
        tg.cancel_scope.cancel()
    assert not server.late
    assert len(server.waiting) == len(LATER)  # still held: the load did not wait
    assert client_sockets(server.port) == 0
    assert not _split_threads()
    assert _aiogguf_threads() == before
