"""The GPU benchmark harness (``bench/gpu_driver.py``, ``bench/gpu_check.py``), which runs
once on a real GPU and must be right the first time: its subprocess driver records every
step (a failed one included) and its byte verification names a mismatching tensor."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from aiogguf.io._devices.cupy_backend import cupy_devices
from aiogguf.testing.synth import SynthModel, write_synthetic_model

BENCH = Path(__file__).resolve().parent.parent / "bench"
STAND_INS = Path(__file__).resolve().parent / "stand_ins"
MiB = 1024**2


def _module(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def driver() -> ModuleType:
    return _module("gpu_driver")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> SynthModel:
    path = tmp_path_factory.mktemp("bench") / "m.gguf"
    return write_synthetic_model(path, size_bytes="2MiB", seed=4, n_layer=2)


def test_fingerprint_sees_a_moved_word(driver: ModuleType) -> None:
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 1000, dtype=np.uint8)
    swapped = data.copy()
    swapped[:8], swapped[8:16] = data[8:16], data[:8]  # same words, other places
    tail = data.copy()
    tail[-1] ^= 1  # in the 8 bytes' remainder
    base = driver.fingerprint(np, data)
    assert base == driver.fingerprint(np, data.copy())
    assert base != driver.fingerprint(np, swapped)
    assert base != driver.fingerprint(np, tail)


def test_driver_records_every_step_and_names_a_mismatch(
    driver: ModuleType, model: SynthModel, tmp_path: Path
) -> None:
    mm = np.memmap(model.path, dtype=np.uint8, mode="r")
    expected = {
        t.name: driver.fingerprint(np, mm[t.file_offset : t.file_offset + t.nbytes])
        for t in model.tensors
    }
    wrong = model.tensors[-1].name
    expected[wrong] += 1
    fingerprints = tmp_path / "fp.json"
    fingerprints.write_text(json.dumps({k: str(v) for k, v in expected.items()}))
    host = {"mode": "none", "n_gpu_layers": 0}
    task = {
        "path": str(model.path),
        "expected": str(fingerprints),
        "steps": [
            {"op": "load", "overrides": {"mode": "teleport"}, "label": "bad config"},
            {"op": "load", "overrides": host, "verify": True, "label": "host"},
            {"op": "load", "overrides": {**host, "check_tensors": False}, "label": "no check"},
        ],
    }
    result = driver.run_driver(task, timeout_s=120)
    assert result["error"] is None, result["stderr_tail"]
    steps = result["steps"]
    assert [s["op"] for s in steps] == ["start", "load", "load", "load", "end"]
    bad, checked, unchecked = steps[1:4]
    assert not bad["ok"]
    assert "teleport" in bad["error"]
    assert checked["ok"], checked.get("error")
    assert checked["verified"]["mismatched"] == [wrong]
    assert not checked["verified"]["ok"]
    assert checked["report"]["nbytes"] == model.tensor_bytes
    assert checked["report"]["device_bytes"] == 0
    assert checked["lag_ms"]["samples"] > 0
    assert unchecked["report"]["validated"] == 0
    summary = driver.summarise([bad, checked, unchecked])
    assert (summary["runs"], summary["ok_runs"]) == (3, 2)
    assert summary["gbps"] is not None


def test_driver_keeps_what_finished_when_killed(driver: ModuleType, model: SynthModel) -> None:
    steps = [
        {"op": "load", "overrides": {"mode": "none", "n_gpu_layers": 0}},
        {"op": "sleep", "seconds": 600},
    ]
    # The kill must come after the load step is printed: a short limit first, a longer
    # one only if the interpreter had not got that far (a busy machine).
    for timeout_s in (1, 3, 10, 30):
        result = driver.run_driver({"path": str(model.path), "steps": steps}, timeout_s=timeout_s)
        if len(result["steps"]) >= 2:
            break
    assert result["error"] is not None
    assert "timed out" in result["error"]
    # The lines printed before the kill are kept.
    assert [s["op"] for s in result["steps"]] == ["start", "load"]
    assert result["steps"][1]["ok"]


def test_gpu_check_without_a_gpu_says_so(tmp_path: Path) -> None:
    if cupy_devices():
        pytest.skip("a CUDA device is visible: gpu_check.py would run for minutes")
    out = tmp_path / "out.json"
    script = str(BENCH / "gpu_check.py")
    proc = subprocess.run(
        [sys.executable, script, "--quick", "--dir", str(tmp_path), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "needs CuPy and a CUDA device" in proc.stderr
    assert json.loads(out.read_text())["exit_status"] == 2
    assert json.loads(proc.stdout)["error"].startswith("needs CuPy and a CUDA device")


def test_gpu_check_runs_through_on_the_cupy_stand_in(tmp_path: Path) -> None:
    # Every phase on CuPy's names over host memory: a mistake in the script shows up
    # here, not in the few minutes a GPU is lent for. A 96 MiB model and two transfer
    # threads, so that the loads reuse their slots, as they do on a GPU.
    out = tmp_path / "out.json"
    script = str(BENCH / "gpu_check.py")
    args = ["--quick", "--size", "192MiB", "--threads", "2"]
    args += ["--dir", str(tmp_path), "--json", str(out)]
    proc = subprocess.run(
        [sys.executable, script, *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "PYTHONPATH": str(STAND_INS)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["errors"] == []
    assert result["cupy"] == "0.0+stand-in"
    assert result["pinned_copy"]["gbps"] > 0
    assert result["raw_pipeline"]["by_threads"]
    verified = result["verification"]
    assert verified["ok"]
    labels = {load["label"] for load in verified["loads"]}
    assert {"before_warm_up", "after_warm_up"} <= labels
    for load in verified["loads"]:
        assert load["mismatched"] == []
        # Every tensor but the token embeddings (kept on the CPU, as llama.cpp does).
        assert load["tensors_on_gpu"] == load["tensors"] - 1
    assert result["api_missing"] == []
    # Each slot size ran after a warm_up that filled a pool sized for 2 threads x 2 slots.
    warm = result["warm_loads"]
    assert all(gbps is not None for gbps in warm["slot_sizes"].values()), warm["slot_sizes"]
    assert warm["slot_pool_bytes"] == {"16MiB": 64 * MiB, "32MiB": 128 * MiB, "64MiB": 256 * MiB}
    # What every timed load pinned and allocated is reported; after warm_up, nothing.
    pinned = result["pinned"]
    assert pinned["before_warm_up"]["pinned"][0] > 0
    assert pinned["before_warm_up"]["device_allocated"][0] > 0
    assert pinned["after_warm_up"]["pinned"] == [0]
    for label in ("check_on", "check_off", "slot_16MiB", "slot_32MiB", "slot_64MiB"):
        assert set(pinned[label]["pinned"]) == {0}, (label, pinned[label])
        assert set(pinned[label]["device_allocated"]) == {0}, (label, pinned[label])
    # Two transfer threads, two slots each, and more copies than slots: slots reused.
    (upload,) = warm["check_on"]["uploads"][0]
    assert upload["slots"] == 4
    assert upload["copies"] > upload["slots"]
    # Every target is judged (on a CPU most are missed: what counts is that none is
    # left without a figure).
    targets = result["targets"]
    assert targets["every verified byte matched the file"]["met"] is True
    assert targets["bytes pinned inside timed loads after warm_up = 0"]["met"] is True
    name = "device bytes allocated by timed loads of a model loaded before = 0"
    assert targets[name]["met"] is True
    assert all(t["met"] is not None for t in targets.values())
    assert all(t["value"] is not None for name, t in targets.items() if "byte" not in name)


def test_gpu_check_thread_counts() -> None:
    counts = _module("gpu_check").thread_counts
    assert counts(1) == [1]
    assert counts(2) == [1, 2]
    assert counts(12) == [1, 2, 4, 8, 12]
    assert counts(16) == [1, 2, 4, 8, 16]
    assert counts(64) == [1, 2, 4, 8, 16]
