"""The harness (``aiogguf.testing``) stays out of the runtime: importing the loader or
building the CLI's parser imports neither it nor ``gguf``, and without ``gguf`` the
commands that write a synthetic model say which extra to install (exit 2, one line)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import REFERENCE_DIR

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


IMPORTS_NO_HARNESS = (
    "import sys, aiogguf, aiogguf.cli\n"
    "aiogguf.cli.build_parser()\n"
    "loaded = sorted(m for m in sys.modules if m == 'gguf' or m.startswith(('gguf.',"
    " 'aiogguf.testing')))\n"
    "print(loaded)\n"
)
COMMANDS_NEEDING_GGUF = ("demo", "bench")
INSPECTED = REFERENCE_DIR / "tiny-llama-F16.gguf"

Run = tuple[Path, subprocess.CompletedProcess[str]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """Each child of this module's tests, in processes side by side (each waits mostly
    for its interpreter to start), in a folder of its own: name → (folder, process)."""

    def imports(cwd: Path) -> subprocess.CompletedProcess[str]:
        return _python(IMPORTS_NO_HARNESS, cwd)

    def command(name: str) -> Callable[[Path], subprocess.CompletedProcess[str]]:
        return lambda cwd: _cli_without_gguf(cwd, name, "--size", "1MiB", "--dir", str(cwd))

    def inspect(cwd: Path) -> subprocess.CompletedProcess[str]:
        return _cli_without_gguf(cwd, "inspect", "--json", str(INSPECTED))

    children = {"imports": imports, **{name: command(name) for name in COMMANDS_NEEDING_GGUF}}
    if INSPECTED.is_file():  # else its test skips (or fails under CI) on reference_dir
        children["inspect"] = inspect

    def run(name: str) -> Run:
        cwd = tmp_path_factory.mktemp(name)
        return cwd, children[name](cwd)

    with ThreadPoolExecutor(max_workers=len(children)) as pool:
        return dict(zip(children, pool.map(run, children), strict=True))


def test_importing_the_loader_and_the_cli_imports_no_harness(runs: dict[str, Run]) -> None:
    _, done = runs["imports"]
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("command", COMMANDS_NEEDING_GGUF)
def test_without_gguf_the_command_names_the_extra(runs: dict[str, Run], command: str) -> None:
    folder, done = runs[command]
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"aiogguf {command}: ")
    assert "pip install 'aiogguf[demo]'" in lines[0]
    assert not list(folder.glob("**/*.gguf"))  # failed before writing anything


def test_without_gguf_inspect_still_reads_a_file(reference_dir: Path, runs: dict[str, Run]) -> None:
    assert reference_dir / "tiny-llama-F16.gguf" == INSPECTED
    _, done = runs["inspect"]
    assert done.returncode == 0, done.stderr
    assert '"tensors"' in done.stdout


def test_the_settle_default_is_the_harness_pause() -> None:
    # The CLI restates SETTLE_S so that building its parser imports no harness.
    assert SETTLE_DEFAULT_S == SETTLE_S
    bench = build_parser().parse_args(["bench"])
    assert bench.settle == SETTLE_S
