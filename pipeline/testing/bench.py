"""Load benchmarks: one measured load, and the sweep behind ``aiogguf bench``.

Every measured load runs in a fresh Python process (``measure_in_subprocess``), so its
peak RSS (``VmHWM``) is that load's alone and no load inherits another's memory. Inside,
a ticker task sleeps 1 ms at a time on the same event loop and records how late it
wakes: that is the loop lag a server embedding the load would see. The machine's limits
(``aiogguf.testing.baselines``) are measured in the parent between loads, mode by mode, so a load
and the limit it is compared with see the same (noisy, shared) machine.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from aiogguf._api import load
from aiogguf._config import PipelineConfig
from aiogguf.io.buffers import HostBuffer
from aiogguf.io.pagecache import drop_from_cache
from aiogguf.io.workers import at_load_priority
from aiogguf.testing.baselines import (
    GB,
    PageCache,
    direct_gbps,
    drop_or_warm,
    memcpy_gbps,
    mmap_touch_gbps,
    np_memmap_touch_s,
    pinned_copy_gbps,
    preadv_fresh_gbps,
    preadv_touched_gbps,
)

__all__ = [
    "LIMIT_NOTES",
    "MODES",
    "LagStats",
    "LoadSample",
    "PointResult",
    "SweepPoint",
    "SweepResult",
    "fastest",
    "grid",
    "limit_in_subprocess",
    "limits_for_mode",
    "load_in_subprocess",
    "measure_in_subprocess",
    "measure_limit",
    "measure_load",
    "plot_sweep",
    "run_sweep",
    "settle",
    "worker_main",
]

MODES = ("none", "direct", "mmap", "mlock")
TICK_S = 0.001
# The default reader count (one per core, up to 16): limits and loads use as many threads.
LIMIT_THREADS = PipelineConfig().reader_count()
_WORKER_TIMEOUT_S = 900.0
# The pause before each measurement of bench/load.py (see ``settle``): Linux reports
# freed pages after 2 s.
SETTLE_S = 3.0


# --- one load, measured -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LagStats:
    """How late a 1 ms ticker woke up during a load, in milliseconds."""

    p50_ms: float
    p99_ms: float
    max_ms: float
    samples: int

    @classmethod
    def from_seconds(cls, lags_s: Sequence[float]) -> LagStats:
        """The median, 99th percentile and maximum, in ms, of loop lags in seconds."""
        if not lags_s:
            return cls(0.0, 0.0, 0.0, 0)
        ms = np.asarray(lags_s) * 1e3
        return cls(
            float(np.percentile(ms, 50)),
            float(np.percentile(ms, 99)),
            float(ms.max()),
            len(lags_s),
        )


@dataclass(frozen=True, slots=True)
class LoadSample:
    """One load: ``seconds`` from the call to the model being ready (parse included);
    ``close_s`` is the time the model took to free its memory afterwards (on the loop
    thread: a stall the ticker does not see, reported separately)."""

    mode: str
    seconds: float
    nbytes: int
    report_gbps: float
    lag: LagStats
    idle_lag: LagStats  # the same ticker with nothing loading: the loop's own noise
    peak_rss_bytes: int
    base_rss_bytes: int
    close_s: float
    stages: tuple[tuple[str, float, float], ...]  # (name, wall_s, busy_s)
    warnings: tuple[str, ...] = ()

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / GB if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        """The sample as a JSON object (its GB/s included)."""
        data = asdict(self)
        data["gbps"] = self.gbps
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LoadSample:
        """A sample from ``to_json``'s object."""
        return cls(
            mode=data["mode"],
            seconds=data["seconds"],
            nbytes=data["nbytes"],
            report_gbps=data["report_gbps"],
            lag=LagStats(**data["lag"]),
            idle_lag=LagStats(**data["idle_lag"]),
            peak_rss_bytes=data["peak_rss_bytes"],
            base_rss_bytes=data["base_rss_bytes"],
            close_s=data["close_s"],
            stages=tuple((str(n), float(w), float(b)) for n, w, b in data["stages"]),
            warnings=tuple(data["warnings"]),
        )


