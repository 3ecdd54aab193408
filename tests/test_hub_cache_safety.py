"""The hub's cache written only inside itself, against a hostile hub and a hostile cache:
names the hub would not allow (repository ids, revisions, commits) refused before
anything is asked or written, links planted in the cache refused rather than followed,
an ETag that checks nothing said aloud, a full disk that keeps no partial file, and a
download killed mid-way resumed from what it wrote.

Real servers on loopback (``http_server.HubServer`` through ``HF_ENDPOINT``), real
links, real subprocesses killed by real signals, a real tmpfs for the full disk. The
outside of the cache is a folder of its own, compared byte for byte before and after.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import pytest
from http_server import COMMIT, FileServer, HubServer
from hub_helpers import HEADER_AGAIN, NAME, SMALL, data_bytes, recorded_ranges
from server_helpers import post, running

import aiogguf
from aiogguf.cli import main
from aiogguf.errors import LoadError, LoadWarning
from aiogguf.remote._hub_cache import PARTIAL_SUFFIX, hub_cache_dir
from aiogguf.server._app import RemoteAccess, ServerPolicy, create_app
from aiogguf.testing.synth import write_synthetic_model

hub_lib = pytest.importorskip("huggingface_hub")

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder holding the cache (``place/a/b/cache``) and an outside one
    (``place/outside``, with a file ``victim``): a write that escapes the cache lands
    in ``place``, never beyond it."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_bytes(b"the user's own file\n")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "a" / "b" / "cache"))
    return tmp_path


def _outside(place: Path) -> dict[str, bytes | str | None]:
    """Everything under ``place`` but the cache (and the folders made to hold it): each
    file's bytes, each link's target, each folder (None)."""
    cache = Path(hub_cache_dir())
    found: dict[str, bytes | str | None] = {}
    for folder, dirs, files in os.walk(place):
        for name in [*dirs, *files]:
            path = Path(folder, name)
            if path == cache or cache in path.parents or path in cache.parents:
                continue
            if path.is_symlink():
                found[str(path)] = "-> " + os.readlink(path)
            elif path.is_dir():
                found[str(path)] = None
            else:
                found[str(path)] = path.read_bytes()
    return found


def _one_line(exc: BaseException) -> str:
    message = str(exc)
    assert "\n" not in message
    return message


# --- names the hub does not allow ----------------------------------------------------

BAD_REPOS = ["o--r", "r..x", "r!x", "a" * 100, "-o", "r."]


@pytest.mark.parametrize("repo", BAD_REPOS)
def test_repo_ids_huggingface_hub_refuses_are_load_errors(hub: HubServer, repo: str) -> None:
    name = f"hf://own/{repo}/m.gguf"
    with pytest.raises(LoadError) as caught:
        aiogguf.load_sync(name).__enter__()
    assert _one_line(caught.value).startswith(f"{name}: not a repository id the hub allows")
    with pytest.raises(hub_lib.utils.HFValidationError):  # the oracle agrees
        hub_lib.utils.validate_repo_id(f"own/{repo}")
    assert not hub.faults.headers  # refused before the hub is asked


@pytest.mark.parametrize("repo", ["o--r", "r."])
def test_the_cli_exits_2_for_a_repo_id_the_hub_refuses(
    hub: HubServer, repo: str, capsys: pytest.CaptureFixture[str]
) -> None:
    name = f"hf://own/{repo}/m.gguf"
    assert main(["load", name]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"aiogguf load: {name}: not a repository id the hub allows")
    assert err.count("\n") == 1


@pytest.mark.anyio
async def test_the_server_answers_400_for_a_repo_id_the_hub_refuses(hub: HubServer) -> None:
    access = RemoteAccess.from_settings(allow_remote=["hf"], networks=["127.0.0.1/32"])
    app = create_app(policy=ServerPolicy(remote=access))
    async with running(app) as base, aiohttp.ClientSession() as http:
        for repo in ("o--r", "r!x"):
            status, body = await post(http, base, f"hf://own/{repo}/m.gguf")
            assert status == 400, body
            assert "not a repository id the hub allows" in body["error"]
    assert not hub.faults.headers


@pytest.mark.parametrize(
    "revision",
    ["../../../../x", "a/../../x", "..", "/abs", "a//b", ".hidden", "x.lock", "a b", "x~1", "x:y"],
)
def test_revisions_that_are_no_ref_name_are_refused_and_write_nothing(
    hub: HubServer, place: Path, revision: str
) -> None:
    hub.any_revision = True  # a hub that answers whatever it is asked
    before = _outside(place)
    name = f"{NAME}@{revision}"
    with pytest.raises(LoadError) as caught:
        aiogguf.load_sync(name, **SMALL).__enter__()
    assert _one_line(caught.value).startswith(f"{name}: not a revision the hub allows")
    assert not hub.faults.headers
    assert _outside(place) == before
    assert not os.path.exists(hub_cache_dir())


def test_a_ref_with_slashes_is_written_inside_refs(hub: HubServer, place: Path) -> None:
    hub.any_revision = True
    before = _outside(place)
    with aiogguf.load_sync(f"{NAME}@refs/pr/1", **SMALL):
        pass
    ref = Path(hub_cache_dir(), "models--own--repo", "refs", "refs", "pr", "1")
    assert ref.read_text() == COMMIT
    assert _outside(place) == before


@pytest.mark.parametrize("commit", ["../..", "../../../../outside", "/ABS", "0123abc", "A" * 40])
def test_a_commit_the_hub_names_must_be_40_hex_digits(
    hub: HubServer, place: Path, commit: str
) -> None:
    hub.any_revision = True
    hub.commit = commit.replace("/ABS", str(place / "outside"))
    before = _outside(place)
    with pytest.raises(LoadError) as caught:
        aiogguf.load_sync(NAME, **SMALL).__enter__()
    assert "not 40 hex digits" in _one_line(caught.value)
    assert _outside(place) == before
    assert not os.path.exists(hub_cache_dir())  # refused before anything is written


# --- an ETag that is no digest -------------------------------------------------------


def test_an_etag_that_is_no_digest_is_a_warning_naming_the_file(
    hub: HubServer, cdn: FileServer
) -> None:
    hub.etags["m.gguf"] = "mtime-1234-size-5678"
    with (
        pytest.warns(LoadWarning, match=r"hf://own/repo/m\.gguf: the hub's ETag") as caught,
        aiogguf.load_sync(NAME, **SMALL) as model,
    ):
        assert model.plan.tensors
    assert "neither a sha256 nor a git sha1" in str(caught[0].message)
    assert not os.path.exists(hub_cache_dir())  # nothing unverified is cached


# --- links planted in the cache ------------------------------------------------------


def _sha(cdn: FileServer) -> str:
    return hashlib.sha256((cdn.root / "m.gguf").read_bytes()).hexdigest()


def _repo() -> Path:
    return Path(hub_cache_dir(), "models--own--repo")


def _link(at: Path, target: Path) -> Path:
    at.parent.mkdir(parents=True, exist_ok=True)
    at.symlink_to(target)
    return at


# Each plant: (where the link goes, given the sha256 and the outside folder) -> the path
# the error names. Folder links point at the outside folder, file links at its victim.
PLANTS: dict[str, Callable[[str, Path], Path]] = {
    "partial file": lambda sha, out: _link(
        _repo() / "blobs" / (sha + PARTIAL_SUFFIX), out / "victim"
    ),
    "blobs/": lambda sha, out: _link(_repo() / "blobs", out),
    "snapshots/": lambda sha, out: _link(_repo() / "snapshots", out),
    "snapshots/<commit>": lambda sha, out: _link(_repo() / "snapshots" / COMMIT, out),
    "snapshot pointer": lambda sha, out: _link(
        _repo() / "snapshots" / COMMIT / "m.gguf", out / "victim"
    ),
    "refs/": lambda sha, out: _link(_repo() / "refs", out),
    "refs/main": lambda sha, out: _link(_repo() / "refs" / "main", out / "victim"),
    ".locks/": lambda sha, out: _link(Path(hub_cache_dir(), ".locks"), out),
    ".locks/models--own--repo": lambda sha, out: _link(
        Path(hub_cache_dir(), ".locks", "models--own--repo"), out
    ),
    "lock file": lambda sha, out: _link(
        Path(hub_cache_dir(), ".locks", "models--own--repo", f"{sha}.lock"), out / "victim"
    ),
    "models--own--repo": lambda sha, out: _link(_repo(), out),
}


@pytest.mark.parametrize("plant", list(PLANTS))
def test_a_link_planted_in_the_cache_is_refused_and_nothing_outside_changes(
    hub: HubServer, cdn: FileServer, place: Path, plant: str
) -> None:
    Path(hub_cache_dir()).mkdir(parents=True)
    planted = PLANTS[plant](_sha(cdn), place / "outside")
    before = _outside(place)
    with pytest.raises(LoadError) as caught:
        aiogguf.load_sync(NAME, **SMALL).__enter__()
    message = _one_line(caught.value)
    assert message.startswith(f"{planted}: ")
    assert "symbolic link" in message or "not to a blob of its repository" in message
    assert _outside(place) == before
    assert planted.is_symlink()  # refused, not replaced either


def test_a_partial_file_with_another_hard_link_is_refused(
    hub: HubServer, cdn: FileServer, place: Path
) -> None:
    partial = _repo() / "blobs" / (_sha(cdn) + PARTIAL_SUFFIX)
    partial.parent.mkdir(parents=True)
    os.link(place / "outside" / "victim", partial)
    before = _outside(place)
    with pytest.raises(LoadError, match="other hard links") as caught:
        aiogguf.load_sync(NAME, **SMALL).__enter__()
    assert _one_line(caught.value).startswith(f"{partial}: ")
    assert _outside(place) == before


def test_a_cache_reached_through_a_link_of_the_users_own_still_works(
    hub: HubServer, cdn: FileServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache folder itself may be a link (the user's choice): only what is inside
    it is never followed."""
    (tmp_path / "real").mkdir()
    (tmp_path / "cache").symlink_to(tmp_path / "real")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    with aiogguf.load_sync(NAME, **SMALL):
        pass
    with aiogguf.load_sync(NAME, mode="mmap") as model:
        assert model.report.files[0].path.startswith(str(tmp_path / "cache"))
    assert (tmp_path / "real" / "models--own--repo" / "blobs" / _sha(cdn)).is_file()


