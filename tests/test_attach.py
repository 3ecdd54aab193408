"""Attach (issue 37): processes map a server's resident model over its Unix socket.

A real server (``create_app`` with its attach listener, HTTP on 127.0.0.1 only, or
``aiogguf serve --socket``) in a folder of the test's; clients attach by id and by path
and read what gguf-py reads; a client killed with SIGKILL gives its lease back within a
second; a peer of another uid is refused before a byte of its request is read; hostile
clients (a huge length, garbage, silence, 10,000 descriptors) are refused and the server
goes on; a cancelled attach ends within a second; the socket is made safely."""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import gguf
import numpy as np
import pytest
from server_helpers import running

import aiogguf
from aiogguf.errors import AttachError
from aiogguf.resident import share_model
from aiogguf.resident._protocol import MAX_MESSAGE_BYTES, encode
from aiogguf.server._app import ServerPolicy, create_app, registry_of
from aiogguf.server._attach import AttachAccess, AttachListener, bind_socket
from aiogguf.testing.synth import write_synthetic_model

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("attach-models")
    write_synthetic_model(folder / "m.gguf", size_bytes="4MiB", seed=7, n_layer=2)
    return folder


@contextlib.asynccontextmanager
async def attach_server(
    model_dir: Path, sock: Path, access: AttachAccess | None = None, **policy: Any
) -> AsyncIterator[tuple[str, Any, AttachListener]]:
    """HTTP on 127.0.0.1 and the attach socket at ``sock``: (base URL, registry,
    listener)."""
    app = create_app(roots=[model_dir], policy=ServerPolicy(**policy))
    async with running(app) as url:
        registry = registry_of(app)
        async with AttachListener(registry, str(sock), access).running() as listener:
            yield url, registry, listener


def gguf_bytes(path: Path) -> dict[str, bytes]:
    reader = gguf.GGUFReader(path)
    return {t.name: np.asarray(t.data).tobytes() for t in reader.tensors}


async def wait_for(predicate: Any, what: str, limit_s: float = 5.0) -> float:
    """Seconds until ``predicate()`` holds, polled every 10 ms; fails past ``limit_s``."""
    start = time.monotonic()
    for _ in range(int(limit_s / 0.01) + 1):
        if predicate():
            return time.monotonic() - start
        await anyio.sleep(0.01)
    raise AssertionError(f"{what}: not within {limit_s} s")


def leases(registry: Any) -> list[int]:
    return [e.leases for e in registry.entries.values()]