def _proc_status_bytes(key: str) -> int:
    """``VmHWM``/``VmRSS`` of this process in bytes (``ru_maxrss`` off Linux)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


async def _tick(lags: list[float], tick_s: float) -> None:
    while True:
        start = time.perf_counter()
        await anyio.sleep(tick_s)
        lags.append(max(0.0, time.perf_counter() - start - tick_s))


async def _idle_lag(seconds: float, tick_s: float) -> LagStats:
    lags: list[float] = []
    with anyio.move_on_after(seconds):
        await _tick(lags, tick_s)
    return LagStats.from_seconds(lags)


async def measure_load(
    path: str | os.PathLike[str],
    overrides: Mapping[str, Any],
    *,
    config: str | None = None,
    tick_s: float = TICK_S,
) -> LoadSample:
    """Load ``path`` with ``config`` (a TOML path or None) and ``overrides`` while a
    ticker measures the loop lag."""
    idle = await _idle_lag(0.2, tick_s)
    base_rss = _proc_status_bytes("VmRSS")
    lags: list[float] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(_tick, lags, tick_s)
        start = time.perf_counter()
        async with load(path, config, **overrides) as model:
            seconds = time.perf_counter() - start
            n_lags = len(lags)  # samples taken while loading; closing comes next
            peak_rss = _proc_status_bytes("VmHWM")
            report = model.report
            closing = time.perf_counter()
        close_s = time.perf_counter() - closing
        tg.cancel_scope.cancel()
    lags = lags[:n_lags]
    return LoadSample(
        mode=report.mode,
        seconds=seconds,
        nbytes=report.nbytes,
        report_gbps=report.gbps,
        lag=LagStats.from_seconds(lags),
        idle_lag=idle,
        peak_rss_bytes=peak_rss,
        base_rss_bytes=base_rss,
        close_s=close_s,
        stages=tuple((s.name, s.wall_s, s.busy_s) for s in report.stages),
        warnings=report.warnings,
    )


def gguf_py_copy(path: str | os.PathLike[str]) -> tuple[float, int, int]:
    """``gguf.GGUFReader`` on ``path`` and ``np.array(t.data)`` for every tensor (the copies
    are kept, as a loader keeps them). Returns (seconds, bytes copied, peak RSS)."""
    import gguf

    start = time.perf_counter()
    reader = gguf.GGUFReader(os.fspath(path))
    arrays = [np.array(t.data) for t in reader.tensors]
    seconds = time.perf_counter() - start
    return seconds, sum(a.nbytes for a in arrays), _proc_status_bytes("VmHWM")


def worker_main() -> None:
    """Entry point of a measuring subprocess: one JSON task in ``argv[1]``, one JSON line
    out. Tasks: ``{"task": "load", "path", "overrides", "uvloop"}``, ``{"task":
    "limit", "name", "path"}``, ``{"task": "gguf_py", "path"}``, ``{"task": "touch",
    "path", "nbytes"}`` (back ``nbytes`` of new memory and exit: see ``settle``)."""
    task = json.loads(sys.argv[1])
    warnings.simplefilter("ignore")  # load warnings come back in the report instead
    if task["task"] == "gguf_py":
        seconds, nbytes, peak = gguf_py_copy(task["path"])
        out: dict[str, Any] = {"seconds": seconds, "nbytes": nbytes, "peak_rss_bytes": peak}
    elif task["task"] == "limit":
        # At the priority of a load's readers (its threads inherit it): on a busy
        # machine a thread at nice 0 gets three times the share of the cores that one at
        # the readers' nice gets, and a load's ratio to its limit would measure that.
        at_load_priority()
        out = {"gbps": measure_limit(task["name"], task["path"])}
    elif task["task"] == "touch":
        with HostBuffer(int(task["nbytes"]), prefault=True) as buffer:
            out = {"nbytes": buffer.nbytes}
    else:
        options = {"use_uvloop": True} if task.get("uvloop") else {}

        async def main() -> LoadSample:
            return await measure_load(task["path"], task["overrides"], config=task.get("config"))

        out = anyio.run(main, backend_options=options).to_json()
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()


def measure_in_subprocess(task: Mapping[str, Any], *, timeout_s: float = _WORKER_TIMEOUT_S) -> Any:
    """Run one ``worker_main`` task in a fresh interpreter and return its JSON answer.

    Raises ``RuntimeError`` with the worker's stderr if it fails.
    """
    code = "from aiogguf.testing.bench import worker_main; worker_main()"
    # -P: never put the working directory on sys.path (a repository root holds a
    # folder named io that would shadow the standard library).
    proc = subprocess.run(
        [sys.executable, "-P", "-c", code, json.dumps(task)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
        cwd=os.path.dirname(os.path.abspath(task["path"])),
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = proc.stderr.strip().splitlines()[-12:]
        raise RuntimeError(
            f"measuring {task['task']} of {task['path']} failed (exit {proc.returncode}):\n"
            + "\n".join(tail)
        )
    return json.loads(lines[-1])


def load_in_subprocess(
    path: str | os.PathLike[str],
    overrides: Mapping[str, Any],
    *,
    config: str | os.PathLike[str] | None = None,
    uvloop: bool = False,
) -> LoadSample:
    """``measure_load`` in a fresh process (peak RSS per load)."""
    task: dict[str, Any] = {"task": "load", "path": os.fspath(path), "overrides": dict(overrides)}
    task["config"] = os.path.abspath(config) if config is not None else None
    task["uvloop"] = uvloop
    return LoadSample.from_json(measure_in_subprocess(task))


# --- limits -----------------------------------------------------------------------------


def _preadv_name(threads: int, huge: bool, cold: bool, backed: bool = False) -> str:
    one = "_1t" if threads == 1 else ""
    kind = f"{'_huge' if huge else ''}{'_backed' if backed else ''}"
    return f"preadv_fresh{one}{kind}{'_cold' if cold else ''}"


def limits_for_mode(mode: str, cold: bool, readers: int = LIMIT_THREADS) -> tuple[str, ...]:
    """The limits a load in ``mode`` with ``readers`` threads is judged by: the fastest
    of them, each measured in the same run. ``none`` fills fresh memory, which may come
    in 4 KiB or in huge pages (``huge_pages``), faulted in by the read or backed just
    before it: its limit is the fastest ``preadv`` into each, on one thread for one
    reader, else on ``LIMIT_THREADS``. ``direct`` is ``O_DIRECT`` into fresh memory, as
    the load's own is, either way."""
    if mode == "direct":
        return ("direct_fresh", "direct_fresh_backed")
    if mode == "none":
        threads = 1 if readers == 1 else LIMIT_THREADS
        return tuple(
            _preadv_name(threads, huge, cold, backed)
            for huge in (False, True)
            for backed in (False, True)
        )
    return ("np_memmap_touch_cold",) if cold else ("np_memmap_touch",)


