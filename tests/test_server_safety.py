"""The load server against hostile clients (issue #11): each test is a finding of the
review, reproduced. Files beneath the roots only (shards and racing symlinks included),
nothing revealed about files outside, tokens, unguessable ids, a request's config held to
what the operator allows, limits with JSON reasons, bounded records, and ``aiogguf serve``
refusing to start unsafely."""

from __future__ import annotations

import ctypes
import io
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import gguf
import numpy as np
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream
from server_helpers import post, running

import aiogguf.server._app
from aiogguf.server._app import LoadLimiter, ServerPolicy, create_app, registry_of
from aiogguf.server._policy import REQUEST_KEYS
from aiogguf.testing.synth import write_synthetic_model

SECRET = b"root:$6$hash-of-a-password:19000:0:99999:7:::\n"


async def settled(http: aiohttp.ClientSession, url: str, load_id: str) -> dict[str, Any]:
    """The load's record once it is ready or has ended."""
    with anyio.fail_after(30):
        while True:
            async with http.get(f"{url}/models/{load_id}") as r:
                state: dict[str, Any] = await r.json()
            if state["state"] != "loading":
                return state
            await anyio.sleep(0.02)


def assert_reveals_nothing(body: dict[str, Any], path: Path | str) -> None:
    assert body == {"error": f"{path}: not under a served root"}


@pytest.fixture
def served(tmp_path: Path) -> Path:
    """``tmp_path/served`` with ``in.gguf``; ``tmp_path/shadow`` is a secret outside."""
    root = tmp_path / "served"
    root.mkdir()
    write_synthetic_model(root / "in.gguf", size_bytes="1MiB", seed=1)
    (tmp_path / "shadow").write_bytes(SECRET)
    return root


# --- files ----------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_path_outside_the_roots_reveals_nothing(served: Path, tmp_path: Path) -> None:
    """Finding 1: a client read /etc/shadow's first bytes, sizes and existence."""
    (served / "shadow-link").symlink_to(tmp_path / "shadow")
    (served / "dangling-link").symlink_to(tmp_path / "no-such-file")
    async with running(create_app(roots=[served])) as url, aiohttp.ClientSession() as http:
        for path in (
            tmp_path / "shadow",
            tmp_path / "no-such-file",
            served / "shadow-link",
            served / "dangling-link",
            f"{served}/../shadow",
        ):
            status, body = await post(http, url, path)
            assert status == 403
            assert_reveals_nothing(body, path)
        # ``~`` is not the server's home: it is a name like any other, beneath no root.
        status, body = await post(http, url, "~/.ssh/id_rsa")
        assert status == 403
        async with http.get(f"{url}/models") as r:
            assert (await r.json())["models"] == []


@pytest.mark.asyncio
@pytest.mark.parametrize("any_path", [False, True])
async def test_load_errors_never_show_a_files_bytes(tmp_path: Path, any_path: bool) -> None:
    """Finding 1: 'found b'root': not a GGUF file'. Whatever the server may read, an
    error says only that the magic is wrong."""
    secret = tmp_path / "shadow"
    secret.write_bytes(SECRET)
    app = create_app(allow_any_path=True) if any_path else create_app(roots=[tmp_path])
    async with running(app) as url, aiohttp.ClientSession() as http:
        status, body = await post(http, url, secret)
        assert status == 201, body
        state = await settled(http, url, body["id"])
        assert state["state"] == "failed"
        error = state["error"].removeprefix(f"{secret}: ")
        assert "not a GGUF file" in error
        for leak in ("root", "hash", "$6$"):
            assert leak not in error


def test_a_server_app_needs_roots_or_an_explicit_any_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="roots"):
        create_app()
    create_app(roots=[tmp_path])
    create_app(config=_config_with_roots(tmp_path))
    create_app(allow_any_path=True)


def _config_with_roots(root: Path) -> Path:
    toml = root / "server.toml"
    toml.write_text(f"[server]\nroots = [{str(root)!r}]\n".replace("'", '"'))
    return toml


@pytest.mark.asyncio
async def test_split_shards_are_held_to_the_roots(tmp_path: Path) -> None:
    """Finding 2: shards were never checked; one symlinked outside was read. Every
    shard is opened when the request is admitted (issue #24): refused at once, 403."""
    served, outside = tmp_path / "served", tmp_path / "outside"
    served.mkdir()
    outside.mkdir()
    write_synthetic_model(served / "m.gguf", size_bytes="2MiB", split_count=3, seed=1)
    write_synthetic_model(outside / "m.gguf", size_bytes="2MiB", split_count=3, seed=1)
    shard = served / "m-00002-of-00003.gguf"
    shard.unlink()
    shard.symlink_to(outside / "m-00002-of-00003.gguf")
    async with running(create_app(roots=[served])) as url, aiohttp.ClientSession() as http:
        status, body = await post(http, url, served / "m-00001-of-00003.gguf")
        assert status == 403, body
        assert_reveals_nothing(body, shard)


