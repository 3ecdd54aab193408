"""Shared fixtures. ``reference_dir`` is llama.cpp's own files: the folder named by
``AIOGGUF_TESTDATA`` when it is set, else ../shared/testdata/reference next to the
repository. Missing on a developer's machine (a fresh clone) they skip, missing under CI
they fail. A test that reads them takes the ``reference_dir`` fixture (directly or
through ``manifest``), never ``REFERENCE_DIR`` alone: ``.ci/run`` runs every module that
names them once with the folder hidden, and fails if any of them fails."""

from __future__ import annotations

import gc
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from aiogguf.io._devices.cupy_backend import forget_cupy_devices
from aiogguf.io._devices.pool import close_staging_pools
from aiogguf.io.pagecache import drop_from_cache

# Fixtures shared by several modules, kept beside the helpers they go with.
pytest_plugins = ["hub_helpers"]

ROOT = Path(__file__).resolve().parent.parent
# How many examples the expensive property tests (a forked reader or a whole load per
# example) run: fewer in a development run, the full count in CI (.ci/run sets "ci"),
# ten times that for a hunt ("thorough").
HYPOTHESIS_PROFILE = os.environ.get("AIOGGUF_HYPOTHESIS_PROFILE", "default")
if HYPOTHESIS_PROFILE not in ("default", "ci", "thorough"):
    raise pytest.UsageError(
        f"AIOGGUF_HYPOTHESIS_PROFILE={HYPOTHESIS_PROFILE!r}: expected default, ci or thorough"
    )
REFERENCE_DIR = Path(
    os.environ.get("AIOGGUF_TESTDATA") or ROOT.parent / "shared" / "testdata" / "reference"
).resolve()


@pytest.fixture(autouse=True)
def _fresh_process_state() -> Iterator[None]:
    """Each test starts as a fresh process would: no staging pool, no cached GPU
    discovery (tests fake CuPy), and leaves none behind."""
    forget_cupy_devices()
    close_staging_pools()
    yield
    close_staging_pools()
    forget_cupy_devices()


@pytest.fixture(scope="session")
def _hub_caches(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hub-caches")


@pytest.fixture(autouse=True)
def _own_hub_cache(
    _hub_caches: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """hf:// loads read and write the hub's cache: each test has its own (made when
    first written), never the user's."""
    monkeypatch.setenv("HF_HUB_CACHE", str(_hub_caches / f"{id(request.node):x}"))


@pytest.fixture(scope="module", autouse=True)
def _freeze_what_came_before() -> None:
    """Collect, then move what is left (modules, strategies, earlier modules' caches) out
    of the garbage collector's reach. A failed load runs a full collection to free what
    cancelled tasks hold; in this process each would otherwise walk everything the suite
    has built so far. What a test makes is still collected, and a check that must see
    every object calls ``gc.unfreeze()`` first."""
    gc.collect()
    gc.freeze()


def reference_present() -> bool:
    """Whether the reference files are there (their MANIFEST.json is)."""
    return (REFERENCE_DIR / "MANIFEST.json").is_file()


def _require_reference() -> Path:
    if reference_present():
        return REFERENCE_DIR
    message = f"reference GGUF files not found at {REFERENCE_DIR}"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message + " (CI=true: they must be there)")
    pytest.skip(message)


@pytest.fixture(scope="session")
def reference_dir() -> Path:
    return _require_reference()


@pytest.fixture(scope="session")
def manifest(reference_dir: Path) -> list[dict[str, Any]]:
    data: list[dict[str, Any]] = json.loads((reference_dir / "MANIFEST.json").read_text())
    return data


def examples(default: int, ci: int) -> int:
    """``max_examples`` for an expensive property test, by ``AIOGGUF_HYPOTHESIS_PROFILE``:
    ``default`` in a development run, ``ci`` in CI, ten times ``ci`` when thorough."""
    return {"default": default, "ci": ci, "thorough": 10 * ci}[HYPOTHESIS_PROFILE]


def reference_files() -> list[str]:
    """Names of the reference .gguf files, for parametrising; ``["<missing>"]`` when they
    are absent, so that the test is collected and its ``reference_dir`` skips (or fails
    under CI) saying where it looked."""
    if not reference_present():
        return ["<missing>"]
    return sorted(p.name for p in REFERENCE_DIR.glob("*.gguf"))


@pytest.fixture
def disk_dir(tmp_path: Path) -> Iterator[Path]:
    """A folder whose files can leave the page cache (and take O_DIRECT): ``tmp_path``
    unless that lives in memory (tmpfs), else a temporary folder in /var/tmp."""
    for directory in (tmp_path, None):
        own = directory is None
        folder = Path(tempfile.mkdtemp(prefix="aiogguf-test-", dir="/var/tmp")) if own else tmp_path
        probe = folder / "probe.bin"
        probe.write_bytes(b"x" * 65536)
        droppable = drop_from_cache(probe)
        probe.unlink()
        if droppable:
            try:
                yield folder
            finally:
                if own:
                    shutil.rmtree(folder, ignore_errors=True)
            return
        if own:
            shutil.rmtree(folder, ignore_errors=True)
    pytest.skip("no folder here lets pages leave the page cache (all tmpfs?)")