class RawClient:
    """A client that speaks the protocol by hand (blocking; run it on a thread)."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(str(path))

    def receive(self) -> tuple[dict[str, Any], list[int]]:
        header, fds, _flags, _ = socket.recv_fds(self.sock, 4, 64)
        if not header:
            raise EOFError
        while len(header) < 4:
            header += self.sock.recv(4 - len(header))
        (length,) = struct.unpack(">I", header)
        payload = b""
        while len(payload) < length:
            chunk = self.sock.recv(length - len(payload))
            assert chunk
            payload += chunk
        return json.loads(payload), list(fds)

    def closed(self) -> bool:
        """Whether the server has closed its end (EOF within 10 s)."""
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


def close_fds(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


# --- attach and read ----------------------------------------------------------------


@pytest.mark.asyncio
async def test_attach_by_path_and_by_id_reads_what_gguf_py_reads(
    model_dir: Path, tmp_path: Path
) -> None:
    sock = tmp_path / "s.sock"
    path = model_dir / "m.gguf"
    expected = gguf_bytes(path)
    async with attach_server(model_dir, sock) as (url, registry, _):
        assert stat.S_IMODE(os.lstat(sock).st_mode) == 0o600
        progress: list[Any] = []
        async with aiogguf.attach(
            path, socket=sock, config={"mode": "mmap"}, progress=progress.append
        ) as m:
            assert {n: bytes(m.raw(n)) for n in m.tensors} == expected
            assert leases(registry) == [1]
            # The server started the load for this client, which heard it begin.
            assert progress[0]["type"] == "progress"
            assert progress[0]["state"] == "loading"
            (entry,) = registry.entries.values()
            # A second client by the id the server gave: the same resident model.
            async with aiogguf.attach(entry.id, socket=sock) as again:
                assert leases(registry) == [2]
                name = next(iter(expected))
                assert bytes(again.raw(name)) == expected[name]
            # The server hears the connection close: at once, on its loop.
            await wait_for(lambda: leases(registry) == [1], "second lease released")
            # The same path and config again: no second load.
            async with aiogguf.attach(str(path), socket=sock, config={"mode": "mmap"}):
                assert leases(registry) == [2]
                assert len(registry.entries) == 1
        await wait_for(lambda: leases(registry) == [0], "leases released")
        # The model stays resident for the next client; HTTP lists it.
        async with aiohttp.ClientSession() as http, http.get(f"{url}/models") as r:
            assert [m["state"] for m in (await r.json())["models"]] == ["ready"]


REFERENCE = [
    "tiny-llama-F16.gguf",
    "tiny-llama-Q4_K_M.gguf",
    "tiny-llama-Q5_1-bf16emb.gguf",
    "tiny-llama-Q4_K_M-split-00001-of-00003.gguf",
]


def shards_bytes(folder: Path, name: str) -> dict[str, bytes]:
    """Every tensor of ``name`` (and of its split set's other shards) as gguf-py reads it."""
    shards = sorted(folder.glob(name.replace("00001", "*")))
    return {k: v for shard in shards for k, v in gguf_bytes(shard).items()}


@pytest.mark.asyncio
async def test_reference_files_attached_read_what_gguf_py_reads(
    reference_dir: Path, tmp_path: Path
) -> None:
    sock = tmp_path / "s.sock"
    async with attach_server(reference_dir, sock) as (_, registry, _):
        for name in REFERENCE:
            path = reference_dir / name
            expected = shards_bytes(reference_dir, name)
            async with aiogguf.attach(path, socket=sock, config={"mode": "mmap"}) as m:
                assert {n: bytes(m.raw(n)) for n in m.tensors} == expected, name
        assert len(registry.entries) == len(REFERENCE)


def test_a_write_through_a_clients_torch_tensor_stays_in_that_client(
    model_dir: Path, tmp_path: Path
) -> None:
    """Two clients of one resident model (one of them a thread here, one the server's
    own process): the first zeroes a tensor through torch; the server and the second
    client still read the file's bytes. ``model.close()`` ends the lease."""
    pytest.importorskip("torch")
    sock = tmp_path / "s.sock"
    path = model_dir / "m.gguf"
    expected = gguf_bytes(path)
    name = max(expected, key=lambda n: len(expected[n]))
    seen: dict[str, Any] = {}

    async def main() -> None:
        async with attach_server(model_dir, sock) as (_, registry, _):

            def clients() -> None:
                with aiogguf.attach_sync(path, socket=sock, config={"mode": "mmap"}) as a:
                    tensor = a.torch(name)
                    tensor.zero_()
                    seen["a"] = bytes(tensor.contiguous().view(-1).view(torch_uint8()).numpy())
                    (load_id,) = registry.entries
                    with aiogguf.attach_sync(load_id, socket=sock) as second:
                        seen["b"] = bytes(second.raw(name))
                        as_bytes = second.torch(name).contiguous().view(-1).view(torch_uint8())
                        seen["b_torch"] = as_bytes.numpy().tobytes()
                        seen["leases"] = registry.entries[load_id].leases
                        second.close()  # closing the model ends its lease
                        for _ in range(500):  # 5 s at most
                            if registry.entries[load_id].leases == 1:
                                break
                            time.sleep(0.01)
                        seen["after_close"] = registry.entries[load_id].leases

            await anyio.to_thread.run_sync(clients)
            (entry,) = registry.entries.values()
            seen["server"] = bytes(entry.model.raw(name))
            await wait_for(lambda: entry.leases == 0, "leases released")

    anyio.run(main)
    assert set(seen["a"]) == {0}
    assert seen["b"] == seen["b_torch"] == seen["server"] == expected[name]
    assert seen["leases"] == 2
    assert seen["after_close"] == 1


def torch_uint8() -> Any:
    import torch

    return torch.uint8


@pytest.mark.asyncio
async def test_a_load_posted_over_http_is_attached_by_id(model_dir: Path, tmp_path: Path) -> None:
    sock = tmp_path / "s.sock"
    async with attach_server(model_dir, sock) as (url, registry, _):
        body = {"path": str(model_dir / "m.gguf"), "config": {"mode": "mmap"}}
        async with aiohttp.ClientSession() as http, http.post(f"{url}/models", json=body) as r:
            load_id = (await r.json())["id"]
        # Attached while it may still be loading: the client waits for ready.
        async with aiogguf.attach(load_id, socket=sock) as m:
            assert len(m.tensors) == len(gguf_bytes(model_dir / "m.gguf"))
            assert registry.entries[load_id].leases == 1
        await wait_for(lambda: registry.entries[load_id].leases == 0, "lease released")


@pytest.mark.asyncio
async def test_errors_name_the_socket_and_the_model(model_dir: Path, tmp_path: Path) -> None:
    sock = tmp_path / "s.sock"
    with pytest.raises(AttachError, match=r"s\.sock: model 0{32}: no such socket"):
        async with aiogguf.attach("0" * 32, socket=sock):
            pass
    async with attach_server(model_dir, sock):
        with pytest.raises(AttachError, match=r"s\.sock: model 0{32}: no model with id"):
            async with aiogguf.attach("0" * 32, socket=sock):
                pass
        outside = tmp_path / "elsewhere.gguf"
        outside.write_bytes(b"GGUF")
        with pytest.raises(AttachError, match=r"elsewhere\.gguf.*not under a served root"):
            async with aiogguf.attach(outside, socket=sock, config={"mode": "mmap"}):
                pass
        # A load that asked not to be shareable cannot be attached to.
        with pytest.raises(AttachError, match="cannot be shared"):
            async with aiogguf.attach(
                model_dir / "m.gguf", socket=sock, config={"shareable": False}
            ):
                pass


@pytest.mark.asyncio
async def test_an_unload_under_a_client_tells_it_in_one_line(
    model_dir: Path, tmp_path: Path
) -> None:
    sock = tmp_path / "s.sock"
    async with attach_server(model_dir, sock) as (_, registry, _):
        request = {"version": 1, "path": str(model_dir / "m.gguf"), "config": {"mode": "mmap"}}
        client = await anyio.to_thread.run_sync(RawClient, sock)
        try:
            client.sock.sendall(encode(request))
            for _ in range(100):
                message, fds = await anyio.to_thread.run_sync(client.receive)
                close_fds(fds)
                if message["type"] != "progress":
                    break
            assert message["type"] == "ready"
            (entry,) = registry.entries.values()
            assert entry.leases == 1
            assert await registry.stop(entry, 5.0)
            message, fds = await anyio.to_thread.run_sync(client.receive)
            assert fds == []
            assert message == {
                "type": "ended",
                "reason": f"model {entry.id} was unloaded by the server",
            }
            assert await anyio.to_thread.run_sync(client.closed)
            assert entry.leases == 0
        finally:
            client.close()


@pytest.mark.asyncio
async def test_an_attached_client_learns_its_lease_ended_and_keeps_its_memory(
    model_dir: Path, tmp_path: Path
) -> None:
    sock = tmp_path / "s.sock"
    path = model_dir / "m.gguf"
    expected = gguf_bytes(path)
    async with attach_server(model_dir, sock) as (_, registry, _):
        handle = aiogguf.attach(path, socket=sock, config={"mode": "mmap"})
        async with handle as m:
            assert handle.lease_ended() is None
            (entry,) = registry.entries.values()
            assert await registry.stop(entry, 5.0)
            await wait_for(lambda: handle.lease_ended() is not None, "the client told")
            assert handle.lease_ended() == f"model {entry.id} was unloaded by the server"
            assert {n: bytes(m.raw(n)) for n in m.tensors} == expected


# --- leases and processes -----------------------------------------------------------

CLIENT = textwrap.dedent(
    """
    import sys, time, aiogguf
    with aiogguf.attach_sync(sys.argv[1], socket=sys.argv[2], config={"mode": "mmap"}) as m:
        print("attached", len(m.tensors), flush=True)
        time.sleep(60)
    """
)


@pytest.mark.asyncio
async def test_a_client_killed_with_sigkill_releases_its_lease_within_a_second(
    model_dir: Path, tmp_path: Path
) -> None:
    sock = tmp_path / "s.sock"
    async with attach_server(model_dir, sock) as (_, registry, _):
        process = await anyio.open_process(
            [sys.executable, "-c", CLIENT, str(model_dir / "m.gguf"), str(sock)],
            cwd=tmp_path,
        )
        try:
            assert process.stdout is not None
            with anyio.fail_after(60):
                line = await process.stdout.receive()
            assert line.startswith(b"attached"), line
            assert leases(registry) == [1]
            process.kill()
            released = await wait_for(lambda: leases(registry) == [0], "lease released")
            assert released < 1.0
        finally:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.aclose()


@contextlib.contextmanager
def _reachable_folder() -> Iterator[Path]:
    # The test's own folders are 0700: a folder another uid can reach, writable by us only.
    folder = Path(tempfile.mkdtemp(prefix="aiogguf-attach-"))
    try:
        folder.chmod(0o755)
        yield folder
    finally:
        for child in folder.iterdir():
            child.unlink()
        folder.rmdir()


PEER = textwrap.dedent(
    """
    import json, socket, struct, sys
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(sys.argv[1])
    body = json.dumps({"version": 1, "id": "0" * 32}).encode()
    try:
        s.sendall(struct.pack(">I", len(body)) + body)
    except OSError:
        pass  # refused and closed before the request was read: the answer still waits
    data = b""
    try:
        while chunk := s.recv(4096):
            data += chunk
    except ConnectionResetError:
        pass  # closed with the request unread: a reset, after the answer
    print(json.loads(data[4:])["error"])
    """
)


NOBODY = 65534


@functools.cache
def python_for_nobody() -> str | None:
    """A Python interpreter uid 65534 can run (this one may sit in root's 0700 home)."""
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(
                [candidate, "-I", "-c", "pass"],
                user=NOBODY,
                group=NOBODY,
                extra_groups=[],
                check=True,
                timeout=30,
                capture_output=True,
            )
            return candidate
    return None


@pytest.mark.skipif(os.geteuid() != 0, reason="running a client as another uid needs root")
@pytest.mark.parametrize("allowed", ["no", "uid", "group"])
@pytest.mark.asyncio
async def test_a_peer_of_another_uid_is_refused_before_its_request_is_read(
    model_dir: Path, allowed: str
) -> None:
    nobody = NOBODY
    python = python_for_nobody()
    if python is None:
        pytest.skip("no Python interpreter that uid 65534 may run")
    group = 4242  # one of the client's supplementary groups (SO_PEERGROUPS)
    access = {
        "no": AttachAccess(uids=frozenset({12345}), gids=frozenset({12345})),
        "uid": AttachAccess(uids=frozenset({nobody})),
        "group": AttachAccess(gids=frozenset({group})),
    }[allowed]
    with _reachable_folder() as folder:
        sock = folder / "s.sock"
        async with attach_server(model_dir, sock, access):
            # 0666: the kernel lets anyone connect, the peer check decides.
            assert stat.S_IMODE(os.lstat(sock).st_mode) == 0o666
            result = await anyio.run_process(
                [python, "-I", "-c", PEER, str(sock)],
                user=nobody,
                group=nobody,
                extra_groups=[group] if allowed == "group" else [],
                check=False,
            )
        said = result.stdout.decode().strip()
        assert result.returncode == 0, result.stderr.decode()[-2000:]
        if allowed != "no":
            # Read and answered: the refusal below is the peer check's, not the socket's.
            assert said.startswith("no model with id")
        else:
            assert (
                said == f"uid {nobody} may not attach to this server (attach_users, attach_groups)"
            )


# --- hostile clients ----------------------------------------------------------------


def _count_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _send_many_fds(path: Path, total: int) -> tuple[int, str]:
    """Send ``total`` descriptors (250 per message, the kernel's cap is 253) and read
    the server's answer: (descriptors it took before closing, its error)."""
    client = RawClient(path)
    sent = 0
    with open(os.devnull) as null:
        try:
            for _ in range(total // 250):
                socket.send_fds(client.sock, [b"\0"], [null.fileno()] * 250)
                sent += 250
        except (BrokenPipeError, ConnectionResetError):
            pass
    try:
        message, fds = client.receive()
    finally:
        client.close()
    assert fds == []
    return sent, message["error"]


@pytest.mark.asyncio
async def test_hostile_clients_are_refused_and_cannot_hang_the_server(
    model_dir: Path, tmp_path: Path
) -> None:
    sock = tmp_path / "s.sock"
    async with attach_server(model_dir, sock, request_timeout_s=1.0) as (_, registry, listener):
        before = _count_fds()

        def exchange(data: bytes) -> str:
            client = RawClient(sock)
            try:
                client.sock.sendall(data)
                message, _ = client.receive()
                assert client.closed()
                return str(message["error"])
            finally:
                client.close()

        huge = struct.pack(">I", MAX_MESSAGE_BYTES + 1)
        assert "over 1048576" in await anyio.to_thread.run_sync(exchange, huge)
        garbage = struct.pack(">I", 7) + b"{nope!}"
        assert await anyio.to_thread.run_sync(exchange, garbage) == "a message that is not JSON"
        array = struct.pack(">I", 7) + b"[1,2,3]"
        assert "not a JSON object" in await anyio.to_thread.run_sync(exchange, array)
        assert "version 1 expected" in await anyio.to_thread.run_sync(exchange, encode({}))
        # Silence, and half a message: both cut at the request timeout (1 s here).
        start = time.monotonic()
        assert await anyio.to_thread.run_sync(exchange, b"") == "no whole request in time"
        assert await anyio.to_thread.run_sync(exchange, huge[:2]) == "no whole request in time"
        assert time.monotonic() - start < 10
        sent, error = await anyio.to_thread.run_sync(_send_many_fds, sock, 10_000)
        assert sent >= 250
        assert error == "a client may not send descriptors"
        # Nothing held: every descriptor passed was closed, every connection too.
        await wait_for(lambda: listener.connections == 0, "connections closed")
        assert _count_fds() == before
        assert registry.entries == {}
        # And the server still serves.
        async with aiogguf.attach(model_dir / "m.gguf", socket=sock, config={"mode": "mmap"}):
            assert leases(registry) == [1]


@pytest.mark.asyncio
async def test_silent_and_attached_clients_do_not_hold_the_shutdown(
    model_dir: Path, tmp_path: Path
) -> None:
    """A client silent in the middle of its request and one attached: the server's
    listener ends within a second of its shutdown, the attached one told why."""
    sock = tmp_path / "s.sock"
    silent = attached = None
    try:
        async with attach_server(model_dir, sock) as (_, _, listener):
            silent = await anyio.to_thread.run_sync(RawClient, sock)
            silent.sock.sendall(b"\0\0")
            attached = await anyio.to_thread.run_sync(RawClient, sock)
            request = {"version": 1, "path": str(model_dir / "m.gguf"), "config": {"mode": "mmap"}}
            attached.sock.sendall(encode(request))
            for _ in range(100):
                message, fds = await anyio.to_thread.run_sync(attached.receive)
                close_fds(fds)
                if message["type"] != "progress":
                    break
            assert message["type"] == "ready"
            start = time.monotonic()
        assert time.monotonic() - start < 1.0
        assert listener.connections == 0
        message, _ = await anyio.to_thread.run_sync(attached.receive)
        assert message == {"type": "ended", "reason": "the server is stopping"}
        assert await anyio.to_thread.run_sync(silent.closed)
    finally:
        for client in (silent, attached):
            if client is not None:
                client.close()


def _hostile_server(listener: socket.socket, how: str) -> None:
    conn, _ = listener.accept()
    with conn, open(os.devnull) as null:
        conn.settimeout(10)
        if how == "huge":
            conn.sendall(struct.pack(">I", MAX_MESSAGE_BYTES + 1))
        elif how == "fds":
            body = encode({"type": "ready", "id": "x", "description": "{}", "fds": 100})
            socket.send_fds(conn, [body], [null.fileno()] * 100)
        else:
            conn.sendall(encode({"type": "what"}))
        with contextlib.suppress(OSError):
            conn.recv(1 << 16)  # until the client closes
            conn.recv(1)


@pytest.mark.parametrize(
    ("how", "said"),
    [
        ("huge", "a message of 1048577 bytes, over 1048576"),
        ("fds", "the server sent more than 64 descriptors"),
        ("unknown", "the server sent a message this client does not know"),
    ],
)
def test_a_hostile_server_is_refused_and_leaves_nothing_open(
    tmp_path: Path, how: str, said: str
) -> None:
    path = tmp_path / "hostile.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    # What the first attach of a process opens for good (its thread pool's, the loop's).
    with (
        pytest.raises(AttachError, match="no such socket"),
        aiogguf.attach_sync("0" * 32, socket=tmp_path / "none.sock"),
    ):
        pass
    # Descriptors that earlier tests' garbage holds are closed now, not while counting.
    gc.collect()
    before = _count_fds()
    server = threading.Thread(target=_hostile_server, args=(listener, how))
    server.start()
    try:
        with (
            pytest.raises(AttachError, match=f"hostile.sock: model 0{{32}}: {said}$"),
            aiogguf.attach_sync("0" * 32, socket=path),
        ):
            pytest.fail("attached to a hostile server")
    finally:
        server.join(timeout=30)
        listener.close()
    assert not server.is_alive()
    assert _count_fds() == before - 1  # the listener, closed


def test_descriptors_go_to_the_message_that_carries_them(model_dir: Path, tmp_path: Path) -> None:
    """A stream read may hold a progress message and the start of ``ready``, whose
    descriptors then come with the read: they are ``ready``'s, not the progress's."""
    path = tmp_path / "glued.sock"
    model = model_dir / "m.gguf"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)

    def serve_glued() -> None:
        conn, _ = listener.accept()
        with (
            conn,
            aiogguf.load_sync(model, mode="mmap", shareable=True) as loaded,
            share_model(loaded) as share,
        ):
            conn.settimeout(10)
            progress = encode({"type": "progress", "state": "loading"})
            ready = encode(
                {
                    "type": "ready",
                    "id": "x",
                    "description": share.description.decode(),
                    "fds": len(share.fds),
                }
            )
            # One send: the descriptors ride on the progress message's first byte.
            socket.send_fds(conn, [progress + ready], list(share.fds))
            with contextlib.suppress(OSError):
                conn.recv(1 << 16)
                conn.recv(1)

    server = threading.Thread(target=serve_glued)
    server.start()
    try:
        with aiogguf.attach_sync(model, socket=path, config={"mode": "mmap"}) as m:
            assert {n: bytes(m.raw(n)) for n in m.tensors} == gguf_bytes(model)
    finally:
        server.join(timeout=30)
        listener.close()
    assert not server.is_alive()


@pytest.mark.parametrize("server", ["silent", "backlog full"])
@pytest.mark.asyncio
async def test_a_cancelled_attach_ends_within_a_second(tmp_path: Path, server: str) -> None:
    """A server that accepts and never answers (the client waits in a receive), or
    one that never accepts and whose backlog is full (the client waits to connect)."""
    path = tmp_path / "silent.sock"
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.bind(str(path))
    silent.listen(0)
    queued: list[socket.socket] = []
    try:
        if server == "backlog full":
            for _ in range(64):  # a backlog of 0 takes one or two
                waiting = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                waiting.setblocking(False)
                queued.append(waiting)
                try:
                    waiting.connect(str(path))
                except BlockingIOError:
                    break
            else:
                pytest.fail("the backlog never filled")
        start = time.monotonic()
        with anyio.move_on_after(0.3) as scope:
            async with aiogguf.attach("0" * 32, socket=path):
                pytest.fail("attached to a server that never answered")
        assert scope.cancelled_caught
        assert time.monotonic() - start < 1.3
    finally:
        silent.close()
        for waiting in queued:
            waiting.close()


# --- the socket -----------------------------------------------------------------------


def test_the_socket_is_made_safely(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir(mode=0o700)
    path = folder / "s.sock"
    # A file that is not a socket is never replaced.
    path.write_text("precious")
    with pytest.raises(AttachError, match="exists and is not a socket"):
        bind_socket(str(path))
    assert path.read_text() == "precious"
    path.unlink()
    # A live server's socket is not taken over; a stale one of ours is replaced.
    live = bind_socket(str(path))
    with pytest.raises(AttachError, match="another server listens on it"):
        bind_socket(str(path))
    live.close()
    again = bind_socket(str(path))
    assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600
    again.close()
    # A folder others may write to (and not sticky): they could swap the socket.
    open_folder = tmp_path / "open"
    open_folder.mkdir()
    open_folder.chmod(0o777)
    with pytest.raises(AttachError, match="may be written by others"):
        bind_socket(str(open_folder / "s.sock"))
    assert list(open_folder.iterdir()) == []
    open_folder.chmod(0o1777)  # sticky, as /tmp: others cannot remove our file
    bind_socket(str(open_folder / "s.sock")).close()


def test_serve_with_a_socket_and_no_http(model_dir: Path, tmp_path: Path) -> None:
    """``aiogguf serve --no-http`` with ``[server] socket``: a process attaches, reads,
    and keeps its tensors after the server has stopped; the socket goes with the server."""
    sock = tmp_path / "serve.sock"
    config = tmp_path / "serve.toml"
    config.write_text(f"[server]\nroots = [{str(model_dir)!r}]\nsocket = {str(sock)!r}\n")
    command = [sys.executable, "-m", "aiogguf", "serve", "--config", str(config), "--no-http"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    try:
        assert server.stdout is not None
        line = server.stdout.readline().decode()
        assert line.strip() == f"aiogguf serve: attach socket {sock}", server.stderr
        expected = gguf_bytes(model_dir / "m.gguf")
        with aiogguf.attach_sync(model_dir / "m.gguf", socket=sock, config={"mode": "mmap"}) as m:
            assert {n: bytes(m.raw(n)) for n in m.tensors} == expected
            server.send_signal(15)
            assert server.wait(timeout=30) == 0
            assert not sock.exists()
            assert {n: bytes(m.raw(n)) for n in m.tensors} == expected
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        for stream in (server.stdout, server.stderr):
            if stream is not None:
                stream.close()


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--no-http"], "--no-http needs --socket PATH (or [server] socket)"),
        (["--attach-user", "no-such-user-here"], "attach: no user named 'no-such-user-here'"),
        (["--socket", "/proc/s.sock"], "/proc/s.sock: cannot listen: "),
    ],
)
def test_serve_refuses_a_bad_attach_setting_in_one_line(
    model_dir: Path, flags: list[str], said: str
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "aiogguf", "serve", "--root", str(model_dir), "--port", "0", *flags],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"aiogguf serve: {said}")
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_bench_attach_script_prints_its_json(tmp_path: Path) -> None:
    # bench/attach.py is a script, not part of the package: run it as a user would.
    result = subprocess.run(
        [
            *(sys.executable, str(REPO / "bench" / "attach.py"), "--size", "8MiB"),
            *("--runs", "1", "--dir", str(tmp_path), "--json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    found = json.loads(result.stdout)
    assert set(found["medians"]) == {"attach", "handshake", "none", "mmap"}
    assert all(m["work_s"] > 0 for m in found["medians"].values())
    assert set(found["targets"]) == {
        "attach_50x_faster_than_warm_none",
        "attach_faster_than_warm_mmap",
    }
