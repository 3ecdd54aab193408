"""``aiogguf bench --quick`` end to end on a tiny model: the JSON shape and the plot.

Speed is never asserted here (that is what ``bench/`` is for); only that every point
was measured against a limit from the same run.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from aiogguf.cli import main
from aiogguf.testing.bench import (
    LIMIT_THREADS,
    grid,
    limits_for_mode,
    measure_in_subprocess,
    settle,
)

POINT_KEYS = {
    "mode",
    "chunk_bytes",
    "readers",
    "queue_depth",
    "gbps",
    "runs_gbps",
    "limit",
    "limit_gbps",
    "ratio_to_limit",
    "loop_lag_p99_ms",
    "loop_lag_max_ms",
    "peak_rss_bytes",
    "warnings",
}


# About ten fresh interpreters (limits, points) and a plot: run apart (marker slow).
@pytest.mark.slow
@pytest.mark.timeout(90)
def test_quick_sweep_writes_json_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    status = main(
        [
            "bench",
            "--quick",
            "--size",
            "16MiB",
            "--dir",
            str(tmp_path),
            "--modes",
            "none,mmap",
            "--chunk-sizes",
            "1MiB,4MiB",
            "--json",
            str(out_json),
            "--plot",
            str(out_png),
            "--settle",
            "0",
            "--quiet",
        ]
    )
    assert status == 0
    result: dict[str, Any] = json.loads(out_json.read_text())
    assert result["runs"] == 1
    assert result["cold"] is False
    assert result["cold_drop_ok"] is None
    points = result["points"]
    assert [(p["mode"], p["chunk_bytes"]) for p in points] == [
        ("none", 1 << 20),
        ("none", 4 << 20),
        ("mmap", 1 << 20),
        ("mmap", 4 << 20),
    ]
    assert all(set(p) == POINT_KEYS for p in points)
    # Each point is compared with the fastest of its mode's limits, measured in this run.
    for p in points:
        candidates = limits_for_mode(p["mode"], cold=False, readers=p["readers"])
        assert p["limit"] in candidates
        assert p["limit_gbps"] == max(result["limits"][n] for n in candidates) > 0
        assert p["gbps"] > 0
        assert len(p["runs_gbps"]) == 1
        assert p["peak_rss_bytes"] > 16 << 20  # the whole model was resident at once
    assert {
        "preadv_touched",
        "memcpy",
        "preadv_fresh",
        "preadv_fresh_backed",
        "preadv_fresh_huge",
        "np_memmap_touch",
    } <= set(result["limits"])
    # Which memory each limit filled is said beside it.
    assert "huge-page" in result["limit_notes"]["preadv_fresh_huge"]
    assert "4 KiB-page" in result["limit_notes"]["preadv_fresh"]
    assert "backed in one call first" in result["limit_notes"]["preadv_fresh_backed"]
    assert set(result["best"]) == {"none", "mmap"}
    # A checked mmap load's low ratio is explained, not left to look broken.
    assert any("the checks' price" in note for note in result["notes"])
    pytest.importorskip("matplotlib")
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "best setting per mode" in capsys.readouterr().out


def test_bad_mode_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["bench", "--quick", "--dir", str(tmp_path), "--modes", "none,fast"])
    assert status == 2
    assert "--modes" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # failed before writing a model


def test_grid_groups_points_by_mode() -> None:
    points = grid(["direct", "none"], [1, 2], [1, 2], [8])
    assert [p.mode for p in points] == ["direct"] * 4 + ["none"] * 4
    assert points[0].overrides(False) == {
        "mode": "direct",
        "chunk_size": 1,
        "readers": 1,
        "queue_depth": 8,
        "check_tensors": False,
    }
    assert "check_tensors" not in points[0].overrides(None)


def test_limits_a_mode_is_judged_by() -> None:
    # direct fills fresh memory: O_DIRECT into fresh memory is its limit, the pages
    # faulted in by the read or backed first.
    assert limits_for_mode("direct", cold=True) == ("direct_fresh", "direct_fresh_backed")
    # none: the fastest of 4 KiB and huge pages, faulted in or backed first, on as many
    # threads as it has readers.
    assert limits_for_mode("none", cold=True) == (
        "preadv_fresh_cold",
        "preadv_fresh_backed_cold",
        "preadv_fresh_huge_cold",
        "preadv_fresh_huge_backed_cold",
    )
    assert limits_for_mode("none", cold=False, readers=1) == (
        "preadv_fresh_1t",
        "preadv_fresh_1t_backed",
        "preadv_fresh_1t_huge",
        "preadv_fresh_1t_huge_backed",
    )
    if LIMIT_THREADS > 1:
        assert limits_for_mode("none", cold=False, readers=4) == (
            "preadv_fresh",
            "preadv_fresh_backed",
            "preadv_fresh_huge",
            "preadv_fresh_huge_backed",
        )
    assert limits_for_mode("mmap", cold=False) == ("np_memmap_touch",)


def test_fastest_limit_names_the_winner() -> None:
    from aiogguf.testing.bench import fastest

    limits = {"preadv_fresh": 1.5, "preadv_fresh_huge": 0.3}
    assert fastest(limits, ("preadv_fresh", "preadv_fresh_huge")) == ("preadv_fresh", 1.5)
    limits["preadv_fresh_huge"] = 2.0
    assert fastest(limits, ("preadv_fresh", "preadv_fresh_huge")) == ("preadv_fresh_huge", 2.0)


# About twenty fresh interpreters (two runs of limits and loads per mode): run apart.
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_load_script_prints_the_issue_json(tmp_path: Path) -> None:
    # bench/load.py is a script, not part of the package: run it as a user would.
    script = Path(__file__).resolve().parent.parent / "bench" / "load.py"
    cases = "none,none_readers1,mmap"
    args = ["--size", "32MiB", "--dir", str(tmp_path), "--runs", "2", "--cases", cases]
    proc = subprocess.run(
        [sys.executable, "-P", str(script), *args, "--settle", "0", "--json"],
        capture_output=True,
        text=True,
        timeout=230,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    model = Path(result["path"])
    assert model.parent == tmp_path
    assert result["size_bytes"] == model.stat().st_size
    assert set(result["limits"]) >= {
        "preadv_fresh",
        "preadv_fresh_huge",
        "preadv_fresh_1t",
        "preadv_fresh_1t_huge",
        "np_memmap_touch",
    }
    assert result["cases"]["none_readers1"] == {"mode": "none", "readers": 1}
    for table in ("modes", "modes_check_tensors_off"):
        assert set(result[table]) == set(cases.split(","))
        for name, case in result[table].items():
            assert case["gbps"] > 0
            # Judged, run by run, by the fastest of its limits measured in the same run;
            # the second run measures in the reverse order, and both count.
            assert len(case["runs_ratio"]) == 2
            readers = result["cases"][name].get("readers", LIMIT_THREADS)
            candidates = limits_for_mode(name.split("_")[0], cold=False, readers=readers)
            runs = {n: result["limit_runs"][n] for n in candidates}
            for i, (gbps, ratio, limit) in enumerate(
                zip(case["runs_gbps"], case["runs_ratio"], case["runs_limit"], strict=True)
            ):
                if any(len(v) != 2 for v in runs.values()):
                    continue  # one core: two cases measured the same limits in a run
                measured = {n: v[i] for n, v in runs.items()}
                assert limit == max(candidates, key=lambda n: measured[n])
                assert ratio == pytest.approx(gbps / measured[limit])
            assert case["ratio_to_limit"] == pytest.approx(statistics.median(case["runs_ratio"]))
    assert {"p50", "p99", "max"} <= set(result["loop_lag_ms"])
    assert result["peak_rss_bytes"] > 32 << 20
    assert result["gguf_py_gbps"] > 0
    assert set(result["targets"]) == set(result["targets_check_tensors_off"])
    assert (
        "none_readers1 >= 0.9 x fastest of preadv_fresh_1t | preadv_fresh_1t_backed"
        " | preadv_fresh_1t_huge | preadv_fresh_1t_huge_backed" in result["targets"]
    )


def test_the_spacer_backs_the_memory_asked_for(tmp_path: Path) -> None:
    near = tmp_path / "model.gguf"
    near.write_bytes(b"")
    answer = measure_in_subprocess({"task": "touch", "path": str(near), "nbytes": 3 << 20})
    assert answer == {"nbytes": 3 << 20}
    start = time.perf_counter()
    settle(0.05, touch_bytes=1 << 20, near=near)
    assert time.perf_counter() - start >= 0.05
