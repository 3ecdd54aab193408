"""Where a warm host ``none`` load's time goes, beside the limit's: a per-phase timeline.

Two kinds of fresh process, alternated ``--runs`` times after the same spacer and pause
(``aiogguf.testing.bench.settle``), the file warm in the page cache each time:

- ``load``: ``aiogguf.load(path, mode="none", n_gpu_layers=0)`` (checks on, the default,
  or off: ``--checks``), timed from the call to the model in hand, with every reader's
  job timed on its thread (``Reader.read`` wrapped, and ``HostImage.back`` within it:
  the backing of the image's pages before a read lands there), the load's stage times
  from its report, and the process's page faults, context switches and CPU time.
- ``limit``: two threads (one per core, up to 16) ``preadv`` the file 64 MiB at a time
  into fresh memory, each chunk's pages backed in one call first (``MADV_POPULATE_WRITE``,
  ``bench/load.py``'s ``preadv_fresh_backed``, the fastest of its limits on a VM that
  hands freed memory back; ``--plain-limit``: faulted in by the read), each read timed
  on its thread.

For each it prints: the wall time and GB/s; per reader, when it started its first read
and ended its last (from the clock's start), its busy and idle time, and the idle time
before its first read and after its last (until the model is in hand); the time spent
backing pages; page faults, voluntary/involuntary context switches and CPU (user, sys)
per GB. The medians over the runs come last, with the load's share of the limit. With
``--strace`` one more run of each under ``strace -c -f`` counts the system calls per GB
(strace slows everything: its run is not timed). GIL time is ``bench/gil_budget.py``'s.

    python bench/timeline.py [--size 2GiB] [--runs 5] [--checks on|off|both]
                             [--dir /work/bench-data] [--settle 3] [--strace] [--json PATH]
                             [--base-python BASE/.venv/bin/python]   # an A/B, alternated
    python bench/timeline.py --patterns [--runs 6]   # backing patterns, without the loader

``--patterns``: two threads back fresh memory and read the file into it in three ways
(``PATTERNS``: as a load did at ``5df39a8``, each chunk backed first, a unit per reader),
alternated in fresh processes: GB/s and CPU seconds per GB.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

GB = 1e9
MiB = 1 << 20
CHUNK = 64 * MiB
_TIMEOUT_S = 900.0


# --- inside a worker process ---------------------------------------------------------------


class _Spans:
    """(thread name, start, end, bytes) of each timed call, from any thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.items: list[tuple[str, float, float, int]] = []

    def add(self, start: float, end: float, nbytes: int) -> None:
        with self.lock:
            self.items.append((threading.current_thread().name, start, end, nbytes))


def _usage() -> dict[str, float]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "user_s": ru.ru_utime,
        "sys_s": ru.ru_stime,
        "minflt": ru.ru_minflt,
        "majflt": ru.ru_majflt,
        "nvcsw": ru.ru_nvcsw,
        "nivcsw": ru.ru_nivcsw,
    }


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in before}


def _load_worker(path: str, checks: bool) -> dict[str, Any]:
    import anyio

    import aiogguf
    from aiogguf._images import HostImage
    from aiogguf.stages.read import Reader

    reads, backs = _Spans(), _Spans()
    plain_read, plain_back = Reader.read, HostImage.back

    def read(self: Reader, job: Any) -> None:
        start = time.perf_counter()
        plain_read(self, job)
        reads.add(start, time.perf_counter(), job.useful_end - job.useful_start)

    def back(self: HostImage, job: Any) -> bool:
        start = time.perf_counter()
        done = plain_back(self, job)
        backs.add(start, time.perf_counter(), job.nbytes)
        return done

    Reader.read = read  # type: ignore[method-assign]
    HostImage.back = back  # type: ignore[method-assign]
    import gc

    gc.collect()

    async def main() -> dict[str, Any]:
        usage = _usage()
        t0 = time.perf_counter()
        async with aiogguf.load(path, mode="none", n_gpu_layers=0, check_tensors=checks) as model:
            ready = time.perf_counter()
            used = _delta(usage, _usage())
            report = model.report
        closed = time.perf_counter()
        return {
            "t0": t0,
            "ready_s": ready - t0,
            "close_s": closed - ready,
            "nbytes": report.nbytes,
            "usage": used,
            "stages": [
                {"name": s.name, "start_s": s.start_s, "end_s": s.end_s, "busy_s": s.busy_s}
                for s in report.stages
            ],
        }

    out = anyio.run(main)
    t0 = out.pop("t0")
    out["reads"] = [(n, s - t0, e - t0, b) for n, s, e, b in reads.items]
    out["backs"] = [(n, s - t0, e - t0, b) for n, s, e, b in backs.items]
    return out


