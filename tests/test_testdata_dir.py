"""``AIOGGUF_TESTDATA`` names the folder of reference files the tests read."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REFERENCE_DIR

ROOT = Path(__file__).resolve().parent.parent
# A test that reads a reference file in this process: the child pytest runs only it, and
# without the hypothesis plugin (which it does not use and which takes longest to import).
ONE_REFERENCE_TEST = "tests/test_inspect_cli.py::test_readable_summary"
# Tests that read the reference files without asking for them once (a fresh clone, with
# no ../shared, failed them): run with the folder hidden, they skip. .ci/run runs every
# module that names the files that way.
HIDDEN_TESTS = (
    "tests/test_llama_hash.py::test_agrees_with_gguf_py_on_every_reference_file",
    "tests/test_bounds_property.py::test_mutated_files_parse_index_and_plan_within_bounds",
    "tests/test_bounds_property.py::test_the_mutations_reach_every_count_and_length",
)

Finished = tuple[int, str, str]  # exit status, stdout, stderr


def _start_pytest(
    env_update: dict[str, str], basetemp: Path, tests: tuple[str, ...] = (ONE_REFERENCE_TEST,)
) -> subprocess.Popen[str]:
    # Without the hypothesis plugin where no test uses it: it takes longest to import.
    uses_hypothesis = any("bounds_property" in test for test in tests)
    plugins = [] if uses_hypothesis else ["-p", "no:hypothesispytest"]
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
            *plugins,
            "-rs",
            # A folder of its own: children that share pytest's numbered temporary
            # folders clean up each other's while scanning them, and the scan's
            # abandoned iterator is a warning that fails the child.
            f"--basetemp={basetemp}",
            *tests,
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen[str]) -> Finished:
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def children(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Finished]]:
    """The child pytests of this module's tests, side by side (each is independent and
    spends most of its life starting up): name → (the folder named, how it ended)."""
    empty = tmp_path_factory.mktemp("testdata") / "no-reference-here"
    empty.mkdir()
    absent = empty.parent / "not-there"
    folders = {"skipping": empty, "failing": empty, "hidden": empty, "absent": absent}
    envs = {
        "skipping": {"AIOGGUF_TESTDATA": str(empty)},
        "failing": {"AIOGGUF_TESTDATA": str(empty), "CI": "true"},
        "hidden": {"AIOGGUF_TESTDATA": str(empty)},
        "absent": {"AIOGGUF_TESTDATA": str(absent)},
    }
    tests = {"hidden": HIDDEN_TESTS, "absent": HIDDEN_TESTS}
    if REFERENCE_DIR.is_dir():  # else test_the_variable_finds_files_elsewhere skips
        # The same files under another name: found only through the variable.
        elsewhere = tmp_path_factory.mktemp("testdata") / "copied-reference"
        elsewhere.symlink_to(REFERENCE_DIR, target_is_directory=True)
        folders["elsewhere"] = elsewhere
        envs["elsewhere"] = {"AIOGGUF_TESTDATA": str(elsewhere)}
    started = {
        name: _start_pytest(
            env, tmp_path_factory.mktemp(f"child-{name}"), tests.get(name, (ONE_REFERENCE_TEST,))
        )
        for name, env in envs.items()
    }
    return {name: (folders[name], _finish(proc)) for name, proc in started.items()}


def test_the_variable_moves_the_reference_folder(
    children: dict[str, tuple[Path, Finished]],
) -> None:
    empty, (status, out, err) = children["skipping"]
    assert status == 0, out + err
    assert "1 skipped" in out
    assert str(empty) in out  # the skip names the folder it looked in
    _, (status, out, err) = children["failing"]
    assert status == 1, out + err
    assert "CI=true" in out


@pytest.mark.parametrize("child", ["hidden", "absent"])
def test_tests_that_read_the_files_skip_without_them(
    child: str, children: dict[str, tuple[Path, Finished]]
) -> None:
    """An empty folder or none at all (a fresh clone): each such test skips, saying where
    it looked; none fails."""
    folder, (status, out, err) = children[child]
    assert status == 0, out + err
    assert f"{len(HIDDEN_TESTS)} skipped" in out, out + err
    assert out.count(f"reference GGUF files not found at {folder}") == len(HIDDEN_TESTS), out


def test_the_variable_finds_files_elsewhere(
    reference_dir: Path, children: dict[str, tuple[Path, Finished]]
) -> None:
    assert reference_dir == REFERENCE_DIR
    _, (status, out, err) = children["elsewhere"]
    assert status == 0, out + err
    assert "1 passed" in out