# --- a full disk ---------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An 8 MiB tmpfs as the cache."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)],
        capture_output=True,
        timeout=30,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"a full disk needs a tmpfs mount: {mounted.stderr.decode().strip()}")
    try:
        monkeypatch.setenv("HF_HUB_CACHE", str(disk / "hub"))
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True, timeout=30, check=False)


def _used_bytes(disk: Path) -> int:
    st = os.statvfs(disk)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def test_a_full_disk_keeps_no_partial_file(
    hub: HubServer, cdn: FileServer, small_disk: Path
) -> None:
    write_synthetic_model(cdn.root / "big.gguf", size_bytes="12MiB", seed=7)
    hub.files["own/repo/big.gguf"] = "big.gguf"
    for _ in range(2):  # the second load finds the disk as empty as the first
        with (
            aiogguf.load_sync("hf://own/repo/big.gguf", **SMALL) as model,
            aiogguf.load_sync(cdn.root / "big.gguf", mode="none") as local,
        ):
            for t in local.plan.tensors:
                assert bytes(model.raw(t.name)) == bytes(local.raw(t.name)), t.name
        blobs = Path(hub_cache_dir(), "models--own--repo", "blobs")
        assert [p.name for p in blobs.iterdir()] == []
        assert _used_bytes(small_disk) < 1 << 20


