"""The load server's model manager (issue 37): keep-alive, pins, preloads, one model for
two requests of the same load, eviction by reload cost under the budget, DELETE of a
leased model. Real servers on 127.0.0.1, real files; leases taken in-process
(``LoaderRegistry.lease``), as an attached client holds one."""

from __future__ import annotations

import logging
import math
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st
from server_helpers import running

import aiogguf.server._app
from aiogguf._config import Config
from aiogguf._units import MAX_DURATION_S, format_duration, parse_duration
from aiogguf.server._app import LoadState, ServerPolicy, create_app, registry_of
from aiogguf.server._manager import ReloadRates, SourceKind, choose_victims
from aiogguf.testing.synth import write_synthetic_model

# Generous: these tell "happens" from "never happens", not fast from slow.
WITHIN_S = 30


async def post(
    http: aiohttp.ClientSession, url: str, path: Path, **body: Any
) -> tuple[int, dict[str, Any]]:
    async with http.post(f"{url}/models", json={"path": str(path), **body}) as r:
        return r.status, await r.json()


async def get(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url) as r:
        assert r.status == 200, await r.text()
        body: dict[str, Any] = await r.json()
        return body


async def until(entry: Any, done: Any, within_s: float = WITHIN_S) -> None:
    """Wait (bounded) until ``done(entry)``, woken by the entry's own news."""
    with anyio.fail_after(within_s):
        while not done(entry):
            with anyio.move_on_after(0.2):  # a deadline passing publishes nothing
                await entry.changed.wait()


def ready(entry: Any) -> bool:
    return entry.state is LoadState.READY


def ended(entry: Any) -> bool:
    return entry.finished.is_set()


def models(tmp_path: Path, sizes: dict[str, str]) -> dict[str, Path]:
    paths = {}
    for seed, (name, size) in enumerate(sizes.items()):
        paths[name] = tmp_path / f"{name}.gguf"
        write_synthetic_model(paths[name], size_bytes=size, seed=seed, n_layer=1)
    return paths


# --- keep_alive ---------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_keep_alive_zero_unloads_when_the_last_lease_ends(tmp_path: Path) -> None:
    path = models(tmp_path, {"m": "1MiB"})["m"]
    app = create_app(roots=[tmp_path])
    registry = registry_of(app)
    async with running(app) as url, aiohttp.ClientSession() as http:
        status, body = await post(http, url, path)
        assert status == 201, body
        entry = registry.entries[body["id"]]
        await until(entry, ready)
        assert (await get(http, f"{url}/models/{entry.id}"))["keep_alive"] == -1
        with registry.lease(entry):
            # The same load again: the same model, now with keep_alive 0.
            status, again = await post(http, url, path, keep_alive=0)
            assert (status, again["id"]) == (200, entry.id)
            shown = await get(http, f"{url}/models/{entry.id}")
            assert (shown["keep_alive"], shown["leases"], shown["expires_at"]) == (0, 1, None)
            await anyio.sleep(0.3)
            assert entry.state is LoadState.READY  # leased: kept
        await until(entry, ended)
        assert entry.state is LoadState.UNLOADED
        assert entry.unload_reason == "keep_alive expired"
        assert registry.held() == (0, 0)

        # Never leased: keep_alive runs from the moment it is ready.
        status, body = await post(http, url, path, keep_alive="0s")
        assert status == 201, body
        await until(registry.entries[body["id"]], ended)
        assert registry.entries[body["id"]].state is LoadState.UNLOADED


@pytest.mark.asyncio
async def test_keep_alive_duration_expires_an_idle_model(tmp_path: Path) -> None:
    path = models(tmp_path, {"m": "1MiB"})["m"]
    app = create_app(roots=[tmp_path], policy=ServerPolicy(keep_alive_s=2.0))
    registry = registry_of(app)
    async with running(app) as url, aiohttp.ClientSession() as http:
        status, body = await post(http, url, path)  # the server's keep_alive: 2 s
        assert status == 201, body
        entry = registry.entries[body["id"]]
        await until(entry, ready)
        shown = await get(http, f"{url}/models/{entry.id}")
        assert shown["keep_alive"] == 2.0
        left = datetime.fromisoformat(shown["expires_at"]) - datetime.fromisoformat(
            shown["last_used"]
        )
        assert abs(left.total_seconds() - 2.0) < 0.01
        listed = await get(http, f"{url}/models")
        assert listed["budget"]["keep_alive"] == 2.0
        await until(entry, ended)
        assert entry.unload_reason == "keep_alive expired"


