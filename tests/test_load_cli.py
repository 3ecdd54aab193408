"""The ``aiogguf load`` and ``aiogguf demo`` commands: exit 0 and print the report;
errors are one line on stderr and exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from aiogguf.cli import main
from aiogguf.testing.synth import SynthModel, write_synthetic_model


@pytest.fixture(autouse=True)
def wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    """rich wraps at 80 columns when not on a terminal: keep lines whole to match them."""
    monkeypatch.setenv("COLUMNS", "200")


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> SynthModel:
    path = tmp_path_factory.mktemp("cli") / "m.gguf"
    return write_synthetic_model(path, size_bytes="3MiB", seed=23, n_layer=4)


def _assert_report(out: str, n_tensors: int, mode: str) -> None:
    for title in ("stages", "buffers", "files"):
        assert title in out
    for stage in ("parse+index", "plan", "allocate", "read"):
        assert stage in out
    assert f"loaded {n_tensors} tensors" in out
    assert f"(mode {mode}" in out
    assert "GB/s" in out


@pytest.mark.parametrize("mode", ["mmap", "none", "direct"])
def test_load_prints_the_report(
    model_file: SynthModel, mode: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["load", str(model_file.path), "--mode", mode, "-ngl", "0"]) == 0
    out = capsys.readouterr().out
    _assert_report(out, model_file.n_tensors, mode)
    assert f"{model_file.n_tensors} tensors validated" in out
    assert model_file.path.name in out


def test_load_with_sim_gpus_and_no_check(
    model_file: SynthModel, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["load", str(model_file.path), "--no-check", "--sim-gpu", "1GiB", "-ngl", "-1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    _assert_report(out, model_file.n_tensors, "mmap")
    assert "validated" not in out


def test_load_split_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    m = write_synthetic_model(tmp_path / "s.gguf", size_bytes="2MiB", split_count=2, seed=1)
    assert main(["load", str(m.path), "--mode", "none", "-ngl", "0"]) == 0
    out = capsys.readouterr().out
    for p in m.paths:
        assert p.name in out


def test_demo_writes_and_loads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--size", "32MiB", "--dir", str(tmp_path), "-ngl", "0"]) == 0
    out = capsys.readouterr().out
    assert "wrote in" in out
    written = list(tmp_path.glob("*.gguf"))
    assert len(written) == 1
    _assert_report(out, int(out.split("loaded ")[1].split()[0]), "mmap")
    # A second run reuses the file.
    assert (
        main(["demo", "--size", "32MiB", "--dir", str(tmp_path), "--mode", "none", "-ngl", "0"])
        == 0
    )
    out = capsys.readouterr().out
    assert "reusing" in out
    _assert_report(out, int(out.split("loaded ")[1].split()[0]), "none")


def _one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["load", "{missing}"], "missing.gguf"),
        (
            ["load", "{model}", "--sim-gpu", "1GiB", "-ngl", "-1", "-sm", "none", "-mg", "7"],
            "main_gpu",
        ),
        (["load", "{model}", "-ot", "nonsense"], "--override-tensor"),
        (["load", "{garbage}"], "garbage.gguf"),
        (["demo", "--size", "lots", "--dir", "{tmp}"], "lots"),
    ],
)
def test_errors_are_one_line_and_exit_2(
    model_file: SynthModel,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    needle: str,
) -> None:
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 10)
    paths = {
        "missing": str(tmp_path / "missing.gguf"),
        "model": str(model_file.path),
        "garbage": str(garbage),
        "tmp": str(tmp_path),
    }
    argv = [a.format(**paths) for a in args]
    assert main(argv) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith(f"aiogguf {argv[0]}: ")
    assert needle in line
    assert "Traceback" not in line


def test_console_script_in_a_subprocess(model_file: SynthModel, tmp_path: Path) -> None:
    """The real entry point: exit codes and streams as a shell sees them."""
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}

    def aiogguf_load(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "aiogguf", "load", *args],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=60,
        )

    # Side by side: each waits mostly for its interpreter to start.
    with ThreadPoolExecutor(max_workers=2) as pool:
        loading = pool.submit(aiogguf_load, str(model_file.path), "--mode", "none")
        failing = pool.submit(aiogguf_load, str(tmp_path / "nope.gguf"))
        ok, bad = loading.result(), failing.result()
    assert ok.returncode == 0, ok.stderr
    _assert_report(ok.stdout, model_file.n_tensors, "none")
    assert bad.returncode == 2
    assert "nope.gguf" in _one_error_line(bad.stderr)