def _np_memmap_gbps(path: Path, cold: bool = False) -> float:
    return path.stat().st_size / np_memmap_touch_s(path, cold=cold) / GB


def _preadv_fresh(threads: int, huge: bool, cold: bool, backed: bool) -> Callable[[Path], float]:
    return lambda p: preadv_fresh_gbps(
        p, threads=threads, huge_pages=huge, cold=cold, backed=backed
    )


_MEMORY = {False: "4 KiB-page", True: "huge-page (2 MiB-aligned, MADV_HUGEPAGE)"}

# name → how to measure it on a file, in GB/s.
_LIMITS: dict[str, Callable[[Path], float]] = {
    **{
        _preadv_name(threads, huge, cold, backed): _preadv_fresh(threads, huge, cold, backed)
        for threads in sorted({1, LIMIT_THREADS})
        for huge in (False, True)
        for cold in (False, True)
        for backed in (False, True)
    },
    "preadv_touched": lambda p: preadv_touched_gbps(p, threads=LIMIT_THREADS),
    "direct": lambda p: direct_gbps(p, threads=LIMIT_THREADS),
    "direct_fresh": lambda p: direct_gbps(p, threads=LIMIT_THREADS, fresh=True),
    "direct_fresh_backed": lambda p: direct_gbps(p, threads=LIMIT_THREADS, fresh=True, backed=True),
    "memcpy": lambda p: memcpy_gbps(p.stat().st_size, threads=LIMIT_THREADS),
    "mmap_touch": lambda p: mmap_touch_gbps(p, threads=LIMIT_THREADS),
    "mmap_touch_cold": lambda p: mmap_touch_gbps(p, threads=LIMIT_THREADS, cold=True),
    "np_memmap_touch": _np_memmap_gbps,
    "np_memmap_touch_cold": lambda p: _np_memmap_gbps(p, cold=True),
}


def _threads(n: int) -> str:
    return f"{n} thread{'s' if n != 1 else ''}"


