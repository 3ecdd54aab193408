"""``bench/vs_llamacpp.py`` without llama.cpp: the missing-extra exit, the choice of load
mode fields from the bindings' struct, and the JSON and table built from fake timings.

The benchmark itself needs llama-cpp-python (the ``peer`` extra) and minutes of loads;
none of that runs here.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "vs_llamacpp.py"


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("vs_llamacpp", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Dataclasses look their module up while the class is built.
    sys.modules["vs_llamacpp"] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules["vs_llamacpp"]


@pytest.mark.timeout(60)
def test_without_llama_cpp_it_says_how_to_install_and_exits_2(tmp_path: Path) -> None:
    models = tmp_path / "models"
    # A None entry in sys.modules makes the import fail as if the package were absent,
    # whatever this environment has installed.
    code = (
        "import runpy, sys\n"
        "sys.modules['llama_cpp'] = None\n"
        f"sys.argv = ['vs_llamacpp.py', '--dir', {str(models)!r}, '--runs', '1']\n"
        f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-P", "-c", code],
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    assert "pip install -e '.[peer]'" in proc.stderr
    assert "llama-cpp-python is not installed" in proc.stderr
    assert proc.stdout == ""
    # It stops before writing a multi-GiB model.
    assert not models.exists()


NEW_FIELDS = ["n_gpu_layers", "load_mode", "vocab_only", "check_tensors", "use_extra_bufts"]
NEW_ENUM = {
    "LLAMA_LOAD_MODE_NONE": 0,
    "LLAMA_LOAD_MODE_MMAP": 1,
    "LLAMA_LOAD_MODE_MLOCK": 2,
    "LLAMA_LOAD_MODE_MMAP_MLOCK": 3,
    "LLAMA_LOAD_MODE_DIRECT_IO": 4,
}


def test_load_mode_enum_of_newer_llama_cpp(bench: ModuleType) -> None:
    settings = bench.llama_mode_settings(NEW_FIELDS, NEW_ENUM)
    assert settings == {
        "none": {"load_mode": 0},
        "mmap": {"load_mode": 1},
        # aiogguf's mlock maps, then locks: llama.cpp's MMAP_MLOCK, not MLOCK.
        "mlock": {"load_mode": 3},
        "direct_io": {"load_mode": 4},
    }
    without_dio = {k: v for k, v in NEW_ENUM.items() if k != "LLAMA_LOAD_MODE_DIRECT_IO"}
    assert "direct_io" not in bench.llama_mode_settings(NEW_FIELDS, without_dio)


def test_load_mode_booleans_of_older_llama_cpp(bench: ModuleType) -> None:
    old = ["n_gpu_layers", "vocab_only", "use_mmap", "use_mlock", "check_tensors"]
    settings = bench.llama_mode_settings(old, {})
    assert settings == {
        "none": {"use_mmap": False, "use_mlock": False},
        "mmap": {"use_mmap": True, "use_mlock": False},
        "mlock": {"use_mmap": True, "use_mlock": True},
    }
    with_dio = bench.llama_mode_settings([*old, "use_direct_io"], {})
    assert with_dio["direct_io"] == {"use_mmap": False, "use_mlock": False, "use_direct_io": True}
    assert with_dio["mmap"]["use_direct_io"] is False


def _samples(bench: ModuleType, seconds: list[float], sys_s: float) -> list[Any]:
    return [
        bench.Sample(
            seconds=s,
            user_s=0.1,
            sys_s=sys_s,
            minflt=1000,
            majflt=0,
            peak_rss_bytes=2**30,
            warnings=("slow disk",) if i == 0 else (),
        )
        for i, s in enumerate(seconds)
    ]


def _result(bench: ModuleType, cases: dict[str, Any], skipped: dict[str, str]) -> dict[str, Any]:
    return {
        "llama_cpp": {"version": "0.3.36", "commit": None, "load_modes": ["mmap", "none"]},
        "model": {"path": "/m/bench.gguf", "size_bytes": 2 * 2**30},
        "reference": {"path": "/r/tiny.gguf", "size_bytes": 5_800_896},
        "runs": 3,
        "settle_s": 3.0,
        "cold_cache": "posix_fadvise",
        "cpus": 2,
        "load_average": [1.5, 2.25],
        "cases": cases,
        "skipped": skipped,
    }


def test_summary_and_table_from_fake_timings(bench: ModuleType) -> None:
    by_name = {c.name: c for c in bench.CASES}
    warm = bench.case_summary(
        by_name["warm_none"],
        _samples(bench, [4.0, 3.0, 5.0], sys_s=3.8),
        _samples(bench, [2.0, 1.0, 3.0], sys_s=5.7),
        Path("/m/bench.gguf"),
    )
    ref = bench.case_summary(
        by_name["reference_none"],
        _samples(bench, [0.010, 0.005, 0.017], sys_s=0.0),
        _samples(bench, [0.040, 0.035, 0.055], sys_s=0.01),
        Path("/r/tiny.gguf"),
    )
    assert warm["llama_cpp"]["median_s"] == 4.0
    assert (warm["llama_cpp"]["min_s"], warm["llama_cpp"]["max_s"]) == (3.0, 5.0)
    assert warm["aiogguf"]["median_s"] == 2.0
    assert warm["ratio"] == pytest.approx(0.5)
    assert warm["paired_ratios"] == pytest.approx([0.5, 1 / 3, 0.6])
    assert warm["llama_cpp"]["mode"] == "none"
    assert warm["llama_cpp"]["check_tensors"] is False
    assert warm["aiogguf"]["overrides"] == {
        "mode": "none",
        "check_tensors": False,
        "n_gpu_layers": 0,
    }
    assert warm["aiogguf"]["warnings"] == ["slow disk"]
    assert warm["aiogguf"]["warm_up"] is True
    assert warm["cache"] == "warm"
    first = bench.case_summary(
        by_name["warm_mmap_first"],
        _samples(bench, [0.004], sys_s=0.0),
        _samples(bench, [0.008], sys_s=0.0),
        Path("/m/bench.gguf"),
    )
    assert first["aiogguf"]["warm_up"] is False
    assert ref["ratio"] == pytest.approx(4.0)

    result = _result(
        bench,
        {"warm_none": warm, "reference_none": ref},
        {"cold_none": "the page cache cannot be dropped here (warm cases only)"},
    )
    assert json.loads(json.dumps(result)) == result
    table = bench.format_table(result).splitlines()
    assert table[6] == (
        "| warm, none, checks off | 4.00 s (3.00–5.00) | 2.00 s (1.00–3.00) | 0.50 | 3.80 / 5.70 |"
    )
    assert table[7] == (
        "| reference file, warm, none | 10.0 ms (5.0–17.0) | 40.0 ms (35.0–55.0) | 4.00 "
        "| 0.00 / 0.01 |"
    )
    assert table[8] == (
        "| cold_none | skipped: the page cache cannot be dropped here (warm cases only) | | | |"
    )
    assert "llama-cpp-python 0.3.36, commit unknown, load modes mmap, none" in table[0]
    assert "3 runs per case" in table[2]
    assert "cold cache: posix_fadvise" in table[2]
    assert "warm_none, llama.cpp warned: slow disk" in table


@pytest.mark.parametrize("warm_up", [True, False])
def test_the_aiogguf_worker_warms_up_before_its_clock_when_the_case_says(
    bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, warm_up: bool
) -> None:
    import aiogguf
    from aiogguf.testing.synth import write_synthetic_model

    model = write_synthetic_model(tmp_path / "m.gguf", size_bytes="1MiB", seed=1, n_layer=2)
    calls: list[dict[str, Any]] = []
    real = aiogguf.warm_up

    async def counting(**overrides: Any) -> Any:
        calls.append(overrides)
        return await real(**overrides)

    monkeypatch.setattr(aiogguf, "warm_up", counting)
    overrides = {"mode": "mmap", "check_tensors": False, "n_gpu_layers": 0}
    task = {"task": "aiogguf", "path": str(model.path), "overrides": overrides}
    out = bench.worker_main({**task, "warm_up": warm_up})
    assert calls == ([overrides] if warm_up else [])
    assert 0 < out["seconds"] < 60


def test_unknown_case_is_refused(bench: ModuleType) -> None:
    assert [c.name for c in bench._parse_cases("warm_mmap, cold_none")] == [
        "warm_mmap",
        "cold_none",
    ]
    with pytest.raises(argparse.ArgumentTypeError, match=r"unknown case\(s\) warm_nope;"):
        bench._parse_cases("warm_mmap,warm_nope")


def test_page_cache_states_are_made_anew_only_when_missing(
    bench: ModuleType, disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import aiogguf.testing.baselines as baselines
    from aiogguf.io.pagecache import fadvise_dontneed, resident_bytes

    path = disk_dir / "model.bin"
    size = (3 << 20) + 100
    with open(path, "wb") as out:
        out.write(os.urandom(size))
        out.flush()
        os.fsync(out.fileno())
    fills: list[bool] = []
    real_fill = baselines.fill_cache

    def fill(p: Path, *, small_pages: bool = False) -> None:
        fills.append(small_pages)
        real_fill(p, small_pages=small_pages)

    monkeypatch.setattr(baselines, "fill_cache", fill)
    cache = bench._PageCache(evictable=True)
    cache.prepare(path, "cold", 0.0)
    assert resident_bytes(path) == 0
    cache.prepare(path, "pages", 0.0)
    assert resident_bytes(path) == size
    assert fills == [True]
    cache.prepare(path, "pages", 0.0)  # still so: nothing read
    assert fills == [True]
    cache.prepare(path, "warm", 0.0)  # another kind of pages: evicted and read again
    assert fills == [True, False]
    fadvise_dontneed(path, 0, 1 << 20)  # part of it left the cache meanwhile
    cache.prepare(path, "warm", 0.0)
    assert fills == [True, False, False]
    assert resident_bytes(path) == size
    cache.prepare(path, "cold", 0.0)
    cache.prepare(path, "warm", 0.0)
    assert fills == [True, False, False, False]
