"""What a newcomer from llama.cpp meets on the command line: its ``--no-mmap`` and
``--mlock``, ``--version``, no progress bar for a load that fails before it reads, and a
benchmark that writes only where it is told."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

import aiogguf
from aiogguf.cli import build_parser, main
from aiogguf.cli.bench import _outputs
from aiogguf.testing.synth import write_synthetic_model


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"aiogguf {aiogguf.__version__}"


@pytest.mark.parametrize("command", ["load", "validate", "plan"])
@pytest.mark.parametrize(("flag", "mode"), [("--no-mmap", "none"), ("--mlock", "mlock")])
def test_llama_cpp_mode_flags(command: str, flag: str, mode: str) -> None:
    args = build_parser().parse_args([command, "m.gguf", flag])
    assert args.mode == mode
    assert build_parser().parse_args([command, "m.gguf"]).mode is None


def test_no_mmap_loads_with_mode_none(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    synth = write_synthetic_model(tmp_path / "m.gguf", size_bytes="1MiB", seed=1, n_layer=2)
    assert main(["load", str(synth.path), "--no-mmap", "-ngl", "0"]) == 0
    out = capsys.readouterr().out
    assert "(mode none" in " ".join(out.split())


@pytest.mark.parametrize("command", ["load", "validate"])
def test_a_load_that_fails_before_reading_draws_no_bar(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 10)
    for path in (tmp_path / "missing.gguf", garbage):
        assert main([command, str(path)]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        assert len(captured.err.splitlines()) == 1
        assert "failed" not in captured.err


def test_bench_writes_only_where_told(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    from aiogguf.cli import bench

    bench.add_arguments(parser)
    assert _outputs(parser.parse_args(["--quick"])) == (None, None)
    json_path, plot_path = _outputs(parser.parse_args(["--out", str(tmp_path / "o")]))
    assert json_path == tmp_path / "o" / "aiogguf-bench.json"
    assert plot_path == tmp_path / "o" / "aiogguf-bench.png"
    assert (tmp_path / "o").is_dir()
    only = _outputs(parser.parse_args(["--json", str(tmp_path / "r.json")]))
    assert only == (tmp_path / "r.json", None)
