"""A process's first use, as the README's example makes it: ``import aiogguf`` alone, then
``async with aiogguf.load(...)`` inside a running loop. Nothing may be imported on the
loop's thread during a load (issue 23: the loader itself was, 272-285 ms of lag), CuPy
included, and the loop must stay responsive. Each case runs in a fresh interpreter
(``first_use_worker.py``), whose import hook records the thread of every import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from aiogguf.testing.synth import SynthModel, write_synthetic_model

WORKER = Path(__file__).with_name("first_use_worker.py")
STAND_INS = Path(__file__).resolve().parent / "stand_ins"
SIM_OFFLOAD: dict[str, Any] = {"mode": "none", "n_gpu_layers": -1, "sim_gpus": ["1GiB"]}
HOST: dict[str, Any] = {"mode": "none", "n_gpu_layers": 0}
# CuPy's import takes about a second on a GPU host; the stand-in's sleeps this long.
CUPY_IMPORT_S = 0.5
# Issue 23's must-show: a first load after ``import aiogguf`` alone, with a slow CuPy.
FIRST_LOAD_LAG_MS = 20.0


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> SynthModel:
    path = tmp_path_factory.mktemp("first-use") / "m.gguf"
    return write_synthetic_model(path, size_bytes="2MiB", seed=4, n_layer=2)


# Optional parts that ``import aiogguf`` must leave out: each is heavy, or an extra.
OPTIONAL = (
    "aiogguf.server",
    "aiogguf.cli",
    "aiogguf.testing",
    "aiohttp",
    "cupy",
    "gguf",
    "matplotlib",
    "rich",
    "uvloop",
)


def _run(task: dict[str, Any], *, slow_cupy: bool = False) -> dict[str, Any]:
    """Run the worker on ``task`` in a fresh interpreter; its JSON answer. With
    ``slow_cupy`` the CuPy stand-in is importable as ``cupy`` and sleeps on import;
    without it no ``cupy`` is importable (the test machine has none)."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if slow_cupy:
        env["PYTHONPATH"] = str(STAND_INS)
        env["STAND_IN_CUPY_IMPORT_S"] = str(CUPY_IMPORT_S)
        # What is measured here is where the import runs. CUDA's start-up, which the
        # stand-in models too (0.33 s with the GIL held, as on a GPU host), stalls any
        # loop of the process whichever thread runs it: that is what ``warm_up`` is for
        # (tests/test_first_gpu_load.py shows that it holds the GIL).
        env["STAND_IN_CUPY_INIT_S"] = env["STAND_IN_CUPY_CONTEXT_S"] = "0"
    # -P and a neutral folder: the repository root holds a folder named io.
    proc = subprocess.run(
        [sys.executable, "-P", str(WORKER), json.dumps(task)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(task["path"]).parent,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    answer: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return answer


def test_import_brings_the_loader_and_leaves_the_optional_parts_out() -> None:
    code = (
        "import json, sys, aiogguf; "
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('aiogguf.') or "
        "m.split('.')[0] in sys.argv[1:])))"
    )
    out = subprocess.run(
        [sys.executable, "-P", "-c", code, *OPTIONAL],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    imported = set(json.loads(out.stdout))
    assert {"aiogguf.api", "aiogguf.engine", "aiogguf.model", "aiogguf.config"} <= imported
    left_in = {m for m in imported for part in OPTIONAL if m == part or m.startswith(part + ".")}
    assert left_in == set()


@pytest.mark.parametrize("overrides", [HOST, SIM_OFFLOAD], ids=["host", "sim_offload"])
def test_loads_import_nothing_on_the_loop(model: SynthModel, overrides: dict[str, Any]) -> None:
    """``import aiogguf`` brings what a load needs: the first load of the process and the
    next one import no module at all on the loop's thread (the hook would see it)."""
    answer = _run({"path": str(model.path), "overrides": overrides, "loads": 2})
    first, second = answer["loads"]
    assert first["tensors"] == second["tensors"] == len(model.tensors)
    assert first["imported_on_loop"] == []
    assert second["imported_on_loop"] == []
    if "sim_gpus" not in overrides:
        # The hook sees imports: without simulated devices, the first load looks for CuPy
        # (not installed here) on its own thread.
        assert "cupy" in first["imported_elsewhere"]


def test_slow_cupy_is_imported_off_the_loop(model: SynthModel) -> None:
    """Finding the GPUs imports CuPy, which takes a second on a GPU host: on the load's
    thread, never the loop's."""
    answer = _run({"path": str(model.path), "overrides": {"mode": "none"}}, slow_cupy=True)
    (first,) = answer["loads"]
    assert "cupy" in first["imported_elsewhere"]
    assert first["imported_on_loop"] == []
    assert first["seconds"] >= CUPY_IMPORT_S  # the load did wait for the import


@pytest.mark.timing
def test_first_load_with_a_slow_cupy_keeps_the_loop_responsive(model: SynthModel) -> None:
    """Issue 23's must-show: worst lag under 20 ms during a fresh process's first load
    after ``import aiogguf`` alone, while CuPy's import sleeps."""
    answer = _run({"path": str(model.path), "overrides": {"mode": "none"}}, slow_cupy=True)
    (first,) = answer["loads"]
    assert first["ticks"] > 100  # the ticker ran through the import
    assert first["lag_max_ms"] < FIRST_LOAD_LAG_MS, first