LIMIT_NOTES: dict[str, str] = {
    **{
        _preadv_name(threads, huge, cold, backed): (
            f"preadv, {_threads(threads)}, into fresh {_MEMORY[huge]} memory"
            + (", each chunk's pages backed in one call first" if backed else "")
            + (", from a dropped cache" if cold else "")
        )
        for threads in sorted({1, LIMIT_THREADS})
        for huge in (False, True)
        for cold in (False, True)
        for backed in (False, True)
    },
    "preadv_touched": f"preadv, {_threads(LIMIT_THREADS)}, into touched 4 KiB-page memory (reload)",
    "direct": f"O_DIRECT, {_threads(LIMIT_THREADS)}, into touched aligned memory (the disk)",
    "direct_fresh": (
        f"O_DIRECT, {_threads(LIMIT_THREADS)}, into fresh 4 KiB-page memory, as a direct load"
    ),
    "direct_fresh_backed": (
        f"O_DIRECT, {_threads(LIMIT_THREADS)}, into fresh 4 KiB-page memory, each chunk's"
        " pages backed in one call first, as a direct load"
    ),
    "memcpy": f"memory copy, {_threads(LIMIT_THREADS)}, between touched buffers",
    "mmap_touch": f"mapping made resident, MADV_POPULATE_READ, {_threads(LIMIT_THREADS)}",
    "mmap_touch_cold": "the same from a dropped cache",
    "np_memmap_touch": "np.memmap, one byte read per page, 1 thread (the page cache's pages)",
    "np_memmap_touch_cold": "the same from a dropped cache",
    "pinned_h2d": "pinned host → GPU 0 copy (CuPy)",
}


def fastest(limits: Mapping[str, float], names: Sequence[str]) -> tuple[str, float]:
    """The fastest of ``names`` in ``limits`` (GB/s by name): (its name, its GB/s)."""
    best = max(names, key=lambda name: limits.get(name, 0.0))
    return best, limits.get(best, 0.0)


def measure_limit(name: str, path: str | os.PathLike[str]) -> float:
    """One measurement of limit ``name`` on ``path``, in GB/s (KeyError: unknown name)."""
    return _LIMITS[name](Path(path))


def limit_in_subprocess(name: str, path: str | os.PathLike[str]) -> float:
    """``measure_limit`` in a fresh process, like the loads it is compared with, at the
    CPU priority of a load's readers (``LOAD_NICE``)."""
    return float(
        measure_in_subprocess({"task": "limit", "name": name, "path": os.fspath(path)})["gbps"]
    )


def settle(
    seconds: float = SETTLE_S, *, touch_bytes: int = 0, near: str | os.PathLike[str] = ""
) -> None:
    """Put the machine's memory in the same state before every measurement.

    A process that allocates a lot of new memory runs at a speed that depends on what
    ran just before it. On a virtual machine with free page reporting (virtio-balloon)
    the guest hands freed memory back to the host a few seconds after it is freed; pages
    allocated before then are still backed by the host, pages allocated afterwards fault
    in the host as well on their first touch, which is much slower. Two measurements
    taken back to back can therefore compare a fast process with a slow one.

    ``settle`` makes every measurement follow the same history: first a spacer process
    backs and frees ``touch_bytes`` of memory (the size of what is measured), then the
    caller waits ``seconds``. Measurements that each follow a spacer and the same pause
    vary much less than measurements taken one after another.

    ``seconds``: the pause after the spacer; 0 or less skips both (the tests use 0).
    ``touch_bytes``: how much memory the spacer backs and frees; 0: no spacer.
    ``near``: the measured file; the spacer runs in its folder, as the measurements do.
    """
    if seconds <= 0:
        return
    if touch_bytes > 0:
        measure_in_subprocess({"task": "touch", "path": os.fspath(near), "nbytes": touch_bytes})
    time.sleep(seconds)


# --- the sweep --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """One point of a sweep: the load settings it measures."""

    mode: str
    chunk_bytes: int
    readers: int
    queue_depth: int

    def overrides(self, check_tensors: bool | None) -> dict[str, Any]:
        """The load settings of this point (``check_tensors``: as given, or the default)."""
        settings: dict[str, Any] = {
            "mode": self.mode,
            "chunk_size": self.chunk_bytes,
            "readers": self.readers,
            "queue_depth": self.queue_depth,
        }
        if check_tensors is not None:
            settings["check_tensors"] = check_tensors
        return settings


def grid(
    modes: Sequence[str],
    chunk_bytes: Sequence[int],
    readers: Sequence[int],
    queue_depths: Sequence[int],
) -> list[SweepPoint]:
    """Every combination, grouped by mode (the order the sweep runs them in)."""
    return [
        SweepPoint(m, c, r, q)
        for m in modes
        for c in chunk_bytes
        for r in readers
        for q in queue_depths
    ]


