"""``aiogguf hash`` and ``aiogguf verify``: the sidecar manifest, one manifest for a split
set, the exit statuses, one line on every refusal or mismatch, and a pass that stops
soon when cancelled."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio
import pytest

from aiogguf.cli import main
from aiogguf.errors import LoadError
from aiogguf.integrity._hashing import hash_model, hash_model_llama_sync, hash_model_sync
from aiogguf.integrity._llama_hash import LlamaHasher
from aiogguf.io.files import DataFile
from aiogguf.testing.synth import write_synthetic_model


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hash-cli") / "m.gguf"
    write_synthetic_model(path, size_bytes="3MiB", seed=9, n_layer=2)
    assert main(["hash", str(path)]) == 0
    return path


def one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def test_hash_writes_the_manifest_beside_the_model(model: Path) -> None:
    sidecar = model.with_name("m.gguf.manifest.json")
    data = json.loads(sidecar.read_text())
    assert data["format"] == "aiogguf-manifest"
    assert data["files"][0]["sha256"] == hashlib.sha256(model.read_bytes()).hexdigest()


def test_verify_passes_a_clean_model(model: Path) -> None:
    assert main(["verify", str(model), "--manifest", f"{model}.manifest.json"]) == 0
    oid = hashlib.sha256(model.read_bytes()).hexdigest()
    assert main(["verify", str(model), "--sha256", oid]) == 0
    assert main(["verify", str(model), "--sha256", f"sha256:{oid.upper()}"]) == 0


def test_verify_names_a_damaged_tensor_in_one_line(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    damaged = tmp_path / "m.gguf"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 1
    damaged.write_bytes(data)
    status = main(["verify", str(damaged), "--manifest", f"{model}.manifest.json"])
    line = one_line(capsys)
    assert status == 2
    assert line.startswith(f"aiogguf verify: {damaged}: 1 tensor differs from the manifest")
    assert "block 0 at offset" in line
    oid = hashlib.sha256(model.read_bytes()).hexdigest()
    assert main(["verify", str(damaged), "--sha256", oid]) == 2
    assert f"expected {oid}" in one_line(capsys)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--sha256", "abc"], "expected 64 hex digits"),
        (["--manifest", "{d}/none.json"], "cannot open"),
        (["--manifest", "{d}/bad.json"], "not JSON"),
        (["--manifest", "{d}/other.json"], "not a manifest of this model"),
    ],
)
def test_verify_refuses_in_one_line(
    model: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    words: str,
) -> None:
    (tmp_path / "bad.json").write_text("{")
    other = tmp_path / "o.gguf"
    write_synthetic_model(other, size_bytes="1MiB", seed=9, n_layer=1)
    assert main(["hash", str(other), "-o", str(tmp_path / "other.json")]) == 0
    capsys.readouterr()
    status = main(["verify", str(model), *[a.replace("{d}", str(tmp_path)) for a in args]])
    assert status == 2
    assert words in one_line(capsys)


def test_one_manifest_covers_a_split_set(tmp_path: Path) -> None:
    write_synthetic_model(tmp_path / "s.gguf", size_bytes="3MiB", seed=2, n_layer=3, split_count=3)
    first = tmp_path / "s-00001-of-00003.gguf"
    assert main(["hash", str(first)]) == 0
    data = json.loads((tmp_path / "s-00001-of-00003.gguf.manifest.json").read_text())
    assert [f["name"] for f in data["files"]] == [f"s-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert {t["file"] for t in data["tensors"]} == {0, 1, 2}
    assert main(["verify", str(first), "--manifest", f"{first}.manifest.json"]) == 0


def test_llama_format_round_trips_through_verify(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "h.txt"
    assert main(["hash", str(model), "--format", "llama", "-o", str(out)]) == 0
    assert out.read_text().startswith("xxh64     ")
    assert main(["verify", str(model), "--manifest", str(out)]) == 0


def test_a_load_checks_a_llama_manifest(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "h.txt"
    assert main(["hash", str(model), "--format", "llama", "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["load", str(model), "--manifest", str(out)]) == 0
    n = len(hash_model_llama_sync(model, algorithms=("xxh64",))[0].tensors)
    assert f"{n} tensors match the manifest" in capsys.readouterr().out


def test_hash_to_stdout(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["hash", str(model), "--format", "llama", "-o", "-"]) == 0
    captured = capsys.readouterr()
    assert captured.out.rstrip().splitlines()[-1].startswith("uuid      ")
    assert "wrote stdout" in captured.err


@pytest.mark.asyncio
async def test_a_cancelled_pass_stops_within_a_piece(tmp_path: Path) -> None:
    path = tmp_path / "big.gguf"
    write_synthetic_model(path, size_bytes="96MiB", seed=1, n_layer=2)
    seen: list[int] = []
    cancelled_at: list[float] = []
    with anyio.CancelScope() as scope:

        def progress(done: int, total: int) -> None:
            seen.append(done)
            cancelled_at.append(time.perf_counter())
            scope.cancel()

        await hash_model(path, progress=progress)
    assert scope.cancelled_caught
    assert seen[0] < path.stat().st_size // 2  # it did not read on to the end
    assert time.perf_counter() - cancelled_at[0] < 1.0


def test_a_lane_that_fails_fails_the_pass_with_its_own_error(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: LlamaHasher, offset: int, data: object) -> None:
        raise RuntimeError("lane broke")

    monkeypatch.setattr(LlamaHasher, "update", broken)
    started = time.perf_counter()
    with pytest.raises(RuntimeError, match="lane broke"):
        hash_model_llama_sync(model)
    assert time.perf_counter() - started < 5


def test_a_file_cut_short_while_it_is_hashed_is_a_load_error(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    victim = tmp_path / "m.gguf"
    victim.write_bytes(model.read_bytes())
    real = DataFile.read_into

    def shrinking(self: DataFile, dest: object, offset: int, **kw: object) -> None:
        os.truncate(self.path, offset + 10)
        real(self, dest, offset)  # type: ignore[arg-type]

    monkeypatch.setattr(DataFile, "read_into", shrinking)
    with pytest.raises(LoadError, match="file ended"):
        hash_model_sync(victim)


SLOW_HASH = textwrap.dedent(
    """
    import sys, time
    import aiogguf.cli
    from aiogguf.cli import main
    from aiogguf.io.files import DataFile

    real = DataFile.read_into

    def slow(self, dest, offset, **kw):
        if offset > 0:
            print("hashing", flush=True)
        time.sleep(0.05)  # a slow disk: the pass is still on when Ctrl-C comes
        real(self, dest, offset, **kw)

    DataFile.read_into = slow
    sys.argv = ["aiogguf", "hash", sys.argv[1], "-o", sys.argv[2]]
    sys.exit(main())
    """
)


def test_ctrl_c_stops_a_hash_within_a_second(tmp_path: Path) -> None:
    """Status 130, one line, no manifest (not even half of one) left behind."""
    path = tmp_path / "m.gguf"
    write_synthetic_model(path, size_bytes="64MiB", seed=1, n_layer=2)
    output = tmp_path / "out.json"
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_HASH, str(path), str(output)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "hashing\n"
        proc.send_signal(signal.SIGINT)
        sent = time.perf_counter()
        _, err = proc.communicate(timeout=30)
        took = time.perf_counter() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130
    assert err.strip().splitlines() == ["aiogguf hash: interrupted"]
    assert took < 1.5  # the watchdog's 0.8 s at most, and the process's end
    assert not output.exists()
    assert list(tmp_path.glob(".aiogguf-*")) == []  # no half-written manifest left
