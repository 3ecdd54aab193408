"""The folders ``pipeline/``, ``stages/`` and ``io/`` are the packages ``aiogguf``,
``aiogguf.stages`` and ``aiogguf.io``, and only that: imported by a folder's name (from
the repository root, where ``sys.path`` starts with it) they refuse with an
``ImportError`` that says how to import them, and ``io`` stays the standard library's."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run_at_root(code: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("module", "package"),
    [
        ("stages.parse", "aiogguf.stages"),
        ("stages", "aiogguf.stages"),
        ("pipeline.records", "aiogguf"),
        ("pipeline.cli", "aiogguf"),
    ],
)
def test_a_folder_imported_by_its_name_says_how_to_import_it(module: str, package: str) -> None:
    result = _run_at_root(f"import {module}")
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError:"), result.stderr
    assert f"import it as '{package}'" in last
    assert "editable_mode=strict" in last


def test_io_stays_the_standard_library_at_the_root() -> None:
    result = _run_at_root(
        "import io, sys\n"
        "assert io.open is open, io\n"
        "try:\n"
        "    import io.files\n"
        "except ImportError:\n"
        "    pass\n"
        "else:\n"
        "    sys.exit('io.files imported as a top-level module')\n"
    )
    assert result.returncode == 0, result.stderr


def test_the_package_imports_by_its_own_names() -> None:
    import aiogguf._records
    import aiogguf.io.files
    import aiogguf.stages.parse

    assert aiogguf.stages.parse.__name__ == "aiogguf.stages.parse"
    assert aiogguf._records.ParsedFile.__module__ == "aiogguf._records"
    assert aiogguf.io.files.__name__ == "aiogguf.io.files"


def _commands(name: str) -> list[str]:
    """The shell lines of ``name``: .ci/run whole, the README's ```sh blocks."""
    text = (ROOT / name).read_text(encoding="utf-8")
    if name.endswith(".md"):
        text = "\n".join(re.findall(r"```sh\n(.*?)```", text, flags=re.DOTALL))
    return text.splitlines()


@pytest.mark.parametrize("name", ["README.md", ".ci/run"])
def test_every_editable_install_is_one_type_checkers_resolve(name: str) -> None:
    """An editable install in strict mode is a tree of links named as the package, which
    pyright and IDEs resolve; a lenient one hides the mapping in an import hook."""
    installs = [line for line in _commands(name) if "pip install" in line and " -e " in line]
    assert installs, f"{name} installs nothing"
    for line in installs:
        assert "--config-settings editable_mode=strict" in line, f"{name}: {line}"
