"""Remote names wherever a path is taken: ``inspect``, ``plan``, ``hash``, ``verify`` (CLI
and Python) of a URL or an ``hf://`` name, against a real HTTP server on loopback that
counts the bytes it sends.

The oracle is the same command on the same file from disk. A look (``inspect``, ``plan``)
must cost the headers' ranges, not the model: the first request's ``HEAD_BYTES`` per
file, more only for a header larger than that. A hash reads every byte, and for an
``hf://`` name goes through the hub's cache as a load does.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from aiohttp import web
from http_server import COMMIT, FileServer, HubServer

import aiogguf
from aiogguf.cli import main
from aiogguf.cli.inspect import inspect_json
from aiogguf.cli.plan import plan_to_json
from aiogguf.errors import LoadError
from aiogguf.integrity._hashing import hash_model
from aiogguf.remote._http_source import HEAD_BYTES
from aiogguf.remote._hub_cache import hub_cache_dir
from aiogguf.stages.parse import GROWTH_FACTOR
from aiogguf.testing.synth import write_synthetic_model

pytestmark = pytest.mark.timeout(60)

SPLITS = [f"s-0000{i}-of-00003.gguf" for i in (1, 2, 3)]


class CountingServer(FileServer):
    """A ``FileServer`` that counts the body bytes it sends (``sent``)."""

    sent = 0

    def _routes(self, app: web.Application) -> None:
        super()._routes(app)
        app.on_response_prepare.append(self._count)

    async def _count(self, request: web.Request, response: web.StreamResponse) -> None:
        if request.method == "GET" and response.content_length:
            self.sent += response.content_length


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CountingServer]:
    root = tmp_path_factory.mktemp("served")
    # 8 MiB of tensors behind a header of about 11 KiB.
    write_synthetic_model(root / "m.gguf", size_bytes="8MiB", seed=11, n_layer=4)
    # Three splits of about 4 MiB each.
    write_synthetic_model(root / "s.gguf", size_bytes="12MiB", seed=5, split_count=3)
    with CountingServer(root) as server:
        yield server


@pytest.fixture
def server(served: CountingServer) -> CountingServer:
    served.faults.__init__()  # type: ignore[misc]
    served.sent = 0
    return served


@pytest.fixture
def hub(server: CountingServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[HubServer]:
    pytest.importorskip("huggingface_hub")
    files = {"own/repo/m.gguf": "m.gguf", **{f"own/repo/{n}": n for n in SPLITS}}
    with HubServer(server, files) as stand_in:
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{stand_in.port}")
        monkeypatch.setenv("HF_TOKEN", "hf_secret")
        yield stand_in


def _pathless(document: dict[str, Any]) -> dict[str, Any]:
    """``inspect --json`` without the files' paths (a URL there, a local path here)."""
    return {**document, "files": [{**f, "path": None} for f in document["files"]]}


def _freeless(document: dict[str, Any]) -> dict[str, Any]:
    """``plan --json`` without the devices' free memory (the host's moves between two
    calls)."""
    return {**document, "devices": [{**d, "free": None} for d in document["devices"]]}


def _json_out(capsys: pytest.CaptureFixture[str], args: list[str]) -> dict[str, Any]:
    assert main(args) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    result: dict[str, Any] = json.loads(captured.out)
    return result


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err.strip()


# --- inspect and plan: the headers only ---------------------------------------------


def test_inspect_of_a_url_is_the_local_files_and_reads_only_the_first_request(
    server: CountingServer, capsys: pytest.CaptureFixture[str]
) -> None:
    local = server.root / "m.gguf"
    size = local.stat().st_size
    remote = aiogguf.inspect_sync(server.url("m.gguf"))
    assert server.sent == min(HEAD_BYTES, size) < size / 4
    assert remote.files[0].path == server.url("m.gguf")
    assert _pathless(inspect_json(remote)) == _pathless(inspect_json(aiogguf.inspect_sync(local)))

    server.sent = 0
    by_url = _json_out(capsys, ["inspect", "--json", server.url("m.gguf")])
    assert server.sent == min(HEAD_BYTES, size)
    assert _pathless(by_url) == _pathless(_json_out(capsys, ["inspect", "--json", str(local)]))
    assert main(["inspect", server.url("m.gguf")]) == 0  # the readable summary too
    assert f"{len(remote.tensors)} tensors, " in capsys.readouterr().out


