"""The harness (``aiogguf.testing``) stays out of the runtime: importing the loader or
building the CLI's parser imports neither it nor ``gguf``, and without ``gguf`` the
commands that write a synthetic model say which extra to install (exit 2, one line)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from aiogguf.cli import build_parser
from aiogguf.cli.bench import SETTLE_DEFAULT_S
from aiogguf.testing.bench import SETTLE_S

# Run before the command: ``None`` in sys.modules makes every ``import gguf`` fail the
# way a missing package does (ModuleNotFoundError, name "gguf").
HIDE_GGUF = "import sys; sys.modules['gguf'] = None\n"


def _python(code: str, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # -P and a cwd away from the repository: our io/ folder must not shadow the stdlib.
    return subprocess.run(
        [sys.executable, "-P", "-c", code, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _cli_without_gguf(cwd: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    code = HIDE_GGUF + "from aiogguf.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    return _python(code, cwd, *argv)


def test_importing_the_loader_and_the_cli_imports_no_harness(tmp_path: Path) -> None:
    code = (
        "import sys, aiogguf, aiogguf.cli\n"
        "aiogguf.cli.build_parser()\n"
        "loaded = sorted(m for m in sys.modules if m == 'gguf' or m.startswith(('gguf.',"
        " 'aiogguf.testing')))\n"
        "print(loaded)\n"
    )
    done = _python(code, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_without_gguf_the_command_names_the_extra(tmp_path: Path, command: str) -> None:
    done = _cli_without_gguf(tmp_path, command, "--size", "1MiB", "--dir", str(tmp_path))
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"aiogguf {command}: ")
    assert "pip install 'aiogguf[demo]'" in lines[0]
    assert not list(tmp_path.glob("**/*.gguf"))  # failed before writing anything


def test_without_gguf_inspect_still_reads_a_file(reference_dir: Path, tmp_path: Path) -> None:
    path = reference_dir / "tiny-llama-F16.gguf"
    done = _cli_without_gguf(tmp_path, "inspect", "--json", str(path))
    assert done.returncode == 0, done.stderr
    assert '"tensors"' in done.stdout


def test_the_settle_default_is_the_harness_pause() -> None:
    # The CLI restates SETTLE_S so that building its parser imports no harness.
    assert SETTLE_DEFAULT_S == SETTLE_S
    bench = build_parser().parse_args(["bench"])
    assert bench.settle == SETTLE_S