@dataclass(frozen=True, slots=True)
class PointResult:
    """The samples of one point, and the bound the sweep measured beside it."""

    point: SweepPoint
    samples: tuple[LoadSample, ...]
    limit: str
    limit_gbps: float

    @property
    def gbps(self) -> float:
        return statistics.median(s.gbps for s in self.samples)

    @property
    def ratio(self) -> float:
        return self.gbps / self.limit_gbps if self.limit_gbps > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        """The point's result as a JSON object."""
        return {
            **asdict(self.point),
            "gbps": self.gbps,
            "runs_gbps": [s.gbps for s in self.samples],
            "limit": self.limit,
            "limit_gbps": self.limit_gbps,
            "ratio_to_limit": self.ratio,
            "loop_lag_p99_ms": statistics.median(s.lag.p99_ms for s in self.samples),
            "loop_lag_max_ms": max(s.lag.max_ms for s in self.samples),
            "peak_rss_bytes": max(s.peak_rss_bytes for s in self.samples),
            "warnings": sorted({w for s in self.samples for w in s.warnings}),
        }


@dataclass(frozen=True, slots=True)
class SweepResult:
    """A whole sweep: the model, the conditions and every point's result."""

    path: str
    size_bytes: int
    runs: int
    cold: bool
    # None: warm sweep (nothing dropped); else whether every drop emptied the cache.
    cold_drop_ok: bool | None
    check_tensors: bool | None
    limits: dict[str, float]  # median GB/s per limit name
    limit_runs: dict[str, list[float]]
    points: tuple[PointResult, ...]
    notes: tuple[str, ...] = field(default=())

    def best(self) -> dict[str, PointResult]:
        """The fastest point of each mode."""
        best: dict[str, PointResult] = {}
        for p in self.points:
            mode = p.point.mode
            if mode not in best or p.gbps > best[mode].gbps:
                best[mode] = p
        return best

    def to_json(self) -> dict[str, Any]:
        """The sweep's results as a JSON object."""
        return {
            "path": self.path,
            "size_bytes": self.size_bytes,
            "runs": self.runs,
            "cold": self.cold,
            "cold_drop_ok": self.cold_drop_ok,
            "check_tensors": self.check_tensors,
            "limits": self.limits,
            "limit_runs": self.limit_runs,
            "limit_notes": {k: LIMIT_NOTES.get(k, "") for k in self.limits},
            "points": [p.to_json() for p in self.points],
            "best": {mode: p.to_json() for mode, p in self.best().items()},
            "notes": list(self.notes),
        }