def test_inspect_of_a_header_larger_than_the_first_request_grows_only_to_it(
    server: CountingServer, tmp_path: Path
) -> None:
    pytest.importorskip("gguf")
    from helpers_gguf import write_gguf

    # A vocabulary of 3.6 MiB before 24 MiB of tensor data.
    tokens = [f"token-{i:08d}-" + "x" * 40 for i in range(60_000)]
    metadata = {"general.architecture": "llama", "tokenizer.ggml.tokens": tokens}
    tensors = [(f"blk.{i}.w", np.full((1024, 1024), i, np.float32)) for i in range(6)]
    name = f"big-header-{tmp_path.name}.gguf"
    write_gguf(server.root / name, metadata, tensors)
    try:
        local = aiogguf.inspect_sync(server.root / name)
        data_offset, size = local.files[0].data_offset, local.files[0].file_size
        assert data_offset > HEAD_BYTES
        remote = aiogguf.inspect_sync(server.url(name))
        assert _pathless(inspect_json(remote)) == _pathless(inspect_json(local))
        # The parse reads at most GROWTH_FACTOR times what it has when it needs more
        # (here 4 MiB in two requests: the first's 1 MiB, then up to 4 MiB).
        assert server.sent <= GROWTH_FACTOR * data_offset
        assert server.sent < size / 4
    finally:
        (server.root / name).unlink()


@pytest.mark.asyncio
async def test_async_inspect_and_plan_of_a_url(server: CountingServer) -> None:
    local = server.root / "m.gguf"
    remote = await aiogguf.inspect(server.url("m.gguf"))
    assert remote.totals == (await aiogguf.inspect(local)).totals
    server.sent = 0
    placement = {"sim_gpus": ["24GiB"], "n_gpu_layers": 2}
    planned = await aiogguf.plan(server.url("m.gguf"), **placement)
    assert server.sent == HEAD_BYTES
    assert planned.mode == "none"  # auto, for a URL: as a load resolves it
    oracle = await aiogguf.plan(local, mode="none", **placement)
    assert _freeless(plan_to_json(planned)) == _freeless(plan_to_json(oracle))
    assert {a.device for a in planned.layers} == {"CPU", "g0"}
    with pytest.raises(LoadError, match="needs a local file"):
        await aiogguf.plan(server.url("m.gguf"), mode="mmap")