class ReadWatch:
    """Whether anyone reads ``path`` (inotify ``IN_ACCESS``): the test's own flipping of
    symlinks never opens their target, so any read is the server's."""

    IN_ACCESS = 0x1

    def __init__(self, path: Path) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        assert self.fd >= 0, os.strerror(ctypes.get_errno())
        wd = libc.inotify_add_watch(self.fd, os.fsencode(path), self.IN_ACCESS)
        assert wd >= 0, os.strerror(ctypes.get_errno())

    def read_happened(self) -> bool:
        try:
            return bool(os.read(self.fd, 4096))
        except BlockingIOError:
            return False

    def close(self) -> None:
        os.close(self.fd)


@pytest.mark.asyncio
async def test_a_symlink_flipped_during_requests_never_leads_outside(tmp_path: Path) -> None:
    """Finding 2: root checked first, file opened later: with a symlink flipped back and
    forth, 60 of 110 accepted requests read the file outside."""
    served, outside = tmp_path / "served", tmp_path / "outside"
    served.mkdir()
    outside.mkdir()
    write_synthetic_model(served / "in.gguf", size_bytes="1MiB", seed=1)
    write_synthetic_model(outside / "out.gguf", size_bytes="1MiB", seed=2)
    link = served / "link.gguf"
    link.symlink_to("in.gguf")
    stop = threading.Event()

    def flip() -> None:
        targets = ("in.gguf", str(outside / "out.gguf"))
        n = 0
        while not stop.is_set():
            tmp = served / "link.tmp"
            tmp.symlink_to(targets[n % 2])
            tmp.replace(link)
            n += 1
            time.sleep(0.0005)

    watch = ReadWatch(outside / "out.gguf")
    flipper = threading.Thread(target=flip)
    flipper.start()
    statuses: list[int] = []
    try:
        app = create_app(roots=[served], limiter=LoadLimiter(max_loads=8))
        async with running(app) as url, aiohttp.ClientSession() as http:
            ids = []
            for _ in range(60):
                status, body = await post(http, url, link, check_tensors=False)
                statuses.append(status)
                # 200: the file the link names now is loading or loaded already.
                assert status in (200, 201, 403), body
                if status in (200, 201):
                    ids.append(body["id"])
            for load_id in ids:
                await settled(http, url, load_id)
    finally:
        stop.set()
        flipper.join()
    try:
        assert 201 in statuses, "no request was accepted"
        assert not watch.read_happened(), "the server read the file outside the root"
    finally:
        watch.close()


# --- clients ----------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_token_guards_every_route_but_healthz(served: Path, tmp_path: Path) -> None:
    """Finding 6: no authentication at all."""
    token = "s3cret-token"
    app = create_app(roots=[served], policy=ServerPolicy(token=token))
    good = {"Authorization": f"Bearer {token}"}
    async with running(app) as url, aiohttp.ClientSession() as http:
        async with http.get(f"{url}/healthz") as r:
            assert r.status == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": token}):
            for method, route in (("GET", "/models"), ("POST", "/models"), ("GET", "/nope")):
                async with http.request(method, f"{url}{route}", headers=headers) as r:
                    assert r.status == 401
                    assert "Bearer" in (await r.json())["error"]
        async with http.post(
            f"{url}/models", json={"path": str(served / "in.gguf")}, headers=good
        ) as r:
            assert r.status == 201
            load_id = (await r.json())["id"]
        async with http.get(f"{url}/models/{load_id}", headers=good) as r:
            assert r.status == 200


@pytest.mark.asyncio
async def test_model_ids_are_unguessable(served: Path) -> None:
    """Finding 6: ids were 1, 2, 3…, so any client could DELETE another's model."""
    async with running(create_app(roots=[served])) as url, aiohttp.ClientSession() as http:
        ids = set()
        # Three placements of one file: three models (one placement would be one).
        for config in ({}, {"check_tensors": False}, {"prefetch": False}):
            status, body = await post(http, url, served / "in.gguf", **config)
            assert status == 201
            ids.add(body["id"])
    assert len(ids) == 3
    for load_id in ids:
        assert len(load_id) == 32
        int(load_id, 16)  # 128 random bits, in hex


# --- requests cannot freeze or exhaust the server ------------------------------------------


