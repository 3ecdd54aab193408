"""The command line as an operator meets it: only regular files are opened, Ctrl-C ends
any command, bad arguments and config values exit 2 with one line, ``plan`` warns of too
little memory in every mode (``--strict``: exit 3), and running out of memory exits the
same in every mode. (Finding 7 of the "safe to serve" review.)"""

from __future__ import annotations

import errno
import mmap
import os
import signal
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from aiogguf._config import (
    MAX_QUEUE_DEPTH,
    MAX_STAGING_BUFFERS,
    MAX_THREADS,
    load_config,
)
from aiogguf.cli import main
from aiogguf.errors import ConfigError
from aiogguf.testing.synth import SynthModel, write_synthetic_model

GiB = 1024**3
# Generous: these tests tell "ends" from "hangs", not fast from slow.
ENDS_WITHIN_S = 30


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> SynthModel:
    path = tmp_path_factory.mktemp("cli-robust") / "m.gguf"
    return write_synthetic_model(path, size_bytes="2MiB", seed=3, n_layer=4)


def _cli(*args: str, timeout: float = ENDS_WITHIN_S) -> subprocess.CompletedProcess[str]:
    """``aiogguf ARGS`` in a process of its own (a hang must not hang the suite)."""
    try:
        return subprocess.run(
            [sys.executable, "-m", "aiogguf", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"aiogguf {' '.join(args)} still running after {timeout} s: {exc.stderr!r}")


# --- only regular files ----------------------------------------------------------------


FIFO_COMMANDS = ("inspect", "load", "plan", "validate")


@pytest.fixture(scope="module")
def fifo_runs(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[Path, subprocess.CompletedProcess[str] | str]]:
    """Each command on a FIFO of its own, in processes side by side (each waits mostly
    for its interpreter to start): command → (the FIFO, the finished process or why it
    did not finish)."""

    def run(command: str) -> tuple[Path, subprocess.CompletedProcess[str] | str]:
        fifo = tmp_path_factory.mktemp(f"fifo-{command}") / "model.gguf"
        os.mkfifo(fifo)
        try:
            return fifo, _cli(command, str(fifo))
        except pytest.fail.Exception as exc:
            return fifo, str(exc)

    with ThreadPoolExecutor(max_workers=len(FIFO_COMMANDS)) as pool:
        return dict(zip(FIFO_COMMANDS, pool.map(run, FIFO_COMMANDS), strict=True))


@pytest.mark.parametrize("command", FIFO_COMMANDS)
def test_fifo_is_refused_not_waited_on(
    fifo_runs: dict[str, tuple[Path, subprocess.CompletedProcess[str] | str]], command: str
) -> None:
    """A FIFO hung inspect/load/plan/validate for ever (the open blocks for a writer)."""
    fifo, proc = fifo_runs[command]
    if isinstance(proc, str):
        pytest.fail(proc)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1
    assert f"{fifo}: not a regular file: it is a FIFO" in proc.stderr


@pytest.mark.parametrize(
    ("path", "kind"), [("/dev/zero", "a character device"), (".", "a directory")]
)
@pytest.mark.parametrize("command", ["inspect", "load"])
def test_other_kinds_of_file_are_refused(
    command: str, path: str, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([command, path]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"not a regular file: it is {kind}" in err


# --- Ctrl-C -------------------------------------------------------------------------------

STUCK = textwrap.dedent(
    """
    import sys, threading
    import aiogguf.cli
    from aiogguf.cli import main
    from aiogguf.io.opener import OpenFiles

    # The watchdog's wait before it ends the process: what ends it is the point here, not
    # how long it waits.
    aiogguf.cli.INTERRUPT_GRACE_S = 0.1

    def stuck_open(self, path, *args, **kwargs):
        # A thread blocked for good, as in an open() on a hung filesystem. Said from
        # inside the command, so that its SIGINT handling is in place by then.
        print("ready", flush=True)
        print("stuck", flush=True)
        threading.Event().wait()

    OpenFiles.open = stuck_open
    sys.argv = ["aiogguf", "inspect", sys.argv[1]]
    sys.exit(main())
    """
)


def test_ctrl_c_ends_a_command_whose_thread_is_stuck(model: SynthModel) -> None:
    """Ctrl-C printed "interrupted" but the process stayed: the interpreter waited at
    exit for a worker thread blocked in a system call."""
    proc = subprocess.Popen(
        [sys.executable, "-c", STUCK, str(model.path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "ready\n"
        assert proc.stdout.readline() == "stuck\n"  # the command's thread is blocked
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=ENDS_WITHIN_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            pytest.fail("still running after Ctrl-C")
    assert proc.returncode == 130
    assert err.strip().splitlines()[-1] == "aiogguf inspect: interrupted"


# --- arguments and config values ---------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["demo", "--size", "0"],
        ["demo", "--size=-1MiB"],
        ["demo", "--size", "lots"],
        ["bench", "--size", "0"],
        ["bench", "--chunk-sizes", "0"],
        ["bench", "--runs", "0"],
    ],
)
def test_bad_arguments_exit_2_with_one_line(
    tmp_path: Path, args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """``demo --size 0`` ended in ZeroDivisionError with exit 1."""
    assert main([*args, "--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert args[1].split("=")[0] in err


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("readers", MAX_THREADS + 1),
        ("readers", 1000),
        ("validate_workers", 1000),
        ("queue_depth", 10**20),
        ("queue_depth", MAX_QUEUE_DEPTH + 1),
        ("staging_buffers", MAX_STAGING_BUFFERS + 1),
        ("chunk_size", 1),
        ("chunk_size", "2KiB"),
        ("chunk_size", "1TiB"),
        ("staging_buffer_size", 100),
    ],
)
def test_config_values_over_a_cap_are_named(key: str, value: Any) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(None, **{key: value})
    assert key in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("readers", MAX_THREADS),
        ("validate_workers", MAX_THREADS),
        ("queue_depth", MAX_QUEUE_DEPTH),
        ("chunk_size", "4KiB"),
    ],
)
def test_config_values_at_a_cap_are_accepted(key: str, value: Any) -> None:
    load_config(None, **{key: value})


def test_config_file_over_a_cap_exits_2(
    tmp_path: Path, model: SynthModel, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "c.toml"
    config.write_text("[pipeline]\nreaders = 1000\n")
    assert main(["load", str(model.path), "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "pipeline.readers" in err
    assert str(config) in err


# --- plan: memory in every mode, --strict ------------------------------------------------


@pytest.fixture
def small_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host with 1 MiB of RAM (all free) and RLIMIT_MEMLOCK of 64 KiB, which the
    process may not exceed (no ``CAP_IPC_LOCK``)."""
    monkeypatch.setattr("aiogguf.io._devices.cpu.host_memory", lambda: (1 << 20, 1 << 20))
    monkeypatch.setattr("aiogguf.stages.plan.memlock_limit", lambda: 64 << 10)
    monkeypatch.setattr("aiogguf.stages.plan.may_lock_past_limit", lambda: False)


@pytest.mark.usefixtures("small_host")
@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("none", ["device CPU needs"]),
        ("direct", ["device CPU needs"]),
        ("mmap", ["mode mmap:", "must be resident", "of RAM"]),
        ("mlock", ["mode mlock:", "RLIMIT_MEMLOCK is 64.0 KiB"]),
    ],
)
def test_plan_warns_of_a_memory_shortfall_in_every_mode(
    model: SynthModel, mode: str, expected: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A 40 GiB model planned with --mode mlock on a 23 GiB host gave no warning: only
    mode none compared the host's memory with the model."""
    assert main(["plan", str(model.path), "--mode", mode]) == 0
    out = capsys.readouterr().out
    warnings = [line for line in out.splitlines() if line.startswith("warning:")]
    assert warnings, out
    for text in expected:
        assert any(text in w for w in warnings), warnings
    assert main(["plan", str(model.path), "--mode", mode, "--strict"]) == 3


@pytest.mark.usefixtures("small_host")
def test_plan_does_not_warn_of_the_lock_limit_when_it_does_not_apply(
    model: SynthModel, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A process with ``CAP_IPC_LOCK`` (root) locks past ``RLIMIT_MEMLOCK``: llama.cpp
    locked a whole model as root while the plan warned that it would not be locked."""
    monkeypatch.setattr("aiogguf.stages.plan.may_lock_past_limit", lambda: True)
    assert main(["plan", str(model.path), "--mode", "mlock"]) == 0
    assert "RLIMIT_MEMLOCK" not in capsys.readouterr().out


def test_plan_strict_without_warnings_exits_0(
    model: SynthModel, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("aiogguf.io._devices.cpu.host_memory", lambda: (64 * GiB, 64 * GiB))
    monkeypatch.setattr("aiogguf.stages.plan.memlock_limit", lambda: None)
    for mode in ("none", "direct", "mmap", "mlock"):
        assert main(["plan", str(model.path), "--mode", mode, "--strict"]) == 0
        assert "warning:" not in capsys.readouterr().out


# --- the same failure, the same exit status ----------------------------------------------


@pytest.mark.parametrize("mode", ["none", "direct", "mmap", "mlock"])
def test_out_of_memory_exits_2_in_every_mode(
    model: SynthModel,
    mode: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Out of memory exited 1 in none/direct (a raw MemoryError) and 2 in mmap (a
    refused mapping is a LoadError)."""
    real = mmap.mmap

    def refuse(fileno: int, length: int, *args: Any, **kwargs: Any) -> mmap.mmap:
        # Every mapping of the load (host buffers, file mappings) is refused; numpy's
        # own allocations do not come through here.
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    monkeypatch.setattr(mmap, "mmap", refuse)
    try:
        status = main(["load", str(model.path), "--mode", mode])
    finally:
        monkeypatch.setattr(mmap, "mmap", real)
    err = capsys.readouterr().err
    assert status == 2, err
    assert "Cannot allocate memory" in err
