"""``AIOGGUF_TESTDATA`` names the folder of reference files the tests read."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ONE_REFERENCE_TEST = "tests/test_inspect_cli.py::test_json_through_a_subprocess"


def _pytest(env_update: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("AIOGGUF_TESTDATA", "CI")}
    env.update(env_update)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", ONE_REFERENCE_TEST],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_variable_moves_the_reference_folder(tmp_path: Path) -> None:
    empty = tmp_path / "no-reference-here"
    empty.mkdir()
    skipped = _pytest({"AIOGGUF_TESTDATA": str(empty)})
    assert skipped.returncode == 0, skipped.stdout + skipped.stderr
    assert "1 skipped" in skipped.stdout
    assert str(empty) in skipped.stdout  # the skip names the folder it looked in
    failed = _pytest({"AIOGGUF_TESTDATA": str(empty), "CI": "true"})
    assert failed.returncode == 1
    assert "CI=true" in failed.stdout


def test_the_variable_finds_files_elsewhere(reference_dir: Path, tmp_path: Path) -> None:
    # The same files under another name: found only through the variable.
    elsewhere = tmp_path / "copied-reference"
    elsewhere.symlink_to(reference_dir, target_is_directory=True)
    passed = _pytest({"AIOGGUF_TESTDATA": str(elsewhere)})
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert "1 passed" in passed.stdout
