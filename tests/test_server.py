"""The HTTP load server, driven over real sockets by a real HTTP client: concurrent
loads followed to the end, a load cancelled mid-way with nothing left behind, the
loop's latency while loads run, bad requests, shutdown, and ``aiogguf serve``."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest
from aiohttp import web
from anyio.streams.buffered import BufferedByteReceiveStream
from server_helpers import running

import aiogguf.server._app
from aiogguf._config import Config
from aiogguf.server._app import LoadLimiter, ServerPolicy, create_app, registry_of
from aiogguf.server._policy import REQUEST_KEYS
from aiogguf.testing.synth import write_synthetic_model

# These tests choose their simulated GPUs and chunk sizes per request.
SIM_POLICY = ServerPolicy(request_keys=REQUEST_KEYS | {"sim_gpus", "chunk_size"})

# A simulated GPU slow enough that a load takes about a second per 64 MiB.
FAST_GPU = "name=g0,free=1GiB,bandwidth=64MiB"
SLOW_GPU = "name=g0,free=1GiB,bandwidth=16MiB"


def open_fds_to(paths: Iterable[Path]) -> int:
    """Descriptors of this process open on any of ``paths``."""
    targets = {os.path.realpath(p) for p in paths}
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}") in targets:
                count += 1
    return count


def mappings_of(paths: Iterable[Path]) -> int:
    """Memory mappings of this process backed by any of ``paths``."""
    targets = {os.path.realpath(p) for p in paths}
    with open("/proc/self/maps") as maps:
        return sum(1 for line in maps if line.rstrip("\n").split(" ")[-1] in targets)


def all_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


async def start_load(http: aiohttp.ClientSession, url: str, path: Path, **config: Any) -> str:
    async with http.post(f"{url}/models", json={"path": str(path), "config": config}) as r:
        body = await r.json()
        assert r.status == 201, body
        load_id: str = body["id"]
        return load_id


async def follow(
    http: aiohttp.ClientSession,
    url: str,
    load_id: str,
    until: Callable[[dict[str, Any]], bool] | None = None,
) -> list[dict[str, Any]]:
    """The events of ``load_id``'s stream until the server ends it (or one matches
    ``until``: then the client leaves the stream early)."""
    events: list[dict[str, Any]] = []
    async with http.get(f"{url}/models/{load_id}/events") as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        async for line in r.content:
            if line.startswith(b"data: "):
                events.append(json.loads(line[len(b"data: ") :]))
                if until is not None and until(events[-1]):
                    break
    return events


async def get_json(http: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, Any]]:
    async with http.get(url) as r:
        data: dict[str, Any] = await r.json()
        return r.status, data


async def delete(http: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, Any]]:
    async with http.delete(url) as r:
        data: dict[str, Any] = await r.json()
        return r.status, data


def p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


class HealthSampler:
    """Times ``GET /healthz`` back to back; samples count between ``start`` and ``stop``."""

    def __init__(self, http: aiohttp.ClientSession, url: str) -> None:
        self.http, self.url = http, url
        self.latencies_s: list[float] = []
        self.counting = False
        self.stopped = anyio.Event()

    async def run(self) -> None:
        while not self.stopped.is_set():
            t0 = time.perf_counter()
            async with self.http.get(f"{self.url}/healthz") as r:
                assert r.status == 200
                await r.read()
            if self.counting:
                self.latencies_s.append(time.perf_counter() - t0)
            await anyio.sleep(0.002)

    def stop(self) -> None:
        self.counting = False
        self.stopped.set()


async def latency_round(http: aiohttp.ClientSession, url: str, paths: Iterable[Path]) -> float:
    """Load ``paths`` at once (then unload them) while sampling; p99 latency in ms."""
    sampler = HealthSampler(http, url)
    async with anyio.create_task_group() as tg:
        tg.start_soon(sampler.run)
        sampler.counting = True
        ids = [await start_load(http, url, p, sim_gpus=[FAST_GPU], **SIM_LOAD) for p in paths]
        for load_id in ids:
            assert (await follow(http, url, load_id))[-1]["state"] == "ready"
        sampler.stop()
    for load_id in ids:
        await delete(http, f"{url}/models/{load_id}")
    assert len(sampler.latencies_s) >= 100, len(sampler.latencies_s)
    return p99(sampler.latencies_s) * 1e3


SIM_LOAD: dict[str, Any] = {"n_gpu_layers": -1, "chunk_size": "4MiB"}
# The loop's latency target is 5 ms (design 2.3); the test allows 20 ms. Other processes
# share this machine's two cores and can starve the whole process for a while, so a
# round over the limit is measured again, at most twice, before the test fails.
P99_LIMIT_MS = 20.0
LATENCY_ROUNDS = 3


@pytest.mark.asyncio
async def test_concurrent_loads_cancel_and_latency(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    write_synthetic_model(a, size_bytes="32MiB", seed=1)
    write_synthetic_model(b, size_bytes="32MiB", seed=2)
    write_synthetic_model(c, size_bytes="64MiB", seed=3)
    models = (a, b, c)
    baseline = all_fds()

    # Small staging slots: the slow load lands its first bytes, and its cancellation
    # waits for its copies in flight, a slot at a time at the slow GPU's bandwidth.
    app = create_app(
        config=Config().with_overrides(staging_buffer_size="1MiB"),
        limiter=LoadLimiter(max_loads=4, max_readers=8),
        roots=[tmp_path],
        policy=SIM_POLICY,
    )
    async with running(app) as url, aiohttp.ClientSession() as http:
        sampler = HealthSampler(http, url)
        streams: dict[str, list[dict[str, Any]]] = {}

        async def follow_into(load_id: str) -> None:
            streams[load_id] = await follow(http, url, load_id)

        async with anyio.create_task_group() as tg:
            tg.start_soon(sampler.run)
            sampler.counting = True
            id_a = await start_load(http, url, a, sim_gpus=[FAST_GPU], **SIM_LOAD)
            id_b = await start_load(http, url, b, sim_gpus=[FAST_GPU], **SIM_LOAD)
            id_c = await start_load(http, url, c, sim_gpus=[SLOW_GPU], **SIM_LOAD)
            async with anyio.create_task_group() as followers:
                for load_id in (id_a, id_b, id_c):
                    followers.start_soon(follow_into, load_id)
                # Cancel the slow load once it has landed some bytes, not all.
                with anyio.fail_after(10):
                    await follow(http, url, id_c, until=lambda e: e["bytes_done"] > 0)
                status, cancelled = await delete(http, f"{url}/models/{id_c}")
                assert status == 200, cancelled
                assert cancelled["state"] == "cancelled"
                assert 0 < cancelled["bytes_done"] < cancelled["bytes_total"]
                # Nothing of the cancelled load is left: files, mappings, device memory.
                assert open_fds_to([c]) == 0
                assert mappings_of([c]) == 0
                assert cancelled["device_memory"] == {"g0": 0}
            sampler.stop()

        for load_id in (id_a, id_b):
            events = streams[load_id]
            assert events[-1]["state"] == "ready"
            assert all(e["state"] == "loading" for e in events[:-1])
            done = [e["bytes_done"] for e in events]
            assert done == sorted(done), "progress went backwards"
            assert events[-1]["bytes_done"] == events[-1]["bytes_total"] > 0
            status, state = await get_json(http, f"{url}/models/{load_id}")
            assert status == 200
            assert state["state"] == "ready"
            assert state["report"]["nbytes"] == state["bytes_total"]
            assert state["device_memory"]["g0"] > 0
        assert streams[id_c][-1]["state"] == "cancelled"

        # Unloading frees the models: no descriptor, mapping or device byte remains
        # (the loads share the simulated device, so it is empty after the last one).
        for load_id in (id_a, id_b):
            status, state = await delete(http, f"{url}/models/{load_id}")
            assert status == 200
            assert state["state"] == "unloaded"
        assert state["device_memory"] == {"g0": 0}
        assert open_fds_to(models) == 0
        assert mappings_of(models) == 0
        _, health = await get_json(http, f"{url}/healthz")
        assert health["limiter"]["loads"] == health["limiter"]["readers"] == 0

        # The server kept answering while it loaded (its latency: the timing test).
        assert len(sampler.latencies_s) >= 10, f"only {len(sampler.latencies_s)} samples"

    # Server and client closed: back to the descriptors we started with.
    with anyio.fail_after(5):
        while all_fds() - baseline:  # noqa: ASYNC110 (sockets close asynchronously; no event)
            await anyio.sleep(0.05)
    assert mappings_of(models) == 0


@pytest.mark.asyncio
async def test_bad_requests_get_one_line_errors(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    write_synthetic_model(model, size_bytes="2MiB")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"this is not a GGUF file at all" * 10)

    # Mounted inside a user's own application, beside its routes.
    async def own_route(request: web.Request) -> web.Response:
        return web.Response(text="mine")

    parent = web.Application()
    parent.router.add_get("/", own_route)
    parent.add_subapp("/gguf", create_app(roots=[tmp_path], policy=SIM_POLICY))
    async with running(parent) as root, aiohttp.ClientSession() as http:
        url = f"{root}/gguf"

        async def refused(method: str, path: str, status: int, **kwargs: Any) -> str:
            async with http.request(method, f"{url}{path}", **kwargs) as r:
                body = await r.json()
                assert r.status == status, body
                error: str = body["error"]
                assert error
                assert "\n" not in error
            # ... and the server keeps serving.
            health_status, health = await get_json(http, f"{url}/healthz")
            assert health_status == 200
            assert health["ok"]
            return error

        error = await refused("POST", "/models", 400, data=b"{not json")
        assert "JSON" in error
        await refused("POST", "/models", 400, json=["a list"])
        assert "path" in await refused("POST", "/models", 400, json={"config": {}})
        missing = tmp_path / "missing.gguf"
        error = await refused("POST", "/models", 400, json={"path": str(missing)})
        assert str(missing) in error
        assert "no such file" in error.lower()
        error = await refused(
            "POST", "/models", 400, json={"path": str(model), "config": {"moda": "mmap"}}
        )
        assert "moda" in error
        assert "mode" in error
        error = await refused(
            "POST", "/models", 403, json={"path": str(model), "config": {"readers": "many"}}
        )
        assert "readers" in error
        error = await refused(
            "POST", "/models", 400, json={"path": str(model), "config": {"sim_gpus": ["x=1"]}}
        )
        assert "x" in error
        await refused("POST", "/models", 400, json={"path": str(model), "config": [1]})
        for method, path in (("GET", "/models/99"), ("DELETE", "/models/99")):
            assert "99" in await refused(method, path, 404)
        await refused("GET", "/models/99/events", 404)

        # A file that is not GGUF is accepted, then fails with the parser's one line.
        load_id = await start_load(http, url, junk)
        events = await follow(http, url, load_id)
        assert events[-1]["state"] == "failed"
        assert str(junk) in events[-1]["error"]
        assert "\n" not in events[-1]["error"]

        # A good load still works, in the same server.
        ok_id = await start_load(http, url, model, check_tensors=True)
        assert (await follow(http, url, ok_id))[-1]["state"] == "ready"
        _, listing = await get_json(http, f"{url}/models")
        assert {m["id"]: m["state"] for m in listing["models"]} == {
            load_id: "failed",
            ok_id: "ready",
        }
        # DELETE of an ended load forgets it.
        status, gone = await delete(http, f"{url}/models/{load_id}")
        assert status == 200
        assert gone["forgotten"]
        await refused("GET", f"/models/{load_id}", 404)
        async with http.get(f"{root}/") as r:
            assert await r.text() == "mine"
    assert open_fds_to([model, junk]) == 0
    assert mappings_of([model]) == 0


@pytest.mark.asyncio
async def test_roots_limit_what_can_be_loaded(tmp_path: Path) -> None:
    served = tmp_path / "served"
    served.mkdir()
    inside, outside = served / "in.gguf", tmp_path / "out.gguf"
    write_synthetic_model(inside, size_bytes="2MiB")
    write_synthetic_model(outside, size_bytes="2MiB")
    (served / "link.gguf").symlink_to(outside)
    async with running(create_app(roots=[served])) as url, aiohttp.ClientSession() as http:
        load_id = await start_load(http, url, inside)
        assert (await follow(http, url, load_id))[-1]["state"] == "ready"
        for path, status in (
            (outside, 403),
            (served / "link.gguf", 403),
            (tmp_path / "missing.gguf", 403),
            (served / "missing.gguf", 400),
        ):
            async with http.post(f"{url}/models", json={"path": str(path)}) as r:
                assert r.status == status, await r.text()


@pytest.mark.asyncio
async def test_shutdown_cancels_loads_and_closes_models(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(aiogguf.server._app, "_KEEPALIVE_S", 0.05)
    small, big = tmp_path / "small.gguf", tmp_path / "big.gguf"
    write_synthetic_model(small, size_bytes="2MiB")
    write_synthetic_model(big, size_bytes="64MiB")
    # One load at a time: the third waits in the limiter's queue. Small staging slots: the
    # shutdown waits for the copies in flight, each a slot at the slow GPU's bandwidth.
    config = Config().with_overrides(staging_buffer_size="1MiB")
    app = create_app(
        config=config, limiter=LoadLimiter(max_loads=1), roots=[tmp_path], policy=SIM_POLICY
    )
    async with running(app) as url, aiohttp.ClientSession() as http:
        ready_id = await start_load(http, url, small, mode="mmap")
        assert (await follow(http, url, ready_id))[-1]["state"] == "ready"
        slow = {"sim_gpus": [SLOW_GPU], "n_gpu_layers": -1}
        loading_id = await start_load(http, url, big, **slow)
        # Another placement of the same file (the same one would share the first load).
        queued_id = await start_load(http, url, big, **slow, check_tensors=False)
        with anyio.fail_after(10):
            await follow(http, url, loading_id, until=lambda e: e["bytes_done"] > 0)
        # A stream with nothing to report (a queued load) keeps saying it is alive.
        with anyio.fail_after(5):
            async with http.get(f"{url}/models/{queued_id}/events") as r:
                assert (await r.content.readline()).startswith(b"data: ")
                while await r.content.readline() != b": keep-alive\n":
                    pass
        _, queued = await get_json(http, f"{url}/models/{queued_id}")
        assert queued["state"] == "loading"
        assert queued["queued"]
        assert mappings_of([small]) > 0
    states = {e.id: e.state.value for e in registry_of(app).entries.values()}
    assert states == {ready_id: "unloaded", loading_id: "cancelled", queued_id: "cancelled"}
    assert open_fds_to([small, big]) == 0
    assert mappings_of([small, big]) == 0
    for entry in registry_of(app).entries.values():
        assert all(v == 0 for v in entry.snapshot()["device_memory"].values())


@pytest.mark.asyncio
async def test_cli_serve_stops_on_sigint(tmp_path: Path) -> None:
    # cwd outside the repository: our io/ folder must not shadow the standard library.
    command = [sys.executable, "-m", "aiogguf", "serve", "--port", "0", "--root", str(tmp_path)]
    async with await anyio.open_process(command, cwd=tmp_path, stderr=subprocess.STDOUT) as proc:
        assert proc.stdout is not None
        output = BufferedByteReceiveStream(proc.stdout)
        with anyio.fail_after(30):
            line = (await output.receive_until(b"\n", 4096)).decode()
            assert "listening on http://127.0.0.1:" in line, line
            url = line.split()[-1]
            async with aiohttp.ClientSession() as http:
                status, health = await get_json(http, f"{url}/healthz")
            assert status == 200
            assert health["ok"]
            proc.send_signal(signal.SIGINT)
            assert await proc.wait() == 130  # Ctrl-C: 130, as any command
            rest = b""
            with contextlib.suppress(anyio.EndOfStream, anyio.IncompleteRead):
                while True:
                    rest += await output.receive()
        assert b"stopped" in rest, rest
        assert b"aiogguf serve: interrupted\n" in rest, rest  # one line, as any command


@pytest.mark.asyncio
async def test_limiter_shares_readers_and_staging_first_come_first_served() -> None:
    limiter = LoadLimiter(max_loads=3, max_readers=4, max_staging_bytes=100)
    order: list[str] = []
    release = {name: anyio.Event() for name in ("a", "big", "small")}

    async def hold(name: str, readers: int, staging: int) -> None:
        async with limiter.reserve(readers, staging):
            order.append(name)
            await release[name].wait()

    async with anyio.create_task_group() as tg:
        tg.start_soon(hold, "a", 2, 10)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(hold, "big", 3, 10)  # 2 + 3 readers > 4: waits
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(hold, "small", 1, 10)  # would fit, but queues behind "big"
        await anyio.wait_all_tasks_blocked()
        assert order == ["a"]
        stats = limiter.statistics()
        assert (stats.loads, stats.readers, stats.staging_bytes, stats.waiting) == (1, 2, 10, 2)
        release["a"].set()
        await anyio.wait_all_tasks_blocked()
        assert order == ["a", "big", "small"]
        assert limiter.statistics().readers == 4
        release["big"].set()
        release["small"].set()
    assert limiter.statistics() == type(limiter.statistics())(0, 0, 0, 0)
    # A request bigger than the whole budget is cut down to it and runs alone.
    async with limiter.reserve(readers=99, staging_bytes=10**9):
        stats = limiter.statistics()
        assert (stats.readers, stats.staging_bytes) == (4, 100)


@pytest.mark.asyncio
async def test_serve_warms_the_process_up_before_it_listens(tmp_path: Path) -> None:
    from aiogguf._config import Config
    from aiogguf.io._devices.pool import staging_pools

    config = Config().with_overrides(sim_gpus=["free=1GiB,pin_s_per_gib=0"], readers=2)
    app = create_app(config=config, roots=[tmp_path])
    pinned_when_listening: list[int] = []
    listening = anyio.Event()

    def started(addresses: object) -> None:
        pinned_when_listening.append(sum(p.stats().pinned_bytes for p in staging_pools()))
        listening.set()

    with anyio.move_on_after(10) as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: aiogguf.server._app.serve(app, port=0, on_started=started))
            await listening.wait()
            tg.cancel_scope.cancel()
    assert not scope.cancelled_caught
    # Two transfer threads, two 32 MiB slots each: pinned before the first request.
    assert pinned_when_listening == [2 * 2 * 32 * 1024**2]


@pytest.mark.timing
@pytest.mark.asyncio
async def test_healthz_latency_during_loads(tmp_path: Path) -> None:
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_synthetic_model(a, size_bytes="64MiB", seed=1)
    write_synthetic_model(b, size_bytes="64MiB", seed=2)
    app = create_app(roots=[tmp_path], policy=SIM_POLICY)
    async with running(app) as url, aiohttp.ClientSession() as http:
        p99s_ms = [await latency_round(http, url, (a, b))]
        while p99s_ms[-1] >= P99_LIMIT_MS and len(p99s_ms) < LATENCY_ROUNDS:
            p99s_ms.append(await latency_round(http, url, (a, b)))
    print(f"/healthz p99 during loads: {', '.join(f'{p:.2f} ms' for p in p99s_ms)}")
    assert p99s_ms[-1] < P99_LIMIT_MS, p99s_ms