# --- a download killed mid-way -------------------------------------------------------

_LOAD = (
    "import sys, aiogguf\n"
    "aiogguf.load_sync(sys.argv[1], chunk_size='256KiB', remote_in_flight=4).__enter__()\n"
)
_SPARED = 8  # ranged requests answered whole before every body stalls


def _wait_for_the_stall(cdn: FileServer, process: subprocess.Popen[bytes]) -> None:
    """Until the CDN has answered the spared requests and stalls on later ones, then a
    moment for what landed to be written."""
    deadline = time.monotonic() + 60
    while cdn.faults.ranged < _SPARED + 2:
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the load never reached the stall"
        time.sleep(0.05)
    time.sleep(0.5)


def _resumes(cdn: FileServer) -> None:
    """The partial file's record vouches for what the first load wrote, and the next
    load asks only for the rest (and the header again)."""
    size = (cdn.root / "m.gguf").stat().st_size
    recorded = sum(hi - lo for lo, hi in recorded_ranges(size))
    assert recorded >= 1 << 20  # the header's request and most spared ones
    cdn.faults.__init__()  # type: ignore[misc]
    with aiogguf.load_sync(NAME, **SMALL):
        pass
    assert data_bytes(cdn) <= size - recorded + HEADER_AGAIN
    found = hub_lib.try_to_load_from_cache("own/repo", "m.gguf", cache_dir=hub_cache_dir())
    assert isinstance(found, str)
    assert Path(found).read_bytes() == (cdn.root / "m.gguf").read_bytes()


@pytest.fixture
def stalling(hub: HubServer, cdn: FileServer) -> FileServer:
    cdn.faults.after, cdn.faults.stall_left, cdn.faults.stall_s = _SPARED, 10**6, 30.0
    return cdn


def test_a_load_killed_mid_download_resumes_from_what_it_wrote(stalling: FileServer) -> None:
    with subprocess.Popen([sys.executable, "-c", _LOAD, NAME], stderr=subprocess.PIPE) as process:
        try:
            _wait_for_the_stall(stalling, process)
        finally:
            process.kill()
        process.communicate(timeout=30)
    assert process.returncode == -signal.SIGKILL
    _resumes(stalling)


def test_sigterm_ends_a_cli_load_cleanly_and_it_resumes(
    stalling: FileServer, tmp_path: Path
) -> None:
    config = tmp_path / "small.toml"
    config.write_text('[pipeline]\nchunk_size = "256KiB"\nremote_in_flight = 4\n')
    command = [sys.executable, "-m", "aiogguf", "load", NAME, "--config", str(config)]
    with subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL) as process:
        try:
            _wait_for_the_stall(stalling, process)
            process.send_signal(signal.SIGTERM)
            _, err = process.communicate(timeout=30)
        finally:
            process.kill()
    assert process.returncode == 130, err
    assert err.decode().strip().endswith("interrupted")
    _resumes(stalling)
