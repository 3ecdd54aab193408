"""GPU check: full offload against the hardware, in one run of a few minutes on one GPU.

Measures, on the same file and the same machine, then prints one JSON object (stdout)
and a short table (stderr):

1. ``write``: writes (or reuses) a synthetic model on local disk (``--size``, ``--dir``);
2. ``fingerprints``: the fingerprint of every tensor's bytes in the file (this also
   brings the whole file into the page cache: every later read is warm);
3. ``pinned_copy``: the pinned host-to-device copy peak (1 GiB, one and two streams),
   and what pinning costs (seconds per GiB);
4. ``raw_pipeline``: plain Python at the hardware's pace: T threads, each ``preadv``s
   64 MiB chunks of the file into its own two pinned buffers and queues a
   ``cudaMemcpyAsync`` on its own non-blocking stream, waiting for the buffer's event
   before reusing it; T = 1, 2, 4, ... up to ``os.cpu_count()`` (at most 16), and the
   same without the copies (read only) at the largest T;
5. ``first_load``: ``aiogguf.load(path, n_gpu_layers=-1, mode="none")`` as the first load
   of a fresh process (a subprocess; a 1 ms ticker task records the event loop's lag
   during the load), without and after ``aiogguf.warm_up``, alternated;
6. ``warm_loads``: loads of the same file in one process after ``warm_up`` and a first
   load, at the default config with ``check_tensors`` on and off, alternated, medians;
   then one load at each slot size of ``SLOT_SIZES`` (figures for choosing the default),
   each after a ``warm_up`` at that size that fills the staging pool, whose cap is sized
   for the loads' threads × ``staging_buffers`` slots of it (at the default 1 GiB cap, 16
   threads × 2 slots of 64 MiB would not fit, and lanes without a slot would poll);
7. each load's ratio to the raw pipeline at the loads' thread count
   (``min(os.cpu_count(), 16)``: ``readers = "auto"``, or ``--threads``), and the issue's
   targets, among them that no timed load after ``warm_up`` pinned a byte and that no
   load of a model the process loaded before allocated device memory (``pinned``: what
   each load's report says it pinned and allocated).

Bytes are verified: in the first load of each kind every tensor's fingerprint is
computed where it lives (with CuPy on the GPU) and compared with the file's.

    python bench/gpu_check.py [--size 8GiB] [--dir /tmp/aiogguf-gpu] [--json out.json]
    python bench/gpu_check.py --quick      # small model, one repetition: a dry run
    python bench/gpu_check.py --threads 2  # loads and the raw pipeline at 2 threads

Each measurement runs in its own ``try``: a failure is recorded in the JSON (``errors``
and the step's ``error``) and the run goes on. Repetitions that would overrun
``--budget`` seconds are skipped (and listed). Exit status: 0 when every measurement ran
and every verified byte matched, 1 otherwise, 2 without CuPy or a CUDA device.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from aiogguf._units import parse_size
from aiogguf.testing.synth_cache import ensure_synthetic_model

GB = 1e9
GiB = 1024**3
MiB = 1024**2
RAW_CHUNK_BYTES = 64 * MiB
MAX_THREADS = 16  # readers = "auto": one per core, at most 16
# The issue's targets (issue 10, "Must show" and "What to build" 3).
WARM_VS_RAW = 0.9
WARM_GBPS = 30.0
FIRST_VS_WARM = 0.8
FIRST_AFTER_WARM_UP_VS_WARM = 0.95
LAG_P99_MS = 5.0
LAG_MAX_AFTER_WARM_UP_MS = 20.0
WARM_RESERVE_S = 60.0  # budget kept for the warm-load process


# The driver sits beside this script; run as a script, this folder is on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_driver as driver  # noqa: E402


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def thread_counts(cpus: int) -> list[int]:
    """1, 2, 4, ... and the loads' own count, ``min(cpus, 16)``."""
    top = max(1, min(cpus, MAX_THREADS))
    counts = [t for t in (1, 2, 4, 8, 16) if t <= top]
    if top not in counts:
        counts.append(top)
    return counts


