"""What a newcomer from llama.cpp meets on the command line: its ``--no-mmap`` and
``--mlock`` (each alone, and the pair, in either order), its flags that set what aiogguf
has no part in (``-c``, ``-dev``), ``--version``, no progress bar for a load that fails
before it reads, and a benchmark that writes only where it is told."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

import aiogguf
from aiogguf.cli import build_parser, main
from aiogguf.cli.bench import _outputs
from aiogguf.cli.options import NOT_APPLICABLE, config_from_args
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
    assert config_from_args(args).load.mode == mode
    assert config_from_args(build_parser().parse_args([command, "m.gguf"])).load.mode == "auto"


@pytest.fixture
def small_model(tmp_path: Path) -> Path:
    return write_synthetic_model(tmp_path / "m.gguf", size_bytes="1MiB", seed=1, n_layer=2).path


@pytest.mark.parametrize("command", ["load", "plan"])
def test_no_mmap_and_mlock_are_refused_together_in_either_order(
    command: str, small_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """llama.cpp reads into memory and locks with the pair; no mode here does both. It
    was mode mmap plus a lock one way round and no lock the other (the last flag won)."""
    said = []
    for pair in (["--no-mmap", "--mlock"], ["--mlock", "--no-mmap"]):
        assert main([command, str(small_model), *pair]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        assert len(captured.err.splitlines()) == 1
        said.append(captured.err)
    assert said[0] == said[1]
    assert "--no-mmap --mlock" in said[0]
    assert "llama.cpp reads the model into memory and locks it" in said[0]


@pytest.mark.parametrize(
    ("flags", "mode"),
    [
        (["--mode", "direct", "--no-mmap"], "direct"),
        (["--no-mmap", "--mode", "none"], "none"),
        (["--mlock", "--mode", "mlock"], "mlock"),
        (["--mode", "mmap", "--no-mmap"], None),
        (["--no-mmap", "--mode", "mmap"], None),
        (["--mlock", "--mode", "none"], None),
    ],
)
def test_mode_and_a_llama_cpp_flag_agree_or_are_refused(
    flags: list[str], mode: str | None, small_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if mode is not None:
        assert (
            config_from_args(build_parser().parse_args(["plan", "m.gguf", *flags])).load.mode
            == mode
        )
        return
    assert main(["plan", str(small_model), *flags]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert "means mode" in err


@pytest.mark.parametrize("command", ["load", "plan", "validate"])
@pytest.mark.parametrize(("flags", "value"), [(f, v) for f in NOT_APPLICABLE for v in ("4", None)])
def test_llama_cpp_flags_that_do_not_apply_are_named_in_one_line(
    command: str,
    flags: tuple[str, str],
    value: str | None,
    small_model: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``-c 4096`` printed the whole usage and "unrecognized arguments"; now one line
    names the flag and why it does not apply, with or without its value, short or long."""
    for flag in flags:
        with pytest.raises(SystemExit) as exit_info:
            main([command, str(small_model), flag, *([value] if value else [])])
        assert exit_info.value.code == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        lines = captured.err.splitlines()
        assert len(lines) == 1, captured.err
        assert lines[0].startswith(f"aiogguf {command}: {flags[0]}/{flags[1]} ")
        assert "llama.cpp" in lines[0]
    assert "loads weights only" in NOT_APPLICABLE["-c", "--ctx-size"]


def test_short_flags_beside_the_refused_ones_still_parse() -> None:
    """``-t`` and ``-c`` sit beside ``-ts`` and ``-ctk``: each still reaches its own."""
    args = build_parser().parse_args(["plan", "m.gguf", "-ts", "3,1", "-ngl", "2"])
    assert config_from_args(args).placement.tensor_split == (3.0, 1.0)


def test_the_override_to_cpu_advice_names_the_flag(
    small_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """llama.cpp says "consider using --no-mmap"; the advice named a TOML key."""
    assert main(["plan", str(small_model), "-ot", "blk\\.0=CPU", "--sim-gpu", "8GiB"]) == 0
    warnings = [line for line in capsys.readouterr().out.splitlines() if "overrides to CPU" in line]
    assert len(warnings) == 1
    assert "consider --no-mmap" in warnings[0]


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
