"""bench/peers.py and bench/timeline.py end to end on a small model (fresh processes, as
they run for a user): the table and the timeline they print, and their JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-P", str(BENCH / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.slow
def test_peers_prints_the_table_and_skips_what_is_missing(tmp_path: Path) -> None:
    out = tmp_path / "peers.json"
    done = _run(
        "peers.py",
        *("--size", "8MiB", "--runs", "2", "--settle", "0", "--dir", str(tmp_path)),
        *("--peers", "aiogguf_checks_on,aiogguf_checks_off,gguf_py,runai,limit"),
        *("--json", str(out)),
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    peers = result["peers"]
    if "runai" not in peers:  # not installed here: one line saying how to install it
        assert "skipped runai: runai_model_streamer is not installed (pip install" in done.stdout
    for name in ("aiogguf_checks_on", "aiogguf_checks_off", "limit"):
        assert peers[name]["gbps"] > 0
        assert len(peers[name]["runs"]) == 2
    assert peers["limit"]["of_limit"] == pytest.approx(1.0)
    assert "| **two threads `preadv` 64 MiB into fresh memory (the limit)** |" in done.stdout
    assert "load average" in done.stdout


@pytest.mark.slow
def test_peers_writes_the_same_bytes_as_safetensors(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    done = _run(
        "peers.py",
        *("--size", "8MiB", "--runs", "1", "--settle", "0", "--dir", str(tmp_path)),
        *("--peers", "safetensors"),
    )
    assert done.returncode == 0, done.stderr
    import numpy as np
    from safetensors.numpy import load_file  # pyright: ignore[reportMissingImports]  (optional: a peer)

    import aiogguf

    (model,) = tmp_path.glob("*.gguf")
    twin = load_file(str(model.with_suffix(".safetensors")))
    with aiogguf.load_sync(model, mode="none", n_gpu_layers=0) as loaded:
        assert set(twin) == {t.name for t in loaded.index.tensors}
        raw = model.read_bytes()
        for t in loaded.index.tensors:
            assert np.array_equal(twin[t.name], np.frombuffer(raw, np.uint8, t.nbytes, t.offset))


@pytest.mark.slow
def test_timeline_reports_each_reader(tmp_path: Path) -> None:
    out = tmp_path / "timeline.json"
    done = _run(
        "timeline.py",
        *("--size", "8MiB", "--runs", "1", "--settle", "0", "--dir", str(tmp_path)),
        *("--checks", "both", "--json", str(out)),
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert set(result["medians"]) == {"limit", "load_checks_on", "load_checks_off"}
    for kind in ("load_checks_on", "load_checks_off"):
        (sample,) = result["samples"][kind]
        assert sample["readers"]  # every reader's first and last read
        assert all(r["first"] <= r["last"] <= sample["wall_s"] for r in sample["readers"].values())
        assert result["medians"][kind]["of_limit"] > 0
    assert "medians of 1 runs" in done.stdout


@pytest.mark.slow
def test_timeline_patterns_time_each_way_of_backing(tmp_path: Path) -> None:
    out = tmp_path / "patterns.json"
    done = _run(
        "timeline.py",
        *("--patterns", "--size", "8MiB", "--runs", "1", "--settle", "0"),
        *("--dir", str(tmp_path), "--json", str(out)),
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(out.read_text())["patterns"]
    assert set(found) == {"shared_units", "per_chunk", "unit_per_reader"}
    assert all(p["gbps"] > 0 and p["cpu_s_per_gb"] >= 0 for p in found.values())