class Run:
    """The JSON being built, the clock and the budget."""

    def __init__(self, budget_s: float, say: Callable[[str], None]) -> None:
        self.start = time.perf_counter()
        self.budget_s = budget_s
        self.say = say
        self.result: dict[str, Any] = {"phases_s": {}, "errors": [], "skipped": []}

    def left_s(self) -> float:
        return self.budget_s - (time.perf_counter() - self.start)

    def phase(self, name: str, fn: Callable[[], Any]) -> Any:
        """Run one measurement; record its time, or its error and go on."""
        t = time.perf_counter()
        try:
            value = fn()
        except Exception as exc:
            value = {"error": driver.error_text(exc)}
            self.result["errors"].append(f"{name}: {driver.error_text(exc).splitlines()[0]}")
        seconds = time.perf_counter() - t
        self.result["phases_s"][name] = seconds
        self.say(f"[{time.perf_counter() - self.start:6.1f} s] {name}: {seconds:.1f} s")
        return value


# --- fingerprints of the file ---------------------------------------------------------


def file_fingerprints(synth: Any, workers: int) -> dict[str, int]:
    """Every tensor's fingerprint, from the file (numpy releases the GIL: threads)."""
    from concurrent.futures import ThreadPoolExecutor

    maps = [np.memmap(p, dtype=np.uint8, mode="r") for p in synth.paths]

    def one(t: Any) -> int:
        data = maps[t.shard][t.file_offset : t.file_offset + t.nbytes]
        return int(driver.fingerprint(np, data))

    with ThreadPoolExecutor(max(1, workers)) as pool:
        values = list(pool.map(one, synth.tensors))
    return {t.name: v for t, v in zip(synth.tensors, values, strict=True)}


# --- the hardware: pinned copies and the raw pipeline ------------------------------------


def pinned_copy(cupy: Any, nbytes: int = GiB, repeats: int = 5) -> dict[str, Any]:
    """Best host-to-device rate from pinned memory on GPU 0 (one stream, then two
    streams each copying half), and the seconds pinning took."""
    runtime = cupy.cuda.runtime
    out: dict[str, Any] = {"nbytes": nbytes}
    with cupy.cuda.Device(0):
        t = time.perf_counter()
        # PinnedMemory, not the pinned pool: freed when dropped, and timed alone.
        host_mem = cupy.cuda.PinnedMemory(nbytes)
        out["pin_s"] = time.perf_counter() - t
        out["pin_s_per_gib"] = out["pin_s"] * GiB / nbytes
        host_ptr, host = pinned_array(cupy, host_mem, nbytes)
        host[:] = 1  # fault the pages in
        dev = cupy.cuda.Memory(nbytes)
        streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        for n_streams in (1, 2):
            best = 0.0
            part = nbytes // n_streams
            for _ in range(repeats):
                start.record(streams[0])
                for s in streams[1:n_streams]:
                    s.wait_event(start)
                for i, s in enumerate(streams[:n_streams]):
                    runtime.memcpyAsync(
                        dev.ptr + i * part,
                        host_ptr + i * part,
                        part,
                        runtime.memcpyHostToDevice,
                        s.ptr,
                    )
                for s in streams[1:n_streams]:
                    done = cupy.cuda.Event()
                    done.record(s)
                    streams[0].wait_event(done)
                end.record(streams[0])
                end.synchronize()
                ms = cupy.cuda.get_elapsed_time(start, end)
                best = max(best, part * n_streams / (ms / 1000.0) / GB)
            out[f"gbps_{n_streams}_stream{'s' if n_streams > 1 else ''}"] = best
        del host, host_mem, dev, host_ptr
    out["gbps"] = max(out["gbps_1_stream"], out["gbps_2_streams"])
    return out


def pinned_array(cupy: Any, mem: Any, nbytes: int) -> tuple[int, np.ndarray]:
    """(address, numpy view) of pinned memory, as the library's CuPy staging slots take
    them (``PinnedMemoryPointer``, ``numpy.ndarray(buffer=...)``)."""
    pointer = cupy.cuda.PinnedMemoryPointer(mem, 0)
    return int(pointer.ptr), np.ndarray((nbytes,), dtype=np.uint8, buffer=pointer)


