"""``AIOGGUF_TESTDATA`` names the folder of reference files the tests read."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# A test that reads a reference file in this process: the child pytest runs only it, and
# without the hypothesis plugin (which it does not use and which takes longest to import).
ONE_REFERENCE_TEST = "tests/test_inspect_cli.py::test_readable_summary"


def _start_pytest(env_update: dict[str, str]) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("AIOGGUF_TESTDATA", "CI")}
    env.update(env_update)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:hypothesispytest",
            "-rs",
            ONE_REFERENCE_TEST,
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return proc.returncode, out, err


def test_the_variable_moves_the_reference_folder(tmp_path: Path) -> None:
    empty = tmp_path / "no-reference-here"
    empty.mkdir()
    # The two runs are independent: side by side.
    skipping = _start_pytest({"AIOGGUF_TESTDATA": str(empty)})
    failing = _start_pytest({"AIOGGUF_TESTDATA": str(empty), "CI": "true"})
    status, out, err = _finish(skipping)
    assert status == 0, out + err
    assert "1 skipped" in out
    assert str(empty) in out  # the skip names the folder it looked in
    status, out, err = _finish(failing)
    assert status == 1, out + err
    assert "CI=true" in out


def test_the_variable_finds_files_elsewhere(reference_dir: Path, tmp_path: Path) -> None:
    # The same files under another name: found only through the variable.
    elsewhere = tmp_path / "copied-reference"
    elsewhere.symlink_to(reference_dir, target_is_directory=True)
    status, out, err = _finish(_start_pytest({"AIOGGUF_TESTDATA": str(elsewhere)}))
    assert status == 0, out + err
    assert "1 passed" in out
