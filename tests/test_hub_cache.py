"""hf:// loads and the hub's own cache, against real servers on loopback: the stand-in
hub (``http_server.HubServer``, reached through ``HF_ENDPOINT``) redirecting to a CDN
with real Range and ETag support. Each test has a cache of its own (conftest).

What the cache must be is what ``huggingface_hub`` itself reads: the oracle is its
``try_to_load_from_cache``, and the source file's bytes.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import struct
import threading
import time
from pathlib import Path

import anyio
import pytest
from http_server import COMMIT, FileServer, HubServer, client_sockets, file_server
from hub_helpers import HEADER_AGAIN, NAME, SMALL, data_bytes, recorded_ranges, records

import aiogguf
from aiogguf.errors import IntegrityError
from aiogguf.remote._hub_cache import PARTIAL_SUFFIX, hub_cache_dir
from aiogguf.testing.synth import write_synthetic_model

hub_lib = pytest.importorskip("huggingface_hub")

pytestmark = pytest.mark.timeout(60)


def _source(cdn: FileServer) -> bytes:
    return (cdn.root / "m.gguf").read_bytes()


def _cached(revision: str | None = "main") -> str | None:
    found = hub_lib.try_to_load_from_cache(
        "own/repo", "m.gguf", cache_dir=hub_cache_dir(), revision=revision
    )
    return found if isinstance(found, str) else None


def _blobs() -> list[str]:
    folder = Path(hub_cache_dir()) / "models--own--repo" / "blobs"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def _same_bytes(model: aiogguf.Model, path: Path) -> None:
    with aiogguf.load_sync(path, mode="none") as local:
        for t in local.plan.tensors:
            assert bytes(model.raw(t.name)) == bytes(local.raw(t.name)), t.name


def test_a_hub_load_fills_the_cache_that_huggingface_hub_reads(
    hub: HubServer, cdn: FileServer
) -> None:
    assert _cached() is None
    with aiogguf.load_sync(NAME, **SMALL) as model:
        _same_bytes(model, cdn.root / "m.gguf")
    sha = hashlib.sha256(_source(cdn)).hexdigest()
    for revision in ("main", COMMIT):
        found = _cached(revision)
        assert found is not None
        assert Path(found).read_bytes() == _source(cdn)
    # The library's own layout: a relative link to a blob named by its sha256, the ref.
    pointer = Path(hub_cache_dir(), "models--own--repo", "snapshots", COMMIT, "m.gguf")
    assert os.readlink(pointer) == f"../../blobs/{sha}"
    assert _blobs() == [sha]  # no partial file left
    assert (pointer.parents[2] / "refs" / "main").read_text() == COMMIT
    # hf_hub_download finds it without fetching it again.
    before = len(cdn.faults.headers)
    got = hub_lib.hf_hub_download("own/repo", "m.gguf", cache_dir=hub_cache_dir())
    assert got == str(pointer)
    assert len(cdn.faults.headers) == before


@pytest.mark.parametrize("mode", ["mmap", "none", "direct"])
def test_a_second_load_reads_the_cached_file_locally(
    hub: HubServer, cdn: FileServer, mode: str
) -> None:
    with aiogguf.load_sync(NAME, **SMALL):
        pass
    cdn.faults.__init__()  # type: ignore[misc]
    hub.faults.__init__()  # type: ignore[misc]
    with aiogguf.load_sync(NAME, mode=mode) as model:
        assert model.plan.mode == mode  # a local file: every local mode
        assert model.report.files[0].path == _cached()
        _same_bytes(model, cdn.root / "m.gguf")
    assert not cdn.faults.headers  # no byte of data asked for
    assert [h["path"] for h in hub.faults.headers] == ["/own/repo/resolve/main/m.gguf"]
    # Pinned to a commit: not even the hub is asked.
    hub.faults.__init__()  # type: ignore[misc]
    with aiogguf.load_sync(f"{NAME}@{COMMIT}"):
        pass
    assert not hub.faults.headers
    assert not cdn.faults.headers


def test_an_unreachable_hub_loads_the_cached_file_its_ref_names(
    hub: HubServer, cdn: FileServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    with aiogguf.load_sync(NAME, **SMALL):
        pass
    cdn.faults.__init__()  # type: ignore[misc]
    with file_server(cdn.root) as gone:
        port = gone.port  # a port nothing listens on once it is stopped
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    with aiogguf.load_sync(NAME) as model:
        assert model.report.files[0].path == _cached()
    assert not cdn.faults.headers
    # What the hub refuses is not looked up (a 404 is an answer): the error stands.
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{hub.port}")
    with pytest.raises(aiogguf.LoadError, match="the hub cannot resolve it"):
        aiogguf.load_sync("hf://own/repo/m.gguf@v9").__enter__()


def _hash_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("aiogguf-hub-hash")]


@pytest.mark.anyio
async def test_a_cancelled_load_leaves_a_partial_file_that_the_next_load_resumes(
    hub: HubServer, cdn: FileServer
) -> None:
    # The first ranged requests (the header's, then some data) are answered, then every
    # body stalls: the load is cancelled with part of the file written.
    cdn.faults.after, cdn.faults.stall_left, cdn.faults.stall_s = 6, 10**6, 30.0
    began = time.monotonic()
    with anyio.move_on_after(1.5) as scope:
        async with aiogguf.load(NAME, **SMALL):
            pytest.fail("every body stalls")
    assert scope.cancelled_caught
    assert time.monotonic() - began < 4  # stopped within about a second
    assert not _hash_threads()
    assert client_sockets(cdn.port) == 0
    assert _cached() is None  # nothing committed
    sha = hashlib.sha256(_source(cdn)).hexdigest()
    assert _blobs() == [sha + PARTIAL_SUFFIX]
    size = len(_source(cdn))
    recorded = sum(hi - lo for lo, hi in recorded_ranges(size))
    assert recorded >= 256 << 10  # the header and some whole ranges

    cdn.faults.__init__()  # type: ignore[misc]
    async with aiogguf.load(NAME, **SMALL) as model:
        await anyio.to_thread.run_sync(_same_bytes, model, cdn.root / "m.gguf")
    # The bytes the first load wrote are not asked for again.
    assert data_bytes(cdn) <= size - recorded + HEADER_AGAIN
    found = _cached()
    assert found is not None
    assert await anyio.Path(found).read_bytes() == _source(cdn)
    assert _blobs() == [sha]


def test_a_load_that_fails_midway_resumes_too(hub: HubServer, cdn: FileServer) -> None:
    cdn.faults.after, cdn.faults.status_left = 8, 10**6
    with pytest.raises(aiogguf.LoadError, match="503"):
        aiogguf.load_sync(NAME, remote_retries=0, **SMALL).__enter__()
    assert not _hash_threads()
    size = len(_source(cdn))
    recorded = sum(hi - lo for lo, hi in recorded_ranges(size))
    assert recorded >= 256 << 10
    cdn.faults.__init__()  # type: ignore[misc]
    with aiogguf.load_sync(NAME, **SMALL) as model:
        _same_bytes(model, cdn.root / "m.gguf")
    assert data_bytes(cdn) <= size - recorded + HEADER_AGAIN
    assert _cached() is not None


@pytest.mark.parametrize("cache", [True, False])
def test_bytes_that_differ_from_the_hubs_sha256_fail_the_load_and_are_not_cached(
    hub: HubServer, cdn: FileServer, cache: bool
) -> None:
    hub.etags["m.gguf"] = "0" * 64
    with pytest.raises(IntegrityError) as caught:
        aiogguf.load_sync(NAME, cache=cache, **SMALL).__enter__()
    message = str(caught.value)
    assert message.startswith(f"{NAME}: ")
    assert "0" * 64 in message
    assert hashlib.sha256(_source(cdn)).hexdigest() in message
    assert _cached() is None
    assert _blobs() == []  # the partial file is removed: its bytes are not the hub's
    assert not _hash_threads()


def test_a_resumed_partial_file_whose_bytes_are_wrong_is_caught_and_dropped(
    hub: HubServer, cdn: FileServer
) -> None:
    cdn.faults.after, cdn.faults.status_left = 8, 10**6
    with pytest.raises(aiogguf.LoadError):
        aiogguf.load_sync(NAME, remote_retries=0, **SMALL).__enter__()
    (partial,) = Path(hub_cache_dir()).glob(f"*/blobs/*{PARTIAL_SUFFIX}")
    ranges = recorded_ranges(len(_source(cdn)))
    with open(partial, "r+b") as f:  # the last byte the record vouches for, spoiled
        f.seek(ranges[-1][1] - 1)
        spoiled = bytes([f.read(1)[0] ^ 0xFF])
        f.seek(ranges[-1][1] - 1)
        f.write(spoiled)
    cdn.faults.__init__()  # type: ignore[misc]
    with pytest.raises(IntegrityError, match="sha256"):
        aiogguf.load_sync(NAME, **SMALL).__enter__()
    assert _blobs() == []
    with aiogguf.load_sync(NAME, **SMALL) as model:  # then from scratch
        _same_bytes(model, cdn.root / "m.gguf")
    assert _cached() is not None


def test_cache_false_writes_nothing_and_still_checks_the_digest(
    hub: HubServer, cdn: FileServer
) -> None:
    with aiogguf.load_sync(NAME, cache=False, **SMALL) as model:
        _same_bytes(model, cdn.root / "m.gguf")
    assert not os.path.exists(hub_cache_dir())
    # With a cache, cache=False does not read it either.
    with aiogguf.load_sync(NAME, **SMALL):
        pass
    cdn.faults.__init__()  # type: ignore[misc]
    with aiogguf.load_sync(NAME, cache=False, **SMALL) as model:
        assert model.plan.mode == "none"
    assert data_bytes(cdn) >= len(_source(cdn))


def test_a_simulated_gpu_load_fills_the_cache_too(hub: HubServer, cdn: FileServer) -> None:
    with aiogguf.load_sync(NAME, sim_gpus=["24GiB"], n_gpu_layers=-1, **SMALL) as model:
        assert {t.device for t in model.plan.tensors if t.nbytes} == {"g0"}
        _same_bytes(model, cdn.root / "m.gguf")
    found = _cached()
    assert found is not None
    assert Path(found).read_bytes() == _source(cdn)


def test_the_cli_flag_turns_the_cache_off(hub: HubServer, cdn: FileServer) -> None:
    from aiogguf.cli import main

    assert main(["load", NAME, "--no-cache"]) == 0
    assert not os.path.exists(hub_cache_dir())
    assert main(["load", NAME]) == 0
    assert _cached() is not None


def test_a_split_set_is_cached_split_by_split_and_read_back_whole(
    hub: HubServer, cdn: FileServer
) -> None:
    write_synthetic_model(cdn.root / "s.gguf", size_bytes="3MiB", seed=5, split_count=3)
    names = [f"s-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    hub.files.update({f"own/repo/{n}": n for n in names})
    with aiogguf.load_sync(f"hf://own/repo/{names[0]}", **SMALL) as model:
        assert len(model.report.files) == 3
    for name in names:
        found = hub_lib.try_to_load_from_cache(
            "own/repo", name, cache_dir=hub_cache_dir(), revision="main"
        )
        assert isinstance(found, str)
        assert Path(found).read_bytes() == (cdn.root / name).read_bytes()
    cdn.faults.__init__()  # type: ignore[misc]
    with aiogguf.load_sync(f"hf://own/repo/{names[0]}", mode="mmap") as model:
        assert [Path(f.path).name for f in model.report.files] == names
        _same_bytes(model, cdn.root / names[0])
    assert not cdn.faults.headers


def test_a_file_another_process_is_caching_is_loaded_without_writing(
    hub: HubServer, cdn: FileServer
) -> None:
    sha = hashlib.sha256(_source(cdn)).hexdigest()
    lock = Path(hub_cache_dir(), ".locks", "models--own--repo", f"{sha}.lock")
    lock.parent.mkdir(parents=True)
    with open(lock, "w") as held:  # as huggingface_hub's own lock holds it
        fcntl.flock(held, fcntl.LOCK_EX)
        with aiogguf.load_sync(NAME, **SMALL) as model:
            _same_bytes(model, cdn.root / "m.gguf")
        assert _blobs() == []
    with aiogguf.load_sync(NAME, **SMALL):
        pass
    assert _blobs() == [sha]


def test_a_blob_cached_for_another_commit_is_linked_not_downloaded(
    hub: HubServer, cdn: FileServer
) -> None:
    with aiogguf.load_sync(NAME, **SMALL):
        pass
    # The same bytes, cached under another commit only: the hub's commit has no link.
    repo = Path(hub_cache_dir(), "models--own--repo")
    (repo / "snapshots" / COMMIT).rename(repo / "snapshots" / ("f" * 40))
    (repo / "refs" / "main").unlink()
    cdn.faults.__init__()  # type: ignore[misc]
    with aiogguf.load_sync(NAME, mode="mmap") as model:
        assert model.report.files[0].path == _cached()
    assert not cdn.faults.headers
    assert Path(_cached() or "").read_bytes() == _source(cdn)


def test_a_cache_that_cannot_be_written_loads_without_one(
    hub: HubServer, cdn: FileServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a-file").write_bytes(b"")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "a-file" / "hub"))
    with aiogguf.load_sync(NAME, **SMALL) as model:
        _same_bytes(model, cdn.root / "m.gguf")
    assert not _hash_threads()
    hub.etags["m.gguf"] = "0" * 64  # the digest is checked all the same
    with pytest.raises(IntegrityError):
        aiogguf.load_sync(NAME, **SMALL).__enter__()


def test_a_record_written_before_a_reboot_is_not_trusted(hub: HubServer, cdn: FileServer) -> None:
    cdn.faults.after, cdn.faults.status_left = 8, 10**6
    with pytest.raises(aiogguf.LoadError):
        aiogguf.load_sync(NAME, remote_retries=0, **SMALL).__enter__()
    size = len(_source(cdn))
    assert recorded_ranges(size)
    (partial,) = Path(hub_cache_dir()).glob(f"*/blobs/*{PARTIAL_SUFFIX}")
    with open(partial, "r+b") as f:  # the same records, as another boot wrote them
        for at, record in records(size).items():
            record["boot"] = "another-boot"
            payload = json.dumps(record).encode()
            check = hashlib.sha256(payload).digest()
            f.seek(at)
            f.write(struct.pack("<8sQ32s", b"AIOGGPR1", len(payload), check) + payload)
    cdn.faults.__init__()  # type: ignore[misc]
    with aiogguf.load_sync(NAME, **SMALL):
        pass
    assert data_bytes(cdn) >= size  # every byte asked again
    assert _cached() is not None