@pytest.mark.timing
@pytest.mark.asyncio
async def test_keep_alive_expiry_is_on_time(tmp_path: Path) -> None:
    path = models(tmp_path, {"m": "1MiB"})["m"]
    app = create_app(roots=[tmp_path])
    registry = registry_of(app)
    async with running(app) as url, aiohttp.ClientSession() as http:
        _status, body = await post(http, url, path, keep_alive="500ms")
        entry = registry.entries[body["id"]]
        await until(entry, ready)
        with registry.lease(entry):
            await anyio.sleep(1.0)
            assert entry.state is LoadState.READY
        released = time.monotonic()
        await until(entry, ended, within_s=5)
        took = time.monotonic() - released
    print(f"unloaded {took:.3f} s after its last lease ended (keep_alive 0.5 s)")
    assert 0.45 <= took < 0.8


# --- one model for one load ---------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_post_of_the_same_load_returns_the_same_model(tmp_path: Path) -> None:
    path = models(tmp_path, {"m": "1MiB"})["m"]
    app = create_app(roots=[tmp_path])
    registry = registry_of(app)
    async with running(app) as url, aiohttp.ClientSession() as http:
        status, first = await post(http, url, path)
        assert status == 201
        status, second = await post(http, url, path, keep_alive="5m", pin=True)
        assert status == 200
        assert second["id"] == first["id"]
        entry = registry.entries[first["id"]]
        assert (entry.keep_alive_s, entry.pinned) == (300.0, True)
        await until(entry, ready)
        status, third = await post(http, url, path)  # says nothing: changes nothing
        assert (status, third["id"], entry.pinned) == (200, first["id"], True)
        # Another placement is another model.
        status, other = await post(http, url, path, config={"check_tensors": False})
        assert status == 201
        assert other["id"] != first["id"]
        # Another file under the same name is another model.
        path.rename(tmp_path / "old.gguf")
        write_synthetic_model(path, size_bytes="1MiB", seed=7, n_layer=1)
        status, replaced = await post(http, url, path)
        assert status == 201
        assert replaced["id"] != first["id"]
        assert len({e.id for e in registry.entries.values() if e.holds_memory}) == 3


@pytest.mark.asyncio
async def test_bad_keep_alive_and_pin_are_refused(tmp_path: Path) -> None:
    path = models(tmp_path, {"m": "256KiB"})["m"]
    async with running(create_app(roots=[tmp_path])) as url, aiohttp.ClientSession() as http:
        for bad in ("5 min", "1d", True, "nan", [1]):
            status, body = await post(http, url, path, keep_alive=bad)
            assert status == 400, body
            assert "keep_alive" in body["error"]
        status, body = await post(http, url, path, pin="yes")
        assert status == 400
        assert "pin" in body["error"]