def test_override_patterns_match_in_linear_time(tmp_path: Path) -> None:
    """Finding 3: ``(.|.)*Z`` froze the loop for 10 s under ``re`` (exponential in the
    name's length). Planned here for a tensor with a 63-byte name, in a process of its
    own, so that an engine that backtracks fails this test instead of hanging the suite."""
    model = tmp_path / "long-name.gguf"
    writer = gguf.GGUFWriter(model, "llama")
    writer.add_block_count(1)
    writer.add_tensor("blk.0." + "a" * 50 + ".weight", np.zeros((2, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    command = [sys.executable, "-m", "aiogguf", "plan", str(model), "-ot", "(.|.)*Z=CPU"]
    try:
        result = subprocess.run(command, cwd=tmp_path, capture_output=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("planning one tensor with one override pattern did not end in 60 s")
    assert result.returncode == 0, result.stderr


@pytest.mark.asyncio
async def test_a_request_sets_only_what_the_operator_allows(served: Path) -> None:
    """Finding 5: 'validate_workers': 1000 started 1,009 threads; any request could mlock."""
    async with running(create_app(roots=[served])) as url, aiohttp.ClientSession() as http:
        model = served / "in.gguf"
        for config, status, words in (
            ({"validate_workers": 1000}, 403, "validate_workers"),
            ({"readers": 1000}, 403, "readers"),
            ({"queue_depth": 10**20}, 403, "queue_depth"),
            ({"sim_gpus": ["1TiB"]}, 403, "sim_gpus"),
            ({"mode": "mlock"}, 403, "mlock"),
            ({"mode": "direct"}, 403, "direct"),
            ({"override": [{"pattern": r"(a)\1", "buffer_type": "CPU"}]}, 400, "RE2"),
        ):
            got, body = await post(http, url, model, **config)
            assert got == status, (config, body)
            assert words in body["error"]
        async with http.get(f"{url}/models") as r:
            assert (await r.json())["models"] == []
        status, body = await post(http, url, model, mode="mmap", check_tensors=False)
        assert status == 201, body
        assert (await settled(http, url, body["id"]))["state"] == "ready"


@pytest.mark.asyncio
async def test_the_operator_widens_keys_and_modes_but_values_stay_capped(served: Path) -> None:
    policy = ServerPolicy(request_keys=REQUEST_KEYS | {"readers"}, modes=frozenset({"mlock"}))
    async with (
        running(create_app(roots=[served], policy=policy)) as url,
        aiohttp.ClientSession() as http,
    ):
        model = served / "in.gguf"
        status, body = await post(http, url, model, readers=200)
        assert status == 403
        # The server's own readers are "auto": this machine's count, below 200.
        assert re.search(r"readers 200 is above this server's \d+", body["error"]), body
        # Accepted; whether the lock then succeeds is RLIMIT_MEMLOCK's business.
        status, body = await post(http, url, model, readers=1, mode="mlock")
        assert status == 201, body
        assert (await settled(http, url, body["id"]))["state"] in ("ready", "failed")


@pytest.mark.asyncio
async def test_the_servers_default_mode_copies(served: Path) -> None:
    async with running(create_app(roots=[served])) as url, aiohttp.ClientSession() as http:
        status, body = await post(http, url, served / "in.gguf")
        assert status == 201
        state = await settled(http, url, body["id"])
        assert state["report"]["mode"] == "none"


@pytest.mark.asyncio
async def test_models_and_bytes_held_are_limited(served: Path) -> None:
    """Finding 5: six POSTs of a 400 MiB model took the server to 2.57 GiB."""
    size = (served / "in.gguf").stat().st_size
    policy = ServerPolicy(max_models=2, max_loaded_bytes=3 * size)
    app = create_app(roots=[served], policy=policy)
    path = str(served / "in.gguf")
    # Pinned models (and leased or loading ones) are never evicted to make room.
    placements = [{"check_tensors": False}, {"prefetch": False}, {"lazy": "off"}]
    async with running(app) as url, aiohttp.ClientSession() as http:
        ids = []
        for config in placements[:2]:
            body = {"path": path, "config": config, "pin": True}
            async with http.post(f"{url}/models", json=body) as r:
                assert r.status == 201
                ids.append((await r.json())["id"])
        third = {"path": path, "config": placements[2], "pin": True}
        async with http.post(f"{url}/models", json=third) as r:
            assert r.status == 429
            assert "limit" in (await r.json())["error"]
        async with http.delete(f"{url}/models/{ids[0]}") as r:
            assert r.status == 200
        async with http.post(f"{url}/models", json=third) as r:
            assert r.status == 201

    big = ServerPolicy(max_loaded_bytes=size + size // 2)
    async with (
        running(create_app(roots=[served], policy=big)) as url,
        aiohttp.ClientSession() as http,
    ):
        async with http.post(f"{url}/models", json={"path": path, "pin": True}) as r:
            assert r.status == 201
        status, body = await post(http, url, served / "in.gguf", check_tensors=False)
        assert status == 507
        assert str(size) in body["error"]


@pytest.mark.asyncio
async def test_records_of_ended_loads_are_bounded(
    served: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 5: 3,000 failed POSTs added 35 MiB: records were kept forever."""
    junk = served / "junk.gguf"
    junk.write_bytes(b"not a model" * 10)
    app = create_app(roots=[served], policy=ServerPolicy(max_finished=3, finished_ttl_s=60))
    async with running(app) as url, aiohttp.ClientSession() as http:
        ids = []
        for _ in range(6):
            status, body = await post(http, url, junk)
            assert status == 201
            ids.append(body["id"])
            assert (await settled(http, url, body["id"]))["state"] == "failed"
        async with http.get(f"{url}/models") as r:
            kept = [m["id"] for m in (await r.json())["models"]]
        assert kept == ids[-3:]
        # Past the TTL, none is kept.
        registry = registry_of(app)
        clock = time.monotonic
        monkeypatch.setattr(aiogguf.server._app.time, "monotonic", lambda: clock() + 61)
        async with http.get(f"{url}/models") as r:
            assert (await r.json())["models"] == []
        assert registry.entries == {}


@pytest.mark.asyncio
async def test_every_error_reply_is_json(served: Path) -> None:
    """Finding 7: 404/405 for unknown routes and 413 for a big body were plain text."""
    async with running(create_app(roots=[served])) as url, aiohttp.ClientSession() as http:
        for method, route, kwargs, status in (
            ("GET", "/nope", {}, 404),
            ("PUT", "/models", {}, 405),
            ("POST", "/models", {"data": io.BytesIO(b"x" * (2 << 20))}, 413),
        ):
            async with http.request(method, f"{url}{route}", **kwargs) as r:
                assert r.status == status
                assert r.content_type == "application/json"
                error = (await r.json())["error"]
                assert error
                assert "\n" not in error


# --- aiogguf serve ----------------------------------------------------------------------


def serve(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``aiogguf serve`` with ``args``; one that starts listening is a failure here."""
    try:
        return subprocess.run(
            [sys.executable, "-m", "aiogguf", "serve", *args],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=20,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"aiogguf serve {' '.join(args)} started instead of refusing: {exc.stdout!r}")


UNSAFE_STARTS = [
    ((), "--root"),  # finding 1: it served any file by default
    (("--root", "/nonexistent"), "/nonexistent"),  # finding 7: started, refused all
    (("--port", "99999", "--root", "."), "99999"),  # finding 7: a random port
    (("--host", "0.0.0.0", "--root", "."), "--token-file"),  # finding 6: no warning
]


@pytest.fixture(scope="module")
def unsafe_starts(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[tuple[str, ...], subprocess.CompletedProcess[str] | str]:
    """Each unsafe ``aiogguf serve`` in a process of its own, side by side (each waits
    mostly for its interpreter to start): args → the finished process, or why it is a
    failure."""

    def run(args: tuple[str, ...]) -> subprocess.CompletedProcess[str] | str:
        cwd = tmp_path_factory.mktemp("serve")
        try:
            return serve("--port", "0", *args, cwd=cwd)
        except pytest.fail.Exception as exc:
            return str(exc)

    all_args = [args for args, _ in UNSAFE_STARTS]
    with ThreadPoolExecutor(max_workers=len(all_args)) as pool:
        return dict(zip(all_args, pool.map(run, all_args), strict=True))


@pytest.mark.parametrize(("args", "words"), UNSAFE_STARTS)
def test_cli_serve_refuses_to_start_unsafely(
    unsafe_starts: dict[tuple[str, ...], subprocess.CompletedProcess[str] | str],
    args: tuple[str, ...],
    words: str,
) -> None:
    result = unsafe_starts[args]
    if isinstance(result, str):
        pytest.fail(result)
    assert result.returncode == 2, result
    assert result.stderr.count("\n") == 1, result.stderr
    assert words in result.stderr
    assert result.stdout == ""


@pytest.mark.asyncio
async def test_cli_serve_warns_of_its_escapes(tmp_path: Path) -> None:
    command = [
        *(sys.executable, "-m", "aiogguf", "serve", "--port", "0", "--allow-any-path"),
        *("--host", "0.0.0.0", "--insecure"),
    ]
    async with await anyio.open_process(command, cwd=tmp_path) as proc:
        assert proc.stderr is not None
        stderr = BufferedByteReceiveStream(proc.stderr)
        with anyio.fail_after(30):
            first = (await stderr.receive_until(b"\n", 4096)).decode()
            second = (await stderr.receive_until(b"\n", 4096)).decode()
        proc.terminate()
        await proc.wait()
    assert "warning: --allow-any-path" in first
    assert "warning: --insecure" in second