def _limit_worker(path: str, backed: bool) -> dict[str, Any]:
    from aiogguf.io.buffers import HostBuffer
    from aiogguf.io.files import open_file
    from aiogguf.io.workers import at_load_priority
    from aiogguf.testing.bench import LIMIT_THREADS

    at_load_priority()  # as bench/load.py's limits: the readers' CPU priority
    nbytes = os.path.getsize(path)
    chunks = iter(range(0, nbytes, CHUNK))
    lock = threading.Lock()
    reads = _Spans()
    with open_file(path) as f:
        buffer = HostBuffer(nbytes)
        view = buffer.memoryview

        go = threading.Event()

        def worker() -> None:
            go.wait()
            while True:
                with lock:
                    off = next(chunks, None)
                if off is None:
                    return
                n = min(CHUNK, nbytes - off)
                start = time.perf_counter()
                if backed:
                    buffer.populate(off, off + n)
                f.read_into(view[off : off + n], off)
                reads.add(start, time.perf_counter(), n)

        # Started before the clock, released together: the limit is its threads reading.
        threads = [threading.Thread(target=worker, name=f"limit-{i}") for i in range(LIMIT_THREADS)]
        for t in threads:
            t.start()
        usage = _usage()
        t0 = time.perf_counter()
        go.set()
        for t in threads:
            t.join()
        ready = time.perf_counter()
        used = _delta(usage, _usage())
        view.release()
        buffer.close()
    return {
        "ready_s": ready - t0,
        "nbytes": nbytes,
        "usage": used,
        "stages": [],
        "reads": [(n, s - t0, e - t0, b) for n, s, e, b in reads.items],
        "backs": [],
    }


# ``--patterns``: how two threads back fresh memory and read into it, without the loader.
PATTERNS = ("shared_units", "per_chunk", "unit_per_reader")
_UNIT = 256 * MiB
_FAULTING_CALL = 8 * MiB