class RawPipeline:
    """The plain-Python pipeline: pinned buffers and one device allocation, made once."""

    def __init__(self, cupy: Any, path: Path, max_threads: int) -> None:
        self.cupy = cupy
        self.path = path
        self.size = path.stat().st_size
        self.chunks = (self.size + RAW_CHUNK_BYTES - 1) // RAW_CHUNK_BYTES
        with cupy.cuda.Device(0):
            t = time.perf_counter()
            self.pinned = [
                [cupy.cuda.PinnedMemory(RAW_CHUNK_BYTES) for _ in range(2)]
                for _ in range(max_threads)
            ]
            self.pin_s = time.perf_counter() - t
            size = RAW_CHUNK_BYTES
            arrays = [[pinned_array(cupy, m, size) for m in pair] for pair in self.pinned]
            self.ptrs = [[ptr for ptr, _ in pair] for pair in arrays]
            self.views = [[view for _, view in pair] for pair in arrays]
            self.streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(max_threads)]
            self.events = [
                [cupy.cuda.Event(block=True, disable_timing=True) for _ in range(2)]
                for _ in range(max_threads)
            ]
            self.dev = cupy.cuda.Memory(self.size)

    def close(self) -> None:
        self.views = []
        self.ptrs = []
        self.pinned = []
        self.dev = None

    def run(self, threads: int, copy: bool = True) -> dict[str, Any]:
        cupy = self.cupy
        runtime = cupy.cuda.runtime
        fd = os.open(self.path, os.O_RDONLY)
        counter = itertools.count()  # next() on it is atomic under the GIL
        errors: list[str] = []
        barrier = threading.Barrier(threads + 1)

        def worker(k: int) -> None:
            try:
                with cupy.cuda.Device(0):
                    stream, events, views = self.streams[k], self.events[k], self.views[k]
                    ptrs = self.ptrs[k]
                    barrier.wait()
                    n = 0
                    while (i := next(counter)) < self.chunks:
                        offset = i * RAW_CHUNK_BYTES
                        size = min(RAW_CHUNK_BYTES, self.size - offset)
                        j = n % 2
                        events[j].synchronize()  # the copy out of this buffer is done
                        view = memoryview(views[j])[:size]
                        got = 0
                        while got < size:
                            step = os.preadv(fd, [view[got:]], offset + got)
                            if step <= 0:
                                raise OSError(f"short read at {offset + got}")
                            got += step
                        if copy:
                            runtime.memcpyAsync(
                                self.dev.ptr + offset,
                                ptrs[j],
                                size,
                                runtime.memcpyHostToDevice,
                                stream.ptr,
                            )
                            events[j].record(stream)
                        n += 1
                    stream.synchronize()
            except Exception as exc:  # reported by run(); the barrier must not hang
                errors.append(driver.error_text(exc))
                barrier.abort()

        pool = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
        for th in pool:
            th.start()
        try:
            barrier.wait()
            start = time.perf_counter()
        except threading.BrokenBarrierError:
            start = time.perf_counter()
        for th in pool:
            th.join()
        seconds = time.perf_counter() - start
        os.close(fd)
        if errors:
            raise RuntimeError(errors[0])
        gbps = self.size / seconds / GB
        return {"threads": threads, "copy": copy, "seconds": seconds, "gbps": gbps}


def raw_pipeline(
    cupy: Any, path: Path, counts: list[int], repeats: int, run: Run
) -> dict[str, Any]:
    raw = RawPipeline(cupy, path, max(counts))
    out: dict[str, Any] = {
        "chunk_bytes": RAW_CHUNK_BYTES,
        "buffers_per_thread": 2,
        "pin_s": raw.pin_s,
        "file_bytes": raw.size,
        "by_threads": {},
    }
    try:
        for threads in counts:
            samples = []
            for _ in range(repeats):
                samples.append(raw.run(threads)["gbps"])
            out["by_threads"][str(threads)] = {"gbps": max(samples), "runs_gbps": samples}
            run.say(f"    raw pipeline T={threads:>2}: {max(samples):6.2f} GB/s")
        top = max(counts)
        read_only = [raw.run(top, copy=False)["gbps"] for _ in range(repeats)]
        out["read_only"] = {"threads": top, "gbps": max(read_only), "runs_gbps": read_only}
        run.say(f"    read only    T={top:>2}: {max(read_only):6.2f} GB/s")
    finally:
        raw.close()
        del raw
    return out


