"""One exit status per kind of failure (issue #24, finding 6), each test failing before:
an overflowing size, a TOML nested too deep, a non-finite ``-ts`` weight and a full disk
exit 2 with one line (not 1 with an ``OverflowError``), and Ctrl-C while the command's
modules import exits 130 with one line (not signal status -2 and a traceback)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiogguf._units import MAX_SIZE, parse_size
from aiogguf.cli import main
from aiogguf.testing.synth import SynthModel, write_synthetic_model

BIG = "9" * 400 + "GiB"
ENDS_WITHIN_S = 30
# The installed ``aiogguf`` command (what ``pip install`` made of [project.scripts]).
CONSOLE_SCRIPT = Path(sys.executable).with_name("aiogguf")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> SynthModel:
    path = tmp_path_factory.mktemp("cli-exits") / "m.gguf"
    return write_synthetic_model(path, size_bytes="1MiB", seed=3, n_layer=2)


def config_file(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


CASES: dict[str, tuple[list[str], str]] = {
    # name: (arguments, words the one line must hold); {m}: the model, {d}: a folder,
    # {lazy}/{deep}: config files.
    "serve --max-staging": (["serve", "--root", "{d}", "--max-staging", BIG], "too large"),
    "serve --max-loaded-bytes": (
        ["serve", "--root", "{d}", "--max-loaded-bytes", BIG],
        "too large",
    ),
    "serve --request-timeout inf": (
        ["serve", "--root", "{d}", "--request-timeout", "1e999"],
        "request_timeout_s",
    ),
    "plan --sim-gpu": (["plan", "{m}", "--sim-gpu", BIG], "too large"),
    "load --config lazy_min_bytes": (["load", "{m}", "--config", "{lazy}"], "lazy_min_bytes"),
    "load --config nested": (["load", "{m}", "--config", "{deep}"], "nested too deeply"),
    "plan -ts 1e999,1": (
        ["plan", "{m}", "-ts", "1e999,1", "--sim-gpu", "1GiB", "--sim-gpu", "1GiB"],
        "finite",
    ),
    "plan -ts nan,1": (
        ["plan", "{m}", "-ts", "nan,1", "--sim-gpu", "1GiB", "--sim-gpu", "1GiB"],
        "finite",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_values_exit_2_with_one_line(
    case: str, model: SynthModel, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each of these exited 1 with an OverflowError or a RecursionError; -ts 1e999,1 was
    accepted (a RuntimeWarning, and every layer on the second device)."""
    args, words = CASES[case]
    values = {
        "m": str(model.path),
        "d": str(tmp_path),
        "lazy": config_file(tmp_path, "lazy.toml", f'[load]\nlazy_min_bytes = "{BIG}"\n'),
        "deep": config_file(tmp_path, "deep.toml", "a = " + "[" * 5000 + "]" * 5000 + "\n"),
    }
    assert main([arg.format(**values) for arg in args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert words in err
    assert len(err) < 400  # the 400 digits are not echoed whole


def test_demo_on_a_full_disk_exits_2_and_leaves_no_partial_model(tmp_path: Path) -> None:
    """``demo`` on a full disk exited 1 with a raw OSError. The disk here is /dev/full,
    where every write fails with ENOSPC, linked where the demo writes its model."""
    target = tmp_path / "demo-1MiB-s0.gguf"
    target.symlink_to("/dev/full")
    result = subprocess.run(
        [sys.executable, "-m", "aiogguf", "demo", "--size", "1MiB", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=ENDS_WITHIN_S,
    )
    assert result.returncode == 2, result
    assert result.stderr == f"aiogguf demo: {target}: No space left on device\n"
    assert not target.exists()
    assert not target.is_symlink()


# --- Ctrl-C while modules import ------------------------------------------------------------


def interrupt_when_imported(args: list[str], module: str) -> tuple[int, list[str]]:
    """``aiogguf ARGS`` under ``-X importtime`` (which writes a line to stderr as each
    module is imported); SIGINT once ``module`` has been. Its status and its stderr,
    without the import lines."""
    proc = subprocess.Popen(
        [sys.executable, "-X", "importtime", str(CONSOLE_SCRIPT), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    assert proc.stderr is not None
    lines: list[bytes] = []
    pending = b""
    deadline = time.monotonic() + ENDS_WITHIN_S
    try:
        # "import time: self | cumulative | <indent>name"
        while not any(line.split(b"|")[-1].strip() == module.encode() for line in lines):
            assert time.monotonic() < deadline, f"{module} never imported"
            ready, _, _ = select.select([proc.stderr], [], [], 1.0)
            if ready:
                chunk = os.read(proc.stderr.fileno(), 65536)
                assert chunk, b"".join(lines)[-2000:]
                *complete, pending = (pending + chunk).split(b"\n")
                lines.extend(complete)
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=ENDS_WITHIN_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
    all_lines = [*lines, *(pending + rest).split(b"\n")]
    said = [
        line.decode(errors="replace")
        for line in all_lines
        if line.strip() and not line.startswith(b"import time:")
    ]
    return proc.returncode, said


@pytest.mark.parametrize(
    ("args", "module", "line"),
    [
        # while ``import aiogguf`` imports the loader, before any command's code
        (["load", "m.gguf"], "aiogguf._config", "aiogguf: interrupted"),
        # while the commands' parsers import
        (["load", "m.gguf"], "aiogguf.cli.loading", "aiogguf: interrupted"),
        # while serve imports aiohttp, after its arguments are read
        (["serve", "--root", "."], "multidict", "aiogguf serve: interrupted"),
    ],
)
def test_ctrl_c_while_modules_import_exits_130_without_a_traceback(
    args: list[str], module: str, line: str
) -> None:
    """Ctrl-C in the first half second of ``load`` or ``serve`` ended with signal status
    -2 and a 45-line traceback. (The console script: ``python -m aiogguf`` imports the
    package before any line of ours runs.)"""
    status, said = interrupt_when_imported(args, module)
    assert status == 130, said
    assert said == [line]


@pytest.mark.slow
@pytest.mark.parametrize("command", [["load", "m.gguf"], ["serve", "--root", "."]])
def test_ctrl_c_at_any_moment_of_the_start_exits_130(command: list[str], tmp_path: Path) -> None:
    """SIGINT every 50 ms from the start to 0.6 s: always 130, one line. The start is
    when a bare interpreter would have begun to run a script (measured here: twice the
    slowest of three ``python -c pass``); before it, Ctrl-C is the interpreter's own."""
    write_synthetic_model(tmp_path / "m.gguf", size_bytes="1MiB", seed=1, n_layer=2)
    bare = []
    for _ in range(3):
        began = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        bare.append(time.perf_counter() - began)
    first_ms = max(int(2000 * max(bare)), 60)
    for delay_ms in range(first_ms, 650, 50):
        proc = subprocess.Popen(
            [sys.executable, str(CONSOLE_SCRIPT), *command],
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(delay_ms / 1000)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=ENDS_WITHIN_S)
        if command[0] == "load" and proc.returncode == 0:
            continue  # the load was done before the signal came
        assert proc.returncode == 130, (delay_ms, err)
        assert "Traceback" not in err, (delay_ms, err)
        assert err.count("\n") == 1, (delay_ms, err)


@settings(max_examples=300, deadline=None)
@given(
    st.text(max_size=60)
    | st.from_regex(r"\s*\d{1,500}(\.\d{1,60})?\s*[a-zA-Z]{0,3}\s*", fullmatch=True)
    | st.integers()
)
def test_a_size_is_a_bounded_count_of_bytes_or_one_line_of_refusal(value: str | int) -> None:
    """``parse_size`` turned 400 digits into infinity, then raised OverflowError."""
    refusal = ""
    try:
        size = parse_size(value)
    except ValueError as exc:
        refusal = str(exc)
        size = 0
    assert "\n" not in refusal
    assert len(refusal) < 200
    assert 0 <= size <= MAX_SIZE
