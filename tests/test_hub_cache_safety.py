"""The hub's cache written only inside itself, against a hostile hub: names the hub
would not allow (repository ids, revisions, commits) refused before anything is asked or
written, and an ETag that checks nothing said aloud.

Real servers on loopback (``http_server.HubServer`` through ``HF_ENDPOINT``). The
outside of the cache is a folder of its own, compared byte for byte before and after.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from http_server import COMMIT, FileServer, HubServer, file_server
from server_helpers import post, running
from test_hub_cache import SMALL

import aiogguf
from aiogguf.cli import main
from aiogguf.errors import LoadError, LoadWarning
from aiogguf.hub_cache import hub_cache_dir
from aiogguf.server import RemoteAccess, ServerPolicy, create_app
from aiogguf.testing.synth import write_synthetic_model

hub_lib = pytest.importorskip("huggingface_hub")

pytestmark = pytest.mark.timeout(90)

NAME = "hf://own/repo/m.gguf"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FileServer]:
    root = tmp_path_factory.mktemp("served")
    write_synthetic_model(root / "m.gguf", size_bytes="4MiB", seed=3)
    with file_server(root) as server:
        yield server


@pytest.fixture
def cdn(served: FileServer) -> FileServer:
    served.faults.__init__()  # type: ignore[misc]
    return served


@pytest.fixture
def hub(cdn: FileServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[HubServer]:
    with HubServer(cdn, {"own/repo/m.gguf": "m.gguf"}) as stand_in:
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{stand_in.port}")
        monkeypatch.delenv("HF_TOKEN", raising=False)
        yield stand_in


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