# --- loads, in subprocesses --------------------------------------------------------------

LOAD: dict[str, Any] = {"n_gpu_layers": -1, "mode": "none"}
SLOT_SIZES = ("16MiB", "32MiB", "64MiB")
# Loads of a model the process loaded before: none may allocate device memory (the
# arena keeps it) or pin (the pool keeps the slots). A first load after ``warm_up`` must
# not pin either; without ``warm_up`` it pays both, by design.
REPEAT_LABELS = (
    "check_on",
    "check_off",
    "verify_check_off",
    *(f"slot_{slot}" for slot in SLOT_SIZES),
)
WARM_LABELS = ("after_warm_up", *REPEAT_LABELS)


def pool_bytes(slot: str, threads: int, slots_per_thread: int) -> int:
    """A staging pool that holds every slot of a load: threads × slots of ``slot``."""
    return threads * slots_per_thread * parse_size(slot)


def _load_steps(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for s in result["steps"] if s.get("op") == "load"]


def first_loads(
    path: Path,
    expected: Path | None,
    runs: int,
    run: Run,
    timeout_s: float,
    load: dict[str, Any] = LOAD,
) -> dict[str, Any]:
    """Fresh processes: the load alone, or ``warm_up`` then the load; alternated."""
    samples: dict[str, list[dict[str, Any]]] = {"before_warm_up": [], "after_warm_up": []}
    warm_ups: list[dict[str, Any]] = []
    processes: list[dict[str, Any]] = []
    last_s = 30.0
    for r in range(runs):
        kinds = ["before_warm_up", "after_warm_up"]
        if r % 2:
            kinds.reverse()
        for kind in kinds:
            # Repetitions leave time for the warm loads (the headline), which come next.
            if r > 0 and run.left_s() < 1.5 * last_s + WARM_RESERVE_S:
                run.result["skipped"].append(f"first_load {kind} run {r + 1}: budget")
                continue
            steps: list[dict[str, Any]] = []
            if kind == "after_warm_up":
                steps.append({"op": "warm_up", "overrides": dict(load)})
            steps.append({"op": "load", "overrides": dict(load), "verify": r == 0, "label": kind})
            task = {"path": str(path), "expected": str(expected) if expected else None}
            result = driver.run_driver({**task, "steps": steps}, min(timeout_s, run.left_s()))
            last_s = result.get("wall_s", last_s)
            processes.append(
                {k: result.get(k) for k in ("returncode", "error", "wall_s", "stderr_tail")}
            )
            if result.get("error"):
                run.result["errors"].append(f"first_load {kind}: {result['error']}")
            loads = _load_steps(result) or [{"ok": False, "error": result.get("error")}]
            samples[kind].extend(loads)
            for s in result["steps"]:
                if s.get("op") == "warm_up":
                    warm_ups.append(s)
            for s in loads:
                shown = f"{s['gbps']:6.2f} GB/s" if s.get("ok") else f"ERROR {s.get('error')}"
                lag = s.get("lag_ms", {})
                run.say(
                    f"    first load {kind:<15} {shown} lag p99 {lag.get('p99', 0):.1f} "
                    f"max {lag.get('max', 0):.1f} ms"
                )
    return {
        "before_warm_up": driver.summarise(samples["before_warm_up"]),
        "after_warm_up": driver.summarise(samples["after_warm_up"]),
        "warm_up": warm_ups,
        "samples": samples,
        "processes": processes,
    }


