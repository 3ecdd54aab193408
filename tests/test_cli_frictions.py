"""What a newcomer from llama.cpp meets on the command line: its ``--no-mmap`` and
``--mlock`` (each alone, and the pair, in either order), its flags that set what aiogguf
has no part in (``-c``, ``-dev``), ``--version``, no progress bar for a load that fails
before it reads, and a benchmark that writes only where it is told."""

from __future__ import annotations

import argparse
import errno
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

import aiogguf
from aiogguf._config import Config
from aiogguf._events import Stage
from aiogguf._run import interrupt_run
from aiogguf.cli import _os_error_line, build_parser, loading, main
from aiogguf.cli.bench import _outputs
from aiogguf.cli.options import NOT_APPLICABLE, config_from_args
from aiogguf.testing.synth import Corruption, write_synthetic_model


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


# --- messages -----------------------------------------------------------------------------

# Run before the command: ``None`` in sys.modules makes ``import aiohttp`` fail the way a
# missing package does (ModuleNotFoundError, name "aiohttp").
HIDE_AIOHTTP = (
    "import sys; sys.modules['aiohttp'] = None\n"
    "from aiogguf.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def test_serve_without_aiohttp_names_the_extra_and_exits_2(tmp_path: Path) -> None:
    """It exited 1, the status the README keeps for bugs."""
    done = subprocess.run(
        # -P and a cwd away from the repository: our io/ folder must not shadow the stdlib.
        [sys.executable, "-P", "-c", HIDE_AIOHTTP, "serve", "--root", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("aiogguf serve: the server needs aiohttp")
    assert lines[0].endswith("pip install 'aiogguf[server]'")


@pytest.mark.parametrize("command", ["plan", "load"])
def test_gpu_layers_without_cupy_name_the_cuda_extra(
    command: str,
    small_model: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # not installed
    assert main([command, str(small_model), "-ngl", "99"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"aiogguf {command}: note: -ngl 99 asks for GPU layers, but CuPy is not installed, "
        "so every layer is on the CPU: pip install 'aiogguf[cuda]'"
    ]
    # Not asked for GPU layers, or planned for simulated GPUs: nothing to say.
    for flags in (["-ngl", "0"], [], ["-ngl", "99", "--sim-gpu", "8GiB"]):
        assert main([command, str(small_model), *flags]) == 0
        assert capsys.readouterr().err == ""


def test_a_path_with_a_newline_stays_on_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A newline in a path reached stderr raw: a second line, made by the path."""
    missing = tmp_path / "evil\nname\x1b[2J.gguf"
    assert main(["load", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, repr(err)
    assert "\x1b" not in err
    assert "evil\\nname\\x1b[2J.gguf: cannot open" in err
    error = FileNotFoundError(2, "No such file or directory", "/a\nb")
    assert _os_error_line(error) == "/a\\nb: No such file or directory"


@pytest.mark.filterwarnings("default::aiogguf.errors.LoadWarning")  # as outside pytest
def test_a_load_warning_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """It printed as Python's warning: the source file and line, the category, and the
    line of code that warned on a second line."""
    model = write_synthetic_model(tmp_path / "m\n.gguf", size_bytes="1MiB", seed=1, n_layer=2)
    real_open = os.open

    def refusing_direct(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing_direct)
    assert main(["load", str(model.path), "--mode", "direct", "-ngl", "0"]) == 0
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert line.startswith(f"aiogguf load: warning: {tmp_path}/m\\n.gguf: ")
    assert line.endswith("reading with mode 'none' instead")
    # The report says it again, its path escaped too (rich may wrap the line).
    assert captured.out.count("warning:") == 1
    assert "m\\n.gguf" in captured.out
    assert "m\n.gguf" not in captured.out


def test_an_interrupted_bar_says_interrupted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C (which cancels the command's run) labelled the bar ``(failed)``."""
    model = write_synthetic_model(tmp_path / "m.gguf", size_bytes="8MiB", seed=1, n_layer=2)
    real_load = loading.load

    def interrupted_load(path: Any, config: Config, progress: Callable[[Any], None]) -> Any:
        def on_progress(event: Any) -> None:
            progress(event)
            if event.stage is Stage.READ:
                interrupt_run()  # what the CLI's SIGINT handler does, once the bar is drawn
            elif not event.final:
                # Events come at most every 50 ms: a wait here lets the first read's come
                # (this small a load is otherwise over before then).
                time.sleep(0.1)

        return real_load(path, config, progress=on_progress)

    monkeypatch.setattr(loading, "load", interrupted_load)
    out = io.StringIO()
    config = Config().with_overrides(n_gpu_layers=0, mode="none", chunk_size="1MiB")
    with pytest.raises(KeyboardInterrupt):
        loading.load_with_progress(model.path, config, Console(file=out, width=200))
    assert "m.gguf (interrupted)" in out.getvalue()
    assert "(failed)" not in out.getvalue()


def test_one_bad_tensor_is_singular(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """It said "1 bad tensors"."""
    bad = write_synthetic_model(
        tmp_path / "bad.gguf",
        size_bytes="1MiB",
        seed=1,
        n_layer=2,
        corruptions=[Corruption("output_norm.weight", "inf_element", 0)],
    )
    assert main(["validate", str(bad.path), "-ngl", "0"]) == 2
    out = capsys.readouterr().out
    titles = [line.strip() for line in out.splitlines() if "bad tensor" in line]
    assert titles == ["1 bad tensor"]


def test_plan_says_it_does_not_model_amx_or_cpu_repack(
    small_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """llama.cpp's default puts most CPU weights in AMX / CPU_REPACK buffers on a CPU
    with those kernels; the plan showed one CPU buffer and said nothing."""
    assert main(["plan", str(small_model), "-ngl", "0"]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if "CPU_REPACK" in line]
    assert len(notes) == 1
    assert "AMX / CPU_REPACK" in notes[0]
    assert "does not model" in notes[0]
    assert main(["plan", str(small_model), "-ngl", "0", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    on_cpu = [t for t in data["tensors"] if t["device"] == "CPU" and t["class"] != "input"]
    assert on_cpu
    assert data["cpu_extra_buffers"] == {
        "modelled": False,
        "types": ["AMX", "CPU_REPACK"],
        "tensors": len(on_cpu),
    }
    # Every weight llama.cpp could repack is on a GPU: nothing to say.
    gpu = ["-ngl", "99", "--sim-gpu", "8GiB"]
    assert main(["plan", str(small_model), *gpu]) == 0
    assert "CPU_REPACK" not in capsys.readouterr().out
    assert main(["plan", str(small_model), *gpu, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cpu_extra_buffers"]["tensors"] == 0
