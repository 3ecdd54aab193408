"""What the command line imports (issue 39): ``aiogguf inspect`` starts as fast as gguf-py's
``gguf-dump``, because the console script's entry (``aiogguf_entry``) asks the package for
its re-exports on demand and the CLI imports only the command it runs; a library's
``import aiogguf`` still imports the loader (``test_first_use`` shows why). Each process
here is fresh: what a process imports is the whole point."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

# Modules ``aiogguf inspect`` of a local file has no use for: the loader and its config
# (pydantic), the event loop, the wings, and the other commands.
NOT_FOR_INSPECT = (
    "aiogguf._api",
    "aiogguf._config",
    "aiogguf._core",
    "aiogguf._dry_run",
    "aiogguf._model",
    "aiogguf._jobs",
    "aiogguf.remote",
    "aiogguf.integrity",
    "aiogguf.server",
    "aiogguf.testing",
    "aiogguf.stages.read",
    "aiogguf.cli.load",
    "aiogguf.cli.serve",
    "aiogguf.cli.bench",
    "asyncio",
    "pydantic",
    "rich",
    "importlib.metadata",
)

# Run as the console script runs: ``from aiogguf_entry import main``; then the list of
# modules the process imported, on stderr's last line (``--help`` exits inside ``main``).
CONSOLE = (
    "import json, sys\n"
    "from aiogguf_entry import main\n"
    "sys.argv = ['aiogguf', *sys.argv[1:]]\n"
    "try:\n"
    "    sys.exit(main())\n"
    "finally:\n"
    "    print(json.dumps(sorted(sys.modules)), file=sys.stderr)\n"
)


def _console(*args: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    done = subprocess.run(
        [sys.executable, "-P", "-c", CONSOLE, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    modules = set(json.loads(done.stderr.strip().splitlines()[-1]))
    return done, modules


def _under(modules: set[str], prefixes: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if any(m == p or m.startswith(p + ".") for p in prefixes))


def test_inspect_imports_only_what_it_needs(reference_dir: Path) -> None:
    done, modules = _console("inspect", str(reference_dir / "tiny-llama-Q4_K_M.gguf"))
    assert done.returncode == 0, done.stderr
    assert "39 tensors" in done.stdout
    assert "aiogguf.cli.inspect" in modules  # the walk saw the command run
    assert "aiogguf.stages.parse" in modules
    assert _under(modules, NOT_FOR_INSPECT) == []


def test_inspect_json_of_a_split_set_goes_through_the_loader(reference_dir: Path) -> None:
    """A split set is parsed concurrently by ``aiogguf.inspect_sync``: imported then."""
    first = reference_dir / "tiny-llama-Q4_K_M-split-00001-of-00003.gguf"
    done, modules = _console("inspect", "--json", str(first))
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["files"]) == 3
    assert "aiogguf._dry_run" in modules


def test_help_imports_no_command() -> None:
    done, modules = _console("--help")
    assert done.returncode == 0
    for name in ("inspect", "load", "serve", "bench"):
        assert name in done.stdout  # every command listed, with its help line
    assert _under(modules, ("aiogguf.cli.inspect", "aiogguf.cli.load", "aiogguf._api")) == []


def test_a_command_s_help_builds_its_flags(reference_dir: Path) -> None:
    done, modules = _console("load", "--help")
    assert done.returncode == 0
    assert "--mode" in done.stdout
    assert "aiogguf.cli.load" in modules
    assert "aiogguf.cli.inspect" not in modules


def test_version_is_looked_up_when_asked() -> None:
    done, _ = _console("--version")
    assert done.returncode == 0
    assert done.stdout.startswith("aiogguf ")


def test_the_library_import_still_imports_the_loader() -> None:
    """``import aiogguf`` outside the console script: every re-export resolved at import."""
    code = (
        "import sys, aiogguf\n"
        "assert 'load' in vars(aiogguf) and 'Config' in vars(aiogguf)\n"
        "assert 'Manifest' not in vars(aiogguf)\n"  # the integrity wing: on first use
        "print(int('aiogguf._api' in sys.modules), int('aiogguf.integrity' in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "0"]


def _bench() -> ModuleType:
    path = Path(__file__).resolve().parent.parent / "bench" / "cli_start.py"
    spec = importlib.util.spec_from_file_location("bench_cli_start", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timing
def test_inspect_starts_within_1_2x_of_gguf_dump(reference_dir: Path) -> None:
    pytest.importorskip("gguf")
    result = _bench().measure(str(reference_dir / "tiny-llama-Q4_K_M.gguf"), runs=10)
    assert result["ratio_wall"] <= 1.2, result