def warm_loads(
    path: Path,
    expected: Path | None,
    runs: int,
    run: Run,
    timeout_s: float,
    load: dict[str, Any] = LOAD,
    threads: int = MAX_THREADS,
) -> dict[str, Any]:
    """One process: ``warm_up``, a first load (verified), then checks on/off alternated,
    then each slot size with its pool filled first (``threads`` × ``staging_buffers``
    slots)."""
    from aiogguf._config import Config

    per_thread = Config().with_overrides(**load).pipeline.staging_buffers
    steps: list[dict[str, Any]] = [
        {"op": "warm_up", "overrides": dict(load)},
        {"op": "load", "overrides": dict(load), "verify": True, "label": "prime"},
    ]
    for r in range(runs):
        order = [True, False] if r % 2 == 0 else [False, True]
        for check in order:
            steps.append(
                {
                    "op": "load",
                    "overrides": {**load, "check_tensors": check},
                    "label": f"check_{'on' if check else 'off'}",
                }
            )
    # Slot sizes around the issue's range, one load each: figures for choosing the default.
    # ``warm_up`` at the size fills the pool first (evicting the last size's slots), so
    # the timed load pins nothing; the cap holds every thread's slots.
    for slot in SLOT_SIZES:
        sized = {
            **load,
            "staging_buffer_size": slot,
            "staging_pool_size": pool_bytes(slot, threads, per_thread),
        }
        steps.append({"op": "warm_up", "overrides": sized, "label": f"fill_{slot}"})
        steps.append({"op": "load", "overrides": sized, "label": f"slot_{slot}"})
    # Verified again at the end: the fastest path (no checks) after reuse of the pool.
    steps.append(
        {
            "op": "load",
            "overrides": {**load, "check_tensors": False},
            "verify": True,
            "label": "verify_check_off",
        }
    )
    task = {"path": str(path), "expected": str(expected) if expected else None, "steps": steps}
    result = driver.run_driver(task, min(timeout_s, run.left_s()))
    if result.get("error"):
        run.result["errors"].append(f"warm_loads: {result['error']}")
    loads = _load_steps(result)
    by_label: dict[str, list[dict[str, Any]]] = {}
    for s in loads:
        by_label.setdefault(s.get("label", ""), []).append(s)
        shown = f"{s['gbps']:6.2f} GB/s" if s.get("ok") else f"ERROR {s.get('error')}"
        run.say(f"    warm load {s.get('label', ''):<17} {shown}")
    return {
        "check_on": driver.summarise(by_label.get("check_on", [])),
        "check_off": driver.summarise(by_label.get("check_off", [])),
        "prime": driver.summarise(by_label.get("prime", [])),
        "slot_sizes": {
            slot: driver.summarise(by_label.get(f"slot_{slot}", []))["gbps"] for slot in SLOT_SIZES
        },
        "slot_pool_bytes": {slot: pool_bytes(slot, threads, per_thread) for slot in SLOT_SIZES},
        "samples": loads,
        "warm_up": [s for s in result["steps"] if s.get("op") == "warm_up"],
        "process": {k: result.get(k) for k in ("returncode", "error", "wall_s", "stderr_tail")},
    }


# --- verdicts ------------------------------------------------------------------------------


def kernel_cache_files() -> int | None:
    """Files in CuPy's on-disk kernel cache now (None: no cache folder yet)."""
    folder = Path(os.environ.get("CUPY_CACHE_DIR", str(Path.home() / ".cupy" / "kernel_cache")))
    if not folder.is_dir():
        return None
    return sum(len(files) for _, _, files in os.walk(folder))


def api_missing(result: dict[str, Any]) -> list[str]:
    """The parts of issue 10's API this build lacks (their measurements say "missing")."""
    import aiogguf

    missing = [
        f"aiogguf.{name}"
        for name in (
            "warm_up",
            "warm_up_sync",
            "release_staging",
            "release_staging_sync",
            "release_device_memory",
            "release_device_memory_sync",
        )
        if not hasattr(aiogguf, name)
    ]
    samples = (result.get("warm_loads") or {}).get("samples") or []
    if any(s.get("report", {}).get("uploads") == "missing" for s in samples):
        missing.append("LoadReport.uploads")
    return missing


def _all_loads(result: dict[str, Any]) -> list[dict[str, Any]]:
    loads: list[dict[str, Any]] = []
    for where in ("first_load", "warm_loads"):
        samples = (result.get(where) or {}).get("samples", {})
        for group in samples.values() if isinstance(samples, dict) else [samples]:
            loads.extend(group)
    return loads


def pinned_in_loads(result: dict[str, Any]) -> dict[str, dict[str, list[int]]]:
    """Per load label: the bytes each such load pinned and the device memory it allocated
    (its report's uploads, summed over devices)."""
    out: dict[str, dict[str, list[int]]] = {}
    for s in _all_loads(result):
        uploads = (s.get("report") or {}).get("uploads")
        if not s.get("ok") or not isinstance(uploads, list):
            continue
        entry = out.setdefault(s.get("label", "?"), {"pinned": [], "device_allocated": []})
        entry["pinned"].append(sum(int(u.get("pinned_bytes_allocated", 0)) for u in uploads))
        entry["device_allocated"].append(
            sum(int(u.get("device_bytes_allocated", 0)) for u in uploads)
        )
    return out