def test_plan_cli_of_a_url_is_the_local_files(
    server: CountingServer, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = ["--json", "--sim-gpu", "24GiB", "-ngl", "2"]
    by_url = _json_out(capsys, ["plan", server.url("m.gguf"), *flags])
    assert server.sent == HEAD_BYTES
    local = _json_out(capsys, ["plan", str(server.root / "m.gguf"), *flags, "--mode", "none"])
    assert _freeless(by_url) == _freeless(local)
    # The readable form names the URL without its query (a signed URL's credential).
    assert main(["plan", server.url("m.gguf") + "?X-Amz-Signature=secret"]) == 0
    out = capsys.readouterr().out
    assert server.url("m.gguf") in out
    assert "secret" not in out


def test_a_split_set_is_looked_at_by_its_first_splits_url(
    server: CountingServer, capsys: pytest.CaptureFixture[str]
) -> None:
    by_url = _json_out(capsys, ["inspect", "--json", server.url(SPLITS[0])])
    assert len(by_url["files"]) == 3
    sizes = [(server.root / n).stat().st_size for n in SPLITS]
    assert server.sent == 3 * HEAD_BYTES < sum(sizes) / 3
    local = _json_out(capsys, ["inspect", "--json", str(server.root / SPLITS[0])])
    assert _pathless(by_url) == _pathless(local)


@pytest.mark.parametrize("command", ["inspect", "plan", "hash", "verify"])
def test_a_missing_url_exits_2_in_one_line(
    server: CountingServer, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    url = server.url("none.gguf")
    extra = ["--sha256", "0" * 64] if command == "verify" else []
    assert main([command, url, *extra]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"aiogguf {command}: {url}: ")
    assert "404" in line


@pytest.mark.parametrize("revision", ["", "@main"])
def test_inspect_of_an_hf_name_reads_the_header_and_writes_no_cache(
    hub: HubServer, server: CountingServer, capsys: pytest.CaptureFixture[str], revision: str
) -> None:
    name = f"hf://own/repo/m.gguf{revision}"
    by_name = _json_out(capsys, ["inspect", "--json", name])
    assert server.sent == HEAD_BYTES
    assert by_name["files"][0]["path"] == name
    local = _json_out(capsys, ["inspect", "--json", str(server.root / "m.gguf")])
    assert _pathless(by_name) == _pathless(local)
    gets = [h for h in server.faults.headers if "Range" in h]
    assert gets  # read at the commit the hub resolved, without the token
    assert all("Authorization" not in h for h in server.faults.headers)
    assert not Path(hub_cache_dir()).exists()  # a look writes nothing


def test_a_split_set_by_hf_name_is_looked_at_split_by_split(
    hub: HubServer, server: CountingServer, capsys: pytest.CaptureFixture[str]
) -> None:
    by_name = _json_out(capsys, ["inspect", "--json", f"hf://own/repo/{SPLITS[0]}"])
    assert server.sent == 3 * HEAD_BYTES
    local = _json_out(capsys, ["inspect", "--json", str(server.root / SPLITS[0])])
    assert _pathless(by_name) == _pathless(local)
    first, *others = [h["path"] for h in hub.faults.headers if "Range" not in h]
    assert first == f"/own/repo/resolve/main/{SPLITS[0]}"
    assert sorted(others) == [f"/own/repo/resolve/{COMMIT}/{n}" for n in SPLITS[1:]]


def test_an_hf_name_in_the_hub_cache_is_looked_at_there(
    hub: HubServer, server: CountingServer, capsys: pytest.CaptureFixture[str]
) -> None:
    with aiogguf.load_sync("hf://own/repo/m.gguf"):
        pass  # fills the cache
    server.sent = 0
    server.faults.headers.clear()
    by_name = _json_out(capsys, ["inspect", "--json", "hf://own/repo/m.gguf"])
    assert server.faults.headers == []  # the CDN is not asked at all
    assert server.sent == 0
    assert by_name["files"][0]["path"].startswith(hub_cache_dir())
    planned = aiogguf.plan_sync(f"hf://own/repo/m.gguf@{COMMIT}")
    assert planned.mode == "mmap"  # a local file: auto maps it, as a load of it does
    assert server.faults.headers == []


# --- hash and verify: every byte, through the same sources as a load -----------------


def test_hash_and_verify_of_a_url_match_the_local_file(
    server: CountingServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    local = server.root / "m.gguf"
    for form in ("aiogguf", "llama"):
        by_url, by_path = tmp_path / f"url.{form}", tmp_path / f"local.{form}"
        assert main(["hash", server.url("m.gguf"), "--format", form, "-o", str(by_url)]) == 0
        assert main(["hash", str(local), "--format", form, "-o", str(by_path)]) == 0
        assert by_url.read_text() == by_path.read_text()
        assert main(["verify", server.url("m.gguf"), "--manifest", str(by_path)]) == 0
    oid = hashlib.sha256(local.read_bytes()).hexdigest()
    assert main(["verify", server.url("m.gguf"), "--sha256", oid]) == 0
    capsys.readouterr()
    signed = server.url("m.gguf") + "?X-Amz-Signature=secret"
    assert main(["verify", signed, "--sha256", "0" * 64]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"aiogguf verify: {server.url('m.gguf')}: ")
    assert f"sha256 is {oid}" in line
    assert "secret" not in line
    damaged = bytearray(local.read_bytes())
    damaged[len(damaged) // 2] ^= 1
    (server.root / "damaged.gguf").write_bytes(damaged)
    try:
        manifest = str(tmp_path / "local.aiogguf")
        bad = server.url("damaged.gguf")
        assert main(["verify", f"{bad}?X-Amz-Signature=secret", "--manifest", manifest]) == 2
        line = _one_line(capsys)
        assert line.startswith(f"aiogguf verify: {bad}: 1 tensor differs from the manifest")
        assert "secret" not in line
    finally:
        (server.root / "damaged.gguf").unlink()


def test_hash_of_a_url_split_set_matches_the_local_one(
    server: CountingServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # a remote model's manifest goes in the current folder
    assert main(["hash", server.url(SPLITS[0])]) == 0
    written = tmp_path / f"{SPLITS[0]}.manifest.json"
    assert main(["hash", str(server.root / SPLITS[0]), "-o", str(tmp_path / "local.json")]) == 0
    assert written.read_text() == (tmp_path / "local.json").read_text()
    assert main(["verify", server.url(SPLITS[0]), "--manifest", str(written)]) == 0


def test_hash_of_an_hf_name_matches_and_fills_the_hub_cache(
    hub: HubServer, server: CountingServer, tmp_path: Path
) -> None:
    local = server.root / "m.gguf"
    assert main(["hash", str(local), "-o", str(tmp_path / "local.json")]) == 0
    assert main(["hash", "hf://own/repo/m.gguf@main", "-o", str(tmp_path / "hf.json")]) == 0
    assert (tmp_path / "hf.json").read_text() == (tmp_path / "local.json").read_text()
    cached = Path(hub_cache_dir(), "models--own--repo", "snapshots", COMMIT, "m.gguf")
    assert cached.read_bytes() == local.read_bytes()  # checked against the hub's sha256
    server.sent = 0
    oid = hashlib.sha256(local.read_bytes()).hexdigest()
    assert main(["verify", "hf://own/repo/m.gguf", "--sha256", oid]) == 0
    assert main(["verify", "hf://own/repo/m.gguf", "--manifest", str(tmp_path / "hf.json")]) == 0
    assert server.sent == 0  # both read the cached file


def test_verify_of_an_hf_name_not_cached_streams_it(
    hub: HubServer, server: CountingServer, tmp_path: Path
) -> None:
    local = server.root / "m.gguf"
    oid = hashlib.sha256(local.read_bytes()).hexdigest()
    assert main(["verify", "hf://own/repo/m.gguf", "--sha256", oid]) == 0
    assert server.sent >= local.stat().st_size
    llama = tmp_path / "h.txt"
    assert main(["hash", str(local), "--format", "llama", "-o", str(llama)]) == 0
    assert main(["verify", f"hf://own/repo/m.gguf@{COMMIT}", "--manifest", str(llama)]) == 0


@pytest.mark.asyncio
async def test_a_cancelled_hash_of_a_stalled_url_ends_promptly(server: CountingServer) -> None:
    server.faults.stall_left, server.faults.stall_s = 1, 30.0
    began = ended = 0.0
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(hash_model, server.url("m.gguf"))
        for _ in range(1000):  # until the first data request, which stalls
            if server.faults.ranged >= 2:
                break
            await anyio.sleep(0.02)
        assert server.faults.ranged >= 2
        await anyio.sleep(0.3)
        began = time.perf_counter()
        tasks.cancel_scope.cancel()
    ended = time.perf_counter()
    assert ended - began < 2.0  # the stall alone lasts 30 s