def _pattern_worker(path: str, pattern: str) -> dict[str, Any]:
    """Two threads read the file 64 MiB at a time into fresh memory, backing it as
    ``pattern`` says: ``shared_units``, as a load did at ``5df39a8`` (chunks handed out one
    at a time; the first chunk to reach a 256 MiB unit backs all of it, a chunk whose
    unit another thread is still backing reads in 8 MiB calls, faulting its pages in);
    ``per_chunk``, each chunk backed by its reader just before its read (the limit);
    ``unit_per_reader``, a thread takes a whole unit, backs it, then reads its chunks (a
    load now). Returns GB/s and CPU seconds per GB."""
    from aiogguf.io.buffers import HostBuffer
    from aiogguf.io.files import open_file
    from aiogguf.io.workers import at_load_priority
    from aiogguf.testing.bench import LIMIT_THREADS

    at_load_priority()
    nbytes = os.path.getsize(path)
    chunks = iter([(o, min(CHUNK, nbytes - o)) for o in range(0, nbytes, CHUNK)])
    units = iter(range(-(-nbytes // _UNIT)))
    lock = threading.Lock()
    claimed: set[int] = set()
    backed: set[int] = set()
    with open_file(path) as f, HostBuffer(nbytes) as buffer:
        view = buffer.memoryview

        def shared_units() -> None:
            while True:
                with lock:
                    item = next(chunks, None)
                if item is None:
                    return
                off, n = item
                first, last = off // _UNIT, (off + n - 1) // _UNIT
                with lock:
                    mine = [u for u in range(first, last + 1) if u not in claimed]
                    claimed.update(mine)
                    busy = any(u not in mine and u not in backed for u in range(first, last + 1))
                for u in mine:
                    buffer.populate(u * _UNIT, (u + 1) * _UNIT)
                    backed.add(u)
                f.read_into(view[off : off + n], off, max_call=_FAULTING_CALL if busy else 0)

        def per_chunk() -> None:
            while True:
                with lock:
                    item = next(chunks, None)
                if item is None:
                    return
                off, n = item
                buffer.populate(off, off + n)
                f.read_into(view[off : off + n], off)

        def unit_per_reader() -> None:
            while True:
                with lock:
                    unit = next(units, None)
                if unit is None:
                    return
                lo, hi = unit * _UNIT, min(nbytes, (unit + 1) * _UNIT)
                buffer.populate(lo, hi)
                for off in range(lo, hi, CHUNK):
                    n = min(CHUNK, hi - off)
                    f.read_into(view[off : off + n], off)

        target = {"shared_units": shared_units, "per_chunk": per_chunk}.get(
            pattern, unit_per_reader
        )
        threads = [threading.Thread(target=target) for _ in range(LIMIT_THREADS)]
        usage = _usage()
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
        used = _delta(usage, _usage())
        view.release()
    gb = nbytes / GB
    return {"gbps": gb / wall, "cpu_s_per_gb": (used["user_s"] + used["sys_s"]) / gb}


def run_patterns(
    path: Path, runs: int, settle_s: float, say: Callable[[str], None]
) -> dict[str, Any]:
    """``PATTERNS`` alternated, ``runs`` times each, fresh processes: medians."""
    from aiogguf.io.pagecache import drop_from_cache
    from aiogguf.testing.baselines import PageCache
    from aiogguf.testing.bench import settle

    cache = PageCache(evictable=drop_from_cache(path))
    got: dict[str, list[dict[str, float]]] = {p: [] for p in PATTERNS}
    loadavg = [os.getloadavg()]
    for r in range(runs):
        for pattern in PATTERNS if r % 2 == 0 else tuple(reversed(PATTERNS)):
            cache.make(path, "warm")
            settle(settle_s, touch_bytes=path.stat().st_size, near=path)
            got[pattern].append(
                run_worker({"what": "pattern", "pattern": pattern, "path": os.fspath(path)})
            )
    loadavg.append(os.getloadavg())
    say(f"backing patterns, {runs} runs, load average {loadavg[0][0]:.2f} → {loadavg[1][0]:.2f}")
    medians = {}
    for pattern, samples in got.items():
        gbps = statistics.median(s["gbps"] for s in samples)
        cpu = statistics.median(s["cpu_s_per_gb"] for s in samples)
        medians[pattern] = {"gbps": gbps, "cpu_s_per_gb": cpu}
        say(f"  {pattern:<16} {gbps:5.2f} GB/s   CPU {cpu:.3f} s/GB")
    return {"path": os.fspath(path), "runs": runs, "load_average": loadavg, "patterns": medians}


def worker_main(task: dict[str, Any]) -> dict[str, Any]:
    """One timed load, limit or backing pattern, in this (fresh) process."""
    if task["what"] == "pattern":
        return _pattern_worker(task["path"], task["pattern"])
    if task["what"] == "limit":
        return _limit_worker(task["path"], task.get("backed", True))
    return _load_worker(task["path"], task["checks"])


# --- the parent -----------------------------------------------------------------------------


def run_worker(
    task: dict[str, Any], wrap: Sequence[str] = (), python: str = sys.executable
) -> dict[str, Any]:
    """``worker_main(task)`` in a fresh interpreter (``python``: another install's, for an
    A/B; under ``wrap``, e.g. strace)."""
    proc = subprocess.run(
        [*wrap, python, "-P", os.path.abspath(__file__), "--worker", json.dumps(task)],
        capture_output=True,
        text=True,
        timeout=_TIMEOUT_S,
        check=False,
        cwd=os.path.dirname(task["path"]),
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = " / ".join(proc.stderr.strip().splitlines()[-8:])
        raise RuntimeError(f"worker {task['what']} failed (exit {proc.returncode}): {tail}")
    answer: dict[str, Any] = json.loads(lines[-1])
    answer["stderr"] = proc.stderr
    return answer


def timeline(sample: dict[str, Any]) -> dict[str, Any]:
    """What one sample says: per reader its first start, last end, busy and idle time,
    and the load's idle time before the first read and after the last."""
    end = sample["ready_s"]
    per: dict[str, dict[str, float]] = {}
    for name, start, stop, nbytes in sample["reads"]:
        r = per.setdefault(name, {"first": start, "last": stop, "busy": 0.0, "jobs": 0, "bytes": 0})
        r["first"] = min(r["first"], start)
        r["last"] = max(r["last"], stop)
        r["busy"] += stop - start
        r["jobs"] += 1
        r["bytes"] += nbytes
    for r in per.values():
        r["idle_start"] = r["first"]
        r["idle_end"] = end - r["last"]
        r["idle_between"] = (r["last"] - r["first"]) - r["busy"]
    backing = sum(stop - start for _, start, stop, _ in sample["backs"])
    first = min((r["first"] for r in per.values()), default=0.0)
    last = max((r["last"] for r in per.values()), default=0.0)
    gb = sample["nbytes"] / GB
    usage = sample["usage"]
    return {
        "wall_s": end,
        "gbps": gb / end if end else 0.0,
        "first_read_s": first,
        "after_last_read_s": end - last,
        "readers": per,
        "reader_idle_s": sum(
            r["idle_start"] + r["idle_end"] + r["idle_between"] for r in per.values()
        ),
        "backing_s": backing,
        "faults_per_gb": usage["minflt"] / gb,
        "vcsw_per_gb": usage["nvcsw"] / gb,
        "ivcsw_per_gb": usage["nivcsw"] / gb,
        "user_s_per_gb": usage["user_s"] / gb,
        "sys_s_per_gb": usage["sys_s"] / gb,
        "stages": sample["stages"],
        "close_s": sample.get("close_s", 0.0),
    }


def strace_counts(task: dict[str, Any]) -> dict[str, dict[str, float]] | None:
    """System calls per GB of one untimed run under ``strace -c -f`` (None: no strace)."""
    strace = shutil.which("strace")
    if strace is None:
        return None
    with tempfile.NamedTemporaryFile("r", suffix=".strace") as out:
        sample = run_worker(task, wrap=(strace, "-c", "-f", "-o", out.name))
        text = Path(out.name).read_text(encoding="utf-8")
    gb = sample["nbytes"] / GB
    counts: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        parts = line.split()
        # % time, seconds, usecs/call, calls, [errors], syscall
        if len(parts) >= 5 and parts[0].replace(".", "").isdigit() and parts[-1] != "total":
            calls = int(parts[3])
            counts[parts[-1]] = {"calls_per_gb": calls / gb, "seconds": float(parts[1])}
    return counts


def _fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:7.1f}"


def print_sample(label: str, t: dict[str, Any], say: Callable[[str], None]) -> None:
    say(
        f"{label}: {t['wall_s'] * 1e3:.0f} ms, {t['gbps']:.2f} GB/s; first read at "
        f"{t['first_read_s'] * 1e3:.1f} ms, {t['after_last_read_s'] * 1e3:.1f} ms from the "
        f"last read's end to ready; backing {t['backing_s'] * 1e3:.0f} ms; faults/GB "
        f"{t['faults_per_gb']:.0f}, csw/GB {t['vcsw_per_gb']:.0f}+{t['ivcsw_per_gb']:.0f}, "
        f"cpu/GB user {t['user_s_per_gb'] * 1e3:.0f} sys {t['sys_s_per_gb'] * 1e3:.0f} ms"
    )
    for name, r in sorted(t["readers"].items()):
        say(
            f"    {name:<22} jobs {r['jobs']:3} first {_fmt_ms(r['first'])} last "
            f"{_fmt_ms(r['last'])} busy {_fmt_ms(r['busy'])} idle: start "
            f"{_fmt_ms(r['idle_start'])} between {_fmt_ms(r['idle_between'])} end "
            f"{_fmt_ms(r['idle_end'])} ms"
        )


def _median_of(samples: list[dict[str, Any]], key: str) -> float:
    return statistics.median(s[key] for s in samples)


def run(
    path: Path,
    runs: int,
    checks: Sequence[bool],
    settle_s: float,
    say: Callable[[str], None],
    base_python: str | None = None,
    backed: bool = True,
) -> dict[str, Any]:
    from aiogguf.io.pagecache import drop_from_cache
    from aiogguf.testing.baselines import PageCache
    from aiogguf.testing.bench import settle

    cache = PageCache(evictable=drop_from_cache(path))
    size = path.stat().st_size
    kinds = ["limit", *(f"load_checks_{'on' if c else 'off'}" for c in checks)]
    if base_python is not None:
        kinds += [f"base_load_checks_{'on' if c else 'off'}" for c in checks]
    samples: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    loadavg = [os.getloadavg()]
    for r in range(runs):
        order = kinds if r % 2 == 0 else list(reversed(kinds))
        say(f"run {r + 1}/{runs} (load average {os.getloadavg()[0]:.2f})")
        for kind in order:
            cache.make(path, "warm")
            settle(settle_s, touch_bytes=size, near=path)
            task: dict[str, Any] = {"what": "limit" if kind == "limit" else "load"}
            task.update(path=os.fspath(path), checks=kind.endswith("_on"), backed=backed)
            python = base_python if kind.startswith("base_") and base_python else sys.executable
            t = timeline(run_worker(task, python=python))
            samples[kind].append(t)
            print_sample(f"  {kind}", t, say)
    loadavg.append(os.getloadavg())
    medians: dict[str, dict[str, float]] = {}
    for kind, got in samples.items():
        medians[kind] = {
            key: _median_of(got, key)
            for key in (
                "wall_s",
                "gbps",
                "first_read_s",
                "after_last_read_s",
                "reader_idle_s",
                "backing_s",
                "faults_per_gb",
                "vcsw_per_gb",
                "ivcsw_per_gb",
                "user_s_per_gb",
                "sys_s_per_gb",
            )
        }
    # Each load's share of the limit, run by run (the limit of the same run).
    for kind in kinds[1:]:
        medians[kind]["of_limit"] = statistics.median(
            s["gbps"] / lim["gbps"] for s, lim in zip(samples[kind], samples["limit"], strict=True)
        )
    return {
        "path": os.fspath(path),
        "runs": runs,
        "load_average": loadavg,
        "samples": samples,
        "medians": medians,
    }


def print_medians(result: dict[str, Any], say: Callable[[str], None]) -> None:
    (b1, _, _), (a1, _, _) = result["load_average"]
    say(f"\nmedians of {result['runs']} runs, load average {b1:.2f} → {a1:.2f}")
    say(
        f"{'':<18}{'ms':>7}{'GB/s':>7}{'of limit':>9}{'1st read':>9}{'tail':>7}{'idle':>7}"
        f"{'backing':>8}{'flt/GB':>8}{'csw/GB':>8}{'usr/GB':>7}{'sys/GB':>7}"
    )
    for kind, m in result["medians"].items():
        say(
            f"{kind:<18}{m['wall_s'] * 1e3:7.0f}{m['gbps']:7.2f}"
            f"{m.get('of_limit', 1.0):9.2f}{m['first_read_s'] * 1e3:9.1f}"
            f"{m['after_last_read_s'] * 1e3:7.1f}{m['reader_idle_s'] * 1e3:7.0f}"
            f"{m['backing_s'] * 1e3:8.0f}{m['faults_per_gb']:8.0f}"
            f"{m['vcsw_per_gb'] + m['ivcsw_per_gb']:8.0f}{m['user_s_per_gb'] * 1e3:7.0f}"
            f"{m['sys_s_per_gb'] * 1e3:7.0f}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="2GiB")
    parser.add_argument("--dir", default="/work/bench-data")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--checks", choices=("on", "off", "both"), default="both")
    parser.add_argument("--settle", type=float, default=3.0)
    parser.add_argument("--strace", action="store_true", help="count system calls too")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument(
        "--base-python",
        metavar="PYTHON",
        help="also time the loads of another install (a worktree of the base commit)",
    )
    parser.add_argument("--plain-limit", action="store_true", help="the limit faults pages in")
    parser.add_argument(
        "--patterns", action="store_true", help="only the backing patterns, without the loader"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker_main(json.loads(args.worker))))
        return 0
    from aiogguf.testing.synth_cache import ensure_bench_model

    path, _ = ensure_bench_model(args.dir, args.size)
    checks = {"on": [True], "off": [False], "both": [True, False]}[args.checks]
    if args.patterns:
        found = run_patterns(path, args.runs, args.settle, print)
        if args.json:
            Path(args.json).write_text(json.dumps(found, indent=2) + "\n", encoding="utf-8")
        return 0

    def say(text: str) -> None:
        print(text, flush=True)

    result = run(path, args.runs, checks, args.settle, say, args.base_python, not args.plain_limit)
    print_medians(result, say)
    if args.strace:
        say("\nsystem calls per GB (strace -c -f, one untimed run each):")
        counted: dict[str, Any] = {}
        for kind in result["medians"]:
            task = {"what": "limit" if kind == "limit" else "load", "path": os.fspath(path)}
            task["checks"] = kind.endswith("_on")
            task["backed"] = not args.plain_limit
            found = strace_counts(task)
            counted[kind] = found
            if found is None:
                say("  strace is not installed")
                break
            top = sorted(found.items(), key=lambda kv: -kv[1]["calls_per_gb"])[:8]
            say(f"  {kind}: " + ", ".join(f"{n} {v['calls_per_gb']:.0f}" for n, v in top))
        result["strace"] = counted
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