def failed_loads(result: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, error) of every load that did not finish."""
    loads = _all_loads(result)
    return [(s.get("label", "?"), s.get("error") or "") for s in loads if not s.get("ok")]


def verification(result: dict[str, Any]) -> dict[str, Any]:
    """Every verified load's outcome: all tensors matched the file, and were on a GPU."""
    checked = []
    for s in _all_loads(result):
        if "verified" in s:
            v = s["verified"]
            checked.append(
                {
                    "label": s.get("label"),
                    "ok": bool(v.get("ok")),
                    "tensors": v.get("tensors"),
                    "tensors_on_gpu": v.get("tensors_on_gpu"),
                    "bytes_on_gpu": v.get("bytes_on_gpu"),
                    "mismatched": v.get("mismatched", [])[:20],
                    "error": v.get("error"),
                }
            )
    all_ok = bool(checked) and all(c["ok"] and c["tensors_on_gpu"] for c in checked)
    return {"loads": checked, "ok": all_ok}


def ratios_and_targets(result: dict[str, Any], loads_threads: int) -> dict[str, Any]:
    raw = (result.get("raw_pipeline") or {}).get("by_threads", {})
    raw_gbps = (raw.get(str(loads_threads)) or {}).get("gbps")
    warm = result.get("warm_loads") or {}
    first = result.get("first_load") or {}

    def gbps(block: dict[str, Any], key: str) -> float | None:
        value = (block.get(key) or {}).get("gbps")
        return float(value) if value is not None else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    on, off = gbps(warm, "check_on"), gbps(warm, "check_off")
    before, after = gbps(first, "before_warm_up"), gbps(first, "after_warm_up")
    ratios = {
        "raw_threads": loads_threads,
        "raw_gbps": raw_gbps,
        "warm_check_on_vs_raw": ratio(on, raw_gbps),
        "warm_check_off_vs_raw": ratio(off, raw_gbps),
        "first_before_warm_up_vs_raw": ratio(before, raw_gbps),
        "first_after_warm_up_vs_raw": ratio(after, raw_gbps),
        "first_before_warm_up_vs_warm": ratio(before, on),
        "first_after_warm_up_vs_warm": ratio(after, on),
        "check_on_vs_off": ratio(on, off),
    }
    lag_p99 = [
        (block.get(key) or {}).get("lag_p99_ms_worst")
        for block, key in (
            (first, "before_warm_up"),
            (first, "after_warm_up"),
            (warm, "check_on"),
            (warm, "check_off"),
        )
    ]
    lag_after = [
        (block.get(key) or {}).get("lag_max_ms")
        for block, key in ((first, "after_warm_up"), (warm, "check_on"), (warm, "check_off"))
    ]

    def target(value: float | None, least: float | None = None, most: float | None = None) -> Any:
        met = None
        if value is not None:
            met = (least is None or value >= least) and (most is None or value < most)
        return {"value": value, "met": met}

    p99 = [v for v in lag_p99 if v is not None]
    after_max = [v for v in lag_after if v is not None]
    pinned = result.get("pinned") or {}
    warm = [pinned[label] for label in WARM_LABELS if label in pinned]
    warm_pinned = sum(sum(p["pinned"]) for p in warm) if warm else None
    repeat = [pinned[label] for label in REPEAT_LABELS if label in pinned]
    repeat_allocated = sum(sum(p["device_allocated"]) for p in repeat) if repeat else None
    targets = {
        f"warm full offload >= {WARM_VS_RAW} x raw pipeline (T={loads_threads})": target(
            ratios["warm_check_on_vs_raw"], least=WARM_VS_RAW
        ),
        f"warm full offload >= {WARM_GBPS:g} GB/s": target(on, least=WARM_GBPS),
        f"first load >= {FIRST_VS_WARM} x warm": target(
            ratios["first_before_warm_up_vs_warm"], least=FIRST_VS_WARM
        ),
        f"first load after warm_up >= {FIRST_AFTER_WARM_UP_VS_WARM} x warm": target(
            ratios["first_after_warm_up_vs_warm"], least=FIRST_AFTER_WARM_UP_VS_WARM
        ),
        f"loop lag p99 < {LAG_P99_MS:g} ms in every load": target(
            max(p99) if p99 else None, most=LAG_P99_MS
        ),
        f"worst loop lag < {LAG_MAX_AFTER_WARM_UP_MS:g} ms after warm_up / when warm": target(
            max(after_max) if after_max else None, most=LAG_MAX_AFTER_WARM_UP_MS
        ),
        "bytes pinned inside timed loads after warm_up = 0": target(warm_pinned, most=1),
        "device bytes allocated by timed loads of a model loaded before = 0": target(
            repeat_allocated, most=1
        ),
        "every verified byte matched the file": {
            "value": None,
            "met": (result.get("verification") or {}).get("ok"),
        },
    }
    return {"ratios": ratios, "targets": targets}