# --- eviction -----------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_budget_squeeze_evicts_idle_models_cheapest_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four resident models, the largest leased; a fifth that needs the room of two evicts
    the two cheapest to reload (the smallest, at one measured rate), not the third idle
    one and never the leased one, and begins only once their memory is freed."""
    freed: dict[int, float] = {}
    close_model = aiogguf.server._app._close_model

    async def slow_close(model: Any) -> None:
        # Freeing many GiB takes time: the new load must wait for it, not overlap it.
        await anyio.sleep(0.3)
        await close_model(model)
        freed[id(model)] = time.monotonic()

    monkeypatch.setattr(aiogguf.server._app, "_close_model", slow_close)
    paths = models(tmp_path, {"leased": "4MiB", "b": "1MiB", "c": "2MiB", "d": "3MiB"})
    sizes = {name: p.stat().st_size for name, p in paths.items()}
    new = tmp_path / "new.gguf"
    write_synthetic_model(new, size_bytes="2560KiB", seed=9, n_layer=1)
    budget = sum(sizes.values())
    huge = tmp_path / "huge.gguf"
    write_synthetic_model(huge, size_bytes="7MiB", seed=10, n_layer=1)
    assert huge.stat().st_size > budget - sizes["leased"]
    assert sizes["b"] < new.stat().st_size <= sizes["b"] + sizes["c"]
    app = create_app(roots=[tmp_path], policy=ServerPolicy(max_loaded_bytes=budget))
    registry = registry_of(app)
    async with running(app) as url, aiohttp.ClientSession() as http:
        entries = {}
        for name, path in paths.items():
            status, body = await post(http, url, path)
            assert status == 201, body
            entries[name] = registry.entries[body["id"]]
            await until(entries[name], ready)
        listed = {m["id"]: m for m in (await get(http, f"{url}/models"))["models"]}
        costs = {name: listed[e.id]["reload_s"] for name, e in entries.items()}
        assert costs["b"] < costs["c"] < costs["d"] < costs["leased"]
        model_ids = {name: id(e.model) for name, e in entries.items()}
        began: list[float] = []
        reserve = registry.limiter.reserve

        def reserve_watched(*args: Any, **kwargs: Any) -> Any:
            began.append(time.monotonic())
            return reserve(*args, **kwargs)

        monkeypatch.setattr(registry.limiter, "reserve", reserve_watched)
        with registry.lease(entries["leased"]):
            status, body = await post(http, url, new)
            assert status == 201, body
            incoming = registry.entries[body["id"]]
            await until(incoming, ready)
            assert entries["b"].state is LoadState.UNLOADED
            assert entries["c"].state is LoadState.UNLOADED
            assert entries["b"].unload_reason == f"evicted for load {incoming.id}"
            assert entries["d"].state is LoadState.READY
            assert entries["leased"].state is LoadState.READY
            assert registry.held()[1] <= budget
            # Its load took its place only once both evicted models were freed.
            assert len(began) == 1
            assert began[0] >= max(freed[model_ids["b"]], freed[model_ids["c"]])
            # Evicting every idle model would not make room: 507, saying why, and
            # nothing is evicted for it.
            status, body = await post(http, url, huge)
            assert status == 507, body
            assert "1 leased" in body["error"]
            assert entries["d"].state is LoadState.READY


@pytest.mark.asyncio
async def test_a_pinned_model_survives_everything_but_delete(tmp_path: Path) -> None:
    paths = models(tmp_path, {"pinned": "1MiB", "other": "1MiB"})
    policy = ServerPolicy(max_models=1, keep_alive_s=0.0)
    app = create_app(roots=[tmp_path], policy=policy)
    registry = registry_of(app)
    async with running(app) as url, aiohttp.ClientSession() as http:
        status, body = await post(http, url, paths["pinned"], pin=True)
        assert status == 201, body
        pinned = registry.entries[body["id"]]
        await until(pinned, ready)
        # keep_alive 0 would have unloaded it at once; the count limit cannot evict it.
        status, refused = await post(http, url, paths["other"])
        assert status == 429, refused
        assert "1 pinned" in refused["error"]
        await anyio.sleep(0.3)
        assert pinned.state is LoadState.READY
        shown = await get(http, f"{url}/models/{pinned.id}")
        assert shown["pinned"] is True
        assert shown["expires_at"] is None
        async with http.delete(f"{url}/models/{pinned.id}") as r:
            assert r.status == 200
        assert pinned.state is LoadState.UNLOADED
        status, body = await post(http, url, paths["other"])
        assert status == 201, body


def test_victims_are_the_cheapest_then_the_least_recently_used() -> None:
    @dataclass
    class M:
        name: str
        nbytes: int
        reload_s: float
        last_used: float

    a, b, c = M("a", 10, 1.0, 5.0), M("b", 10, 1.0, 1.0), M("c", 30, 3.0, 0.0)
    assert choose_victims([a, b, c], 5, 0) == [b]  # equal cost: the least recently used
    assert choose_victims([a, b, c], 0, 2) == [b, a]
    # b and a are cheap but 25 bytes need c; either cheap one beside it is needless...
    assert choose_victims([a, b, c], 35, 0) == [a, c]
    assert choose_victims([a, b, c], 30, 0) == [c]
    assert choose_victims([a, b, c], 51, 0) is None  # all of them would not do
    assert choose_victims([a], 0, 2) is None
    assert choose_victims([], 0, 0) == []


def test_reload_rates_learn_from_loads() -> None:
    rates = ReloadRates()
    assert rates.reload_seconds(4 * 10**9, SourceKind.CACHE, None) == 1.0  # default 4 GB/s
    assert rates.record(SourceKind.DISK, 1024, 1.0) is None  # too small to say
    assert rates.record(SourceKind.DISK, 2 * 10**9, 4.0) == 5e8
    assert rates.reload_seconds(10**9, SourceKind.DISK, None) == 2.0
    assert rates.reload_seconds(10**9, SourceKind.DISK, 1e9) == 1.0  # its own rate first
    rates.record(SourceKind.DISK, 10**9, 1.0)
    assert rates.rate(SourceKind.DISK) == 7.5e8
    assert rates.measured() == {"disk": 7.5e8}


# --- DELETE of a leased model ------------------------------------------------------------


@pytest.mark.asyncio
async def test_delete_of_a_leased_model_is_409_unless_forced(tmp_path: Path) -> None:
    path = models(tmp_path, {"m": "1MiB"})["m"]
    app = create_app(roots=[tmp_path])
    registry = registry_of(app)
    async with running(app) as url, aiohttp.ClientSession() as http:
        _status, body = await post(http, url, path)
        entry = registry.entries[body["id"]]
        await until(entry, ready)
        with registry.lease(entry), registry.lease(entry):
            async with http.delete(f"{url}/models/{entry.id}") as r:
                assert r.status == 409
                assert "leased by 2 clients" in (await r.json())["error"]
            assert entry.state is LoadState.READY
            assert not entry.unload.is_set()
            async with http.delete(f"{url}/models/{entry.id}?force=true") as r:
                assert r.status == 200
                assert (await r.json())["state"] == "unloaded"
            assert entry.unload.is_set()  # what the attach side tells its clients by
            assert entry.unload_reason == "forced DELETE (2 leases)"
        assert entry.leases == 0


# --- preloads ------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_preloads_at_start_and_a_failed_one_is_listed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = models(tmp_path, {"m": "1MiB"})["m"]
    config = tmp_path / "serve.toml"
    config.write_text(
        "[server]\n"
        f'roots = ["{tmp_path}"]\n'
        'keep_alive = "10m"\n'
        "[[server.preload]]\n"
        f'path = "{path}"\n'
        'keep_alive = "1h"\n'
        "pin = true\n"
        "config = { check_tensors = false }\n"
        "[[server.preload]]\n"
        f'path = "{tmp_path / "missing.gguf"}"\n'
    )
    caplog.set_level(logging.WARNING, logger="aiogguf.server._app")
    app = create_app(config=Config.from_toml(config))
    registry = registry_of(app)
    async with running(app) as url, aiohttp.ClientSession() as http:
        with anyio.fail_after(WITHIN_S):
            while len(registry.entries) < 2:  # noqa: ASYNC110  (no event for a new entry)
                await anyio.sleep(0.05)
            for entry in list(registry.entries.values()):
                await until(entry, lambda e: e.settled)
        listed = (await get(http, f"{url}/models"))["models"]
    by_path = {m["path"]: m for m in listed}
    good = by_path[str(path)]
    assert (good["state"], good["pinned"], good["keep_alive"]) == ("ready", True, 3600.0)
    bad = by_path[str(tmp_path / "missing.gguf")]
    assert bad["state"] == "failed"
    assert "missing.gguf" in bad["error"]
    lines = [r.getMessage() for r in caplog.records if "preload" in r.getMessage()]
    assert len(lines) == 1
    assert "missing.gguf" in lines[0]
    assert "\n" not in lines[0]
    assert registry.keep_alive_s == 600.0


def test_bad_server_keep_alive_in_the_config_is_one_clear_error(tmp_path: Path) -> None:
    config = tmp_path / "serve.toml"
    config.write_text('[server]\nkeep_alive = "5 minutes"\n')
    with pytest.raises(Exception, match=r"server\.keep_alive: expected a duration like '5m'"):
        Config.from_toml(config)


# --- durations --------------------------------------------------------------------------

UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


@given(st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(sorted(UNITS))), min_size=1))
def test_go_durations_parse_to_their_sum(parts: list[tuple[int, str]]) -> None:
    text = "".join(f"{n}{unit}" for n, unit in parts)
    expected = sum(n * UNITS[unit] for n, unit in parts)
    if len(text) > 64 or expected > MAX_DURATION_S:
        with pytest.raises(ValueError, match="too long"):
            parse_duration(text)
        return
    assert math.isclose(parse_duration(text), expected, rel_tol=1e-9, abs_tol=1e-12)
    if len(text) < 64:
        # Any negative: forever ("-0s" is 0).
        assert parse_duration("-" + text) == (math.inf if expected else 0.0)


@given(st.floats(min_value=0, max_value=MAX_DURATION_S) | st.integers(0, 10**9))
def test_seconds_round_trip_through_the_written_form(seconds: float) -> None:
    parsed = parse_duration(seconds)
    # To the nanosecond, Go's unit.
    assert math.isclose(parse_duration(format_duration(parsed)), parsed, abs_tol=1e-9)


@given(st.text(max_size=20) | st.floats() | st.integers() | st.booleans() | st.none())
def test_any_value_is_a_duration_or_a_value_error(value: Any) -> None:
    error: ValueError | None = None
    try:
        seconds = parse_duration(value)
    except ValueError as exc:
        error = exc
    if error is not None:
        assert "\n" not in str(error)
        return
    assert seconds == math.inf or 0 <= seconds <= MAX_DURATION_S


def test_serve_refuses_a_bad_keep_alive_in_one_line(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "aiogguf", "serve", "--root", str(tmp_path), "--keep-alive", "5min"],
        capture_output=True,
        text=True,
        timeout=WITHIN_S,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("aiogguf serve: --keep-alive: expected a duration like")
    assert result.stderr.count("\n") == 1
