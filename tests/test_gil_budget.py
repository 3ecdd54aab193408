"""bench/gil_budget.py: how py-spy's samples are sorted (what is counted, what is not),
and a whole quick run's output."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_gil_budget", BENCH / "gil_budget.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _quick_run(folder: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], Any]:
    """``gil_budget.py --quick [args]``: the process and its JSON."""
    out = folder / "out.json"
    proc = subprocess.run(
        [
            *(sys.executable, "-P", str(BENCH / "gil_budget.py"), "--quick", *args),
            *("--dir", str(folder), "--json", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc, json.loads(out.read_text())


BOOT = "Thread._bootstrap (threading.py:1002);Thread.run (threading.py:982)"
RAW = "\n".join(
    [
        # The spinner: never counted.
        f"thread (11): Thread-1 (_spinner_loop);{BOOT};_spinner_loop (gil_budget.py:80) 500",
        # The sim's copy engine and its copy queue: excluded, by name.
        f"thread (12): aiogguf-sim-copy-g0;{BOOT};SimCopyStream._run (sim.py:744) 7",
        f"thread (13): aiogguf-transfer-0;{BOOT};_TransferLane.stage (upload.py:192);"
        "SimCopyStream.copy_async (sim.py:641);_fingerprint (sim.py:509) 5",
        # The load's own: counted, by innermost function and thread.
        f"thread (13): aiogguf-transfer-0;{BOOT};_TransferLane.stage (upload.py:178);"
        "DataFile._pread_loop (aiogguf/io/files.py:397) 9",
        f"thread (14): aiogguf-reader-1;{BOOT};_Screen.clear (aiogguf/checks.py:146) 4",
        f"thread (14): aiogguf-reader-1;{BOOT};_Screen.clear (aiogguf/checks.py:151) 2",
        "thread (10): MainThread;<module> (x.py:1);BaseEventLoop._run_once (base_events.py:1) 3",
        # The load's one-off front: counted, and counted apart too.
        f"thread (15): aiogguf-load-0;{BOOT};Front.parse_and_plan (front.py:78);"
        "make_plan (aiogguf/stages/plan.py:380) 4",
        "not a sample line",
    ]
)


def test_samples_are_sorted_into_spinner_excluded_and_counted() -> None:
    gil = _module()
    s = gil.count_samples(RAW)
    assert s["total"] == 500 + 7 + 5 + 9 + 4 + 2 + 3 + 4
    assert s["spinner"] == 500
    assert s["excluded"] == {"SimCopyStream._run": 7, "SimCopyStream.copy_async": 5}
    assert s["counted"] == 22
    assert s["front"] == 4
    # Lines of one function are summed; the most frequent first.
    assert s["functions"][0] == ("DataFile._pread_loop (files.py)", 9)
    assert ("_Screen.clear (checks.py)", 6) in s["functions"]
    assert dict(s["threads"]) == {
        "aiogguf-transfer": 9,
        "aiogguf-reader": 6,
        "aiogguf-load": 4,
        "MainThread": 3,
    }


@pytest.mark.slow
def test_quick_run_prints_every_case(tmp_path: Path) -> None:
    spy = Path(sys.executable).parent / "py-spy"
    if not spy.exists() and shutil.which("py-spy") is None:
        pytest.skip("py-spy is not installed (the dev and bench extras have it)")
    proc, result = _quick_run(tmp_path)
    assert json.loads(proc.stdout) == result
    gil = _module()
    assert [c["case"] for c in result["cases"]] == list(gil.CASES)
    for case in result["cases"]:
        assert case["gb_loaded"] > 0
        assert case["samples"]["spinner"] > 0  # the spinner ran beside the loads
        assert case["gil_ms_per_gb"] >= 0
        assert case["front_ms_per_load"] >= 0
        assert case["rest_ms_per_gb"] <= case["gil_ms_per_gb"]
        assert case["target_ms_per_gb"] in (gil.TARGET_ON_MS, gil.TARGET_OFF_MS)
        assert isinstance(case["met"], bool)
        assert all(len(row) == 2 for row in case["samples"]["functions"])
    assert "ceiling GB/s" in proc.stderr  # the table
    assert "host_none_checks_off" in proc.stderr


@pytest.mark.slow
def test_quick_convoy_reports_each_way_of_loading(tmp_path: Path) -> None:
    proc, result = _quick_run(tmp_path, "--convoy")
    assert [c["overrides"]["check_tensors"] for c in result["convoy"]] == [True, False]
    for c in result["convoy"]:
        # One load each way per run: alone, beside a busy thread, beside a busy process.
        assert len(c["alone_s"]) == len(c["busy_s"]) == len(c["process_s"]) == 1
        assert c["ratio"] == pytest.approx(c["busy_median_s"] / c["alone_median_s"])
        assert c["gil_ratio"] == pytest.approx(c["busy_median_s"] / c["process_median_s"])
        assert c["switch_s"] == pytest.approx(0.005)  # CPython's default, left alone
        assert c["met"] == (c["ratio"] <= 3.0)
    assert "so the GIL's part is" in proc.stderr


def _round(gil_ms: float, front_ms: float) -> dict[str, Any]:
    return {"case": "c", "overrides": {}, "gil_ms_per_gb": gil_ms, "front_ms_per_load": front_ms}


def test_rounds_report_the_median_round_with_every_figure() -> None:
    gil = _module()
    rounds = [_round(9.0, 1.0), _round(5.0, 2.0), _round(7.0, 3.0)]
    median = gil.median_rounds("c", rounds)
    # The median round whole (its front too), not a mix of rounds.
    assert (median["gil_ms_per_gb"], median["front_ms_per_load"]) == (7.0, 3.0)
    assert median["rounds_ms_per_gb"] == [9.0, 5.0, 7.0]
    assert median["rounds_front_ms_per_load"] == [1.0, 2.0, 3.0]
    assert gil.median_rounds("c", rounds[:2])["gil_ms_per_gb"] == 5.0  # the lower of two
    failed = gil.median_rounds("c", [*rounds, {"case": "c", "overrides": {}, "error": "E: x"}])
    assert failed["error"] == "E: x"
    assert "gil_ms_per_gb" not in failed


@pytest.mark.slow
def test_quick_rounds_rotate_the_cases(tmp_path: Path) -> None:
    spy = Path(sys.executable).parent / "py-spy"
    if not spy.exists() and shutil.which("py-spy") is None:
        pytest.skip("py-spy is not installed (the dev and bench extras have it)")
    cases = "host_none_checks_on,host_none_checks_off"
    proc, result = _quick_run(tmp_path, "--rounds", "2", "--cases", cases)
    started = [line for line in proc.stderr.splitlines() if line.startswith("round ")]
    assert started == [
        "round 1: host_none_checks_on ...",
        "round 1: host_none_checks_off ...",
        "round 2: host_none_checks_off ...",
        "round 2: host_none_checks_on ...",
    ]
    assert result["rounds"] == 2
    for case in result["cases"]:
        assert len(case["rounds_ms_per_gb"]) == 2
        assert case["gil_ms_per_gb"] == min(case["rounds_ms_per_gb"])  # the lower median
    assert "the median of 2 rounds" in proc.stderr