def print_table(result: dict[str, Any]) -> None:
    def out(text: str) -> None:
        print(text, file=sys.stderr)

    def f(value: Any, fmt: str = "6.2f") -> str:
        return format(value, fmt) if isinstance(value, int | float) else "   n/a"

    out("")
    out(f"model {result.get('path')} ({f(result.get('tensor_bytes', 0) / GB)} GB of tensors)")
    peak = result.get("pinned_copy") or {}
    out(
        f"pinned copy peak      {f(peak.get('gbps'))} GB/s "
        f"(pinning {f(peak.get('pin_s_per_gib'), '.2f')} s/GiB)"
    )
    raw = (result.get("raw_pipeline") or {}).get("by_threads", {})
    out("raw pipeline  " + "  ".join(f"T={t}: {f(v.get('gbps'), '.2f')}" for t, v in raw.items()))
    rows = [
        ("first load", (result.get("first_load") or {}).get("before_warm_up")),
        ("first after warm_up", (result.get("first_load") or {}).get("after_warm_up")),
        ("warm, checks on", (result.get("warm_loads") or {}).get("check_on")),
        ("warm, checks off", (result.get("warm_loads") or {}).get("check_off")),
    ]
    out(f"{'load':<22}{'GB/s':>7}{'lag p99':>9}{'max':>8}  runs")
    for name, block in rows:
        block = block or {}
        runs = f"{block.get('ok_runs', 0)}/{block.get('runs', 0)}"
        out(
            f"{name:<22}{f(block.get('gbps'), '7.2f')}{f(block.get('lag_p99_ms'), '9.1f')}"
            f"{f(block.get('lag_max_ms'), '8.1f')}  {runs}"
        )
    sizes = (result.get("warm_loads") or {}).get("slot_sizes") or {}
    out(
        "slot sizes, pool filled first  "
        + "  ".join(f"{k}: {f(v, '.2f')}" for k, v in sizes.items())
    )
    for label, p in (result.get("pinned") or {}).items():
        out(f"  {label}: pinned {p['pinned']} B, device memory allocated {p['device_allocated']} B")
    for name, value in (result.get("ratios") or {}).items():
        if isinstance(value, float):
            out(f"  {name}: {value:.2f}")
    for name, t in (result.get("targets") or {}).items():
        state = {True: "met", False: "MISSED", None: "n/a"}[t["met"]]
        out(f"  [{state:>6}] {name}: {f(t['value'], '.2f')}")
    for e in result.get("errors", []):
        out(f"  error: {e[:200]}")
    for s in result.get("skipped", []):
        out(f"  skipped: {s}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--dir", default="/tmp/aiogguf-gpu", help="where the model is written")
    parser.add_argument("--size", default=None, help="tensor bytes (default 8GiB; --quick 256MiB)")
    parser.add_argument("--quick", action="store_true", help="small model, one repetition")
    parser.add_argument("--runs", type=int, default=None, help="repetitions (default 3)")
    parser.add_argument("--budget", type=float, default=225.0, help="seconds (default 225)")
    parser.add_argument("--json", metavar="PATH", help="also write the JSON to PATH")
    parser.add_argument(
        "--threads", type=int, default=None, help="loads' readers (default: one per core, <= 16)"
    )
    args = parser.parse_args(argv)
    size = parse_size(args.size or ("256MiB" if args.quick else "8GiB"))
    runs = args.runs if args.runs is not None else (1 if args.quick else 3)
    cpus = os.cpu_count() or 1
    loads_threads = args.threads or min(cpus, MAX_THREADS)
    load = {**LOAD, "readers": args.threads} if args.threads else dict(LOAD)

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    run = Run(args.budget, say)
    result = run.result
    result.update(
        {
            "size_bytes": size,
            "quick": args.quick,
            "runs": runs,
            "cpu_count": cpus,
            "threads": loads_threads,
            "python": sys.version.split()[0],
        }
    )

    def finish(status: int) -> int:
        result["wall_s"] = time.perf_counter() - run.start
        result["exit_status"] = status
        text = json.dumps(result, indent=1, default=str)
        if args.json:
            Path(args.json).write_text(text + "\n", encoding="utf-8")
        print(text)
        return status

    from aiogguf.io._devices.cupy_backend import cupy_devices, import_cupy

    cupy = import_cupy()
    devices = cupy_devices() if cupy is not None else ()
    if cupy is None or not devices:
        why = "CuPy is not installed" if cupy is None else "CuPy sees no CUDA device"
        say(f"gpu_check: needs CuPy and a CUDA device ({why})")
        result["error"] = f"needs CuPy and a CUDA device: {why}"
        return finish(2)
    result["cupy"] = cupy.__version__
    try:
        props = cupy.cuda.runtime.getDeviceProperties(0)
        name = props.get("name", b"")
        result["gpu"] = name.decode() if isinstance(name, bytes) else str(name)
        result["gpus"] = len(devices)
    except Exception as exc:
        result["gpu"] = f"unknown ({exc})"

    path = Path(args.dir) / f"gpu-check-{size // MiB}MiB.gguf"
    result["path"] = str(path)

    def write() -> Any:
        synth, written = ensure_synthetic_model(path, size_bytes=size, seed=0)
        result["tensor_bytes"] = synth.tensor_bytes
        result["n_tensors"] = synth.n_tensors
        result["written"] = written
        return synth

    synth = run.phase("write", write)
    if isinstance(synth, dict):  # no model: nothing else can run
        return finish(1)
    expected_path = Path(args.dir) / f"{path.stem}.fingerprints.json"

    def fingerprints() -> str:
        values = file_fingerprints(synth, loads_threads)
        expected_path.write_text(json.dumps({k: str(v) for k, v in values.items()}))
        return str(expected_path)

    fp = run.phase("fingerprints", fingerprints)
    expected = expected_path if isinstance(fp, str) else None

    copy_bytes, copy_repeats = (64 * MiB, 2) if args.quick else (GiB, 5)
    result["pinned_copy"] = run.phase(
        "pinned_copy", lambda: pinned_copy(cupy, copy_bytes, copy_repeats)
    )
    counts = thread_counts(loads_threads)
    result["raw_pipeline"] = run.phase(
        "raw_pipeline", lambda: raw_pipeline(cupy, path, counts, 1 if args.quick else 2, run)
    )
    # The parent's pinned and device memory are gone; its CUDA context stays (small).
    # First loads go first: the very first one also meets CuPy's kernel cache as this
    # machine left it (``kernel_cache_files``), as a server's first start would.
    result["kernel_cache_files"] = kernel_cache_files()
    timeout_s = 150.0
    result["first_load"] = run.phase(
        "first_load", lambda: first_loads(path, expected, runs, run, timeout_s, load)
    )
    result["warm_loads"] = run.phase(
        "warm_loads",
        lambda: warm_loads(path, expected, runs, run, timeout_s, load, loads_threads),
    )
    result["api_missing"] = api_missing(result)
    result["pinned"] = pinned_in_loads(result)
    result["verification"] = verification(result)
    for label, error in failed_loads(result):
        result["errors"].append(f"load {label}: {error.splitlines()[0] if error else '?'}")
    result.update(ratios_and_targets(result, loads_threads))
    print_table(result)
    failed = bool(result["errors"]) or not result["verification"]["ok"]
    return finish(1 if failed else 0)


if __name__ == "__main__":
    sys.exit(main())
