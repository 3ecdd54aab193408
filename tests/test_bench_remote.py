"""``bench/remote.py`` end to end in a tiny configuration: a server process with the
round trip and window of a slow link, raw GETs, one connection, the load, and the
printed ratios. Speed is never asserted here (that is what ``bench/`` is for); only
that every figure was measured in the same run and the ratios are printed.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "remote.py"


# A few fresh interpreters (server, three measurements): run apart (marker slow).
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_tiny_run_prints_the_table_and_both_ratios(tmp_path: Path) -> None:
    out_json = tmp_path / "remote.json"
    args = ["--size", "8MiB", "--latency-ms", "2", "--runs", "1", "--dir", str(tmp_path)]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--out", str(out_json)],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for row in ("raw: concurrent ranged GETs", "one connection, one GET", "aiogguf load"):
        assert re.search(rf"\| {re.escape(row)}[^|]* \| \d+\.\d+ \|", out), out
    assert re.search(r"^load / raw: \d+\.\d\d ", out, re.M), out
    assert re.search(r"^load / single: \d+\.\d\d ", out, re.M), out
    assert "2 ms round trip" in out
    assert re.search(r"machine: \d+ CPUs, load average [\d. ]+ before", out), out
    # The JSON holds the same run's figures, and the ratios are of them.
    result = json.loads(out_json.read_text())
    assert set(result["gbps"]) == {"raw", "single", "load"}
    assert all(len(v) == 1 and v[0] > 0 for v in result["runs_gbps"].values())
    raw, single, load = (result["gbps"][k] for k in ("raw", "single", "load"))
    assert result["load_over_raw"] == pytest.approx(load / raw)
    assert result["load_over_single"] == pytest.approx(load / single)
    assert f"{result['load_over_raw']:.2f}" in out
    assert result["load_requests"] >= 1