def run_sweep(
    path: str | os.PathLike[str],
    points: Sequence[SweepPoint],
    *,
    runs: int = 1,
    cold: bool = False,
    check_tensors: bool | None = None,
    config: str | os.PathLike[str] | None = None,
    extra_limits: Sequence[str] = ("preadv_touched", "memcpy", "mmap_touch"),
    pinned: bool = True,
    settle_s: float = SETTLE_S,
    say: Callable[[str], None] = lambda _: None,
) -> SweepResult:
    """Load ``path`` at every point, ``runs`` times; each run measures every mode's limits
    (``limits_for_mode``, for each reader count of its points) right before that mode's
    points, so loads and limits interleave in time; a point is judged by the fastest of
    its limits.

    ``cold`` drops the file from the page cache before every load and every limit run
    (``posix_fadvise(DONTNEED)``); otherwise the file is put in the same warm state first
    (``PageCache``: read in file order, then mapped once), which a mapped load's cost
    depends on (``direct`` reads bypass the cache either way). Limits and loads alike
    run in a fresh process after ``settle_s`` seconds (see ``settle``).
    """
    p = Path(path)
    size = p.stat().st_size
    modes = list(dict.fromkeys(pt.mode for pt in points))
    limit_runs: dict[str, list[float]] = {}
    samples: dict[SweepPoint, list[LoadSample]] = {pt: [] for pt in points}
    drops: list[bool] = []
    notes: list[str] = []
    # Only posix_fadvise is tried here: the fallback of evict() drops every file's cache.
    cache = PageCache(evictable=drop_from_cache(p))

    def cache_for(cold: bool) -> bool:
        if cold:
            return drop_or_warm(p, cold=True)
        cache.make(p, "warm")
        return True

    def limit(name: str) -> float:
        # The page cache is set before the pause, as for a load: a limit that had to
        # read the file first would fill the cache right before its timed run.
        cache_for(name.endswith("_cold"))
        settle(settle_s, touch_bytes=size, near=p)
        value = limit_in_subprocess(name, p)
        limit_runs.setdefault(name, []).append(value)
        return value

    def mode_limits(mode: str) -> list[str]:
        readers = sorted({pt.readers for pt in points if pt.mode == mode})
        names = (name for r in readers for name in limits_for_mode(mode, cold, r))
        return list(dict.fromkeys(names))

    for run in range(runs):
        for name in extra_limits:
            limit(name)
        for mode in modes:
            for name in mode_limits(mode):
                say(f"run {run + 1}/{runs} {mode}: limit {name} {limit(name):.2f} GB/s")
            for pt in (q for q in points if q.mode == mode):
                ok = cache_for(cold)
                if cold:
                    drops.append(ok)
                settle(settle_s, touch_bytes=size, near=p)
                sample = load_in_subprocess(p, pt.overrides(check_tensors), config=config)
                samples[pt].append(sample)
                say(
                    f"  chunk {pt.chunk_bytes >> 20} MiB readers {pt.readers} "
                    f"queue {pt.queue_depth}: {sample.gbps:.2f} GB/s"
                )
    if pinned:
        h2d = pinned_copy_gbps()
        if h2d is None:
            notes.append("no GPU limit: CuPy is not importable or sees no GPU")
        else:
            limit_runs["pinned_h2d"] = [h2d]
    limits = {name: statistics.median(v) for name, v in limit_runs.items()}
    results = tuple(
        PointResult(
            pt, tuple(samples[pt]), *fastest(limits, limits_for_mode(pt.mode, cold, pt.readers))
        )
        for pt in points
    )
    mapped = sorted({pt.mode for pt in points if pt.mode in ("mmap", "mlock")})
    if mapped and check_tensors is not False and not cold:
        notes.append(
            f"{'/'.join(mapped)} with checks on: the load reads every byte to check it, its "
            "limit touches one byte per page; that ratio is the checks' price on a warm "
            "cache, not a slow load (--no-check times the load alone)"
        )
    if cold and drops and not all(drops):
        notes.append(
            f"the page cache could not be dropped before {drops.count(False)} of "
            f"{len(drops)} loads (tmpfs? pages mapped by another process?): those were warm"
        )
    return SweepResult(
        path=os.fspath(p),
        size_bytes=p.stat().st_size,
        runs=runs,
        cold=cold,
        cold_drop_ok=all(drops) if cold else None,
        check_tensors=check_tensors,
        limits=limits,
        limit_runs=limit_runs,
        points=results,
        notes=tuple(notes),
    )


def plot_sweep(result: SweepResult, out: str | os.PathLike[str]) -> str | None:
    """GB/s against chunk size, one panel per mode, one line per (readers, queue depth),
    the mode's limit as a horizontal line. Returns None, or why no plot was written
    (matplotlib missing: ``pip install 'aiogguf[plot]'``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        return "matplotlib is not installed (pip install 'aiogguf[plot]'): no plot written"
    modes = list(dict.fromkeys(p.point.mode for p in result.points))
    cols = min(2, len(modes))
    rows = (len(modes) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4 * rows), squeeze=False)
    for ax, mode in zip(axes.flat, modes, strict=False):
        mine = [p for p in result.points if p.point.mode == mode]
        series: dict[tuple[int, int], list[PointResult]] = {}
        for p in mine:
            series.setdefault((p.point.readers, p.point.queue_depth), []).append(p)
        for (readers, depth), pts in sorted(series.items()):
            pts.sort(key=lambda q: q.point.chunk_bytes)
            ax.plot(
                [q.point.chunk_bytes / 2**20 for q in pts],
                [q.gbps for q in pts],
                marker="o",
                label=f"readers {readers}, queue {depth}",
            )
        # The mode's own limit, and the disk for the others (it caps cold loads).
        shown = [mine[0].limit] + (["direct"] if mine[0].limit != "direct" else [])
        for style, name in zip(("-", "--"), shown, strict=False):
            if name in result.limits:
                ax.axhline(
                    result.limits[name],
                    color="black",
                    linestyle=style,
                    linewidth=1,
                    label=f"limit {name} {result.limits[name]:.2f} GB/s",
                )
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
        ax.set_xlabel("chunk size (MiB)")
        ax.set_ylabel("GB/s")
        ax.set_title(f"mode {mode}{' (cold)' if result.cold and mode != 'direct' else ''}")
        ax.legend(fontsize=7)
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(modes) :]:
        ax.set_visible(False)
    fig.suptitle(f"{Path(result.path).name}: {result.size_bytes / GB:.2f} GB, {result.runs} run(s)")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return None
