"""A process's first loads, as the README's example runs them: ``import aiogguf`` alone,
then ``async with aiogguf.load(...)`` inside a running event loop. Run in a fresh
interpreter (``python -P first_use_worker.py '{"path": ..., "overrides": {...}, "loads": 2,
"warm_up": false}'``; ``warm_up``: ``await aiogguf.warm_up(**overrides)`` first).

An import hook (the first finder on ``sys.meta_path``) records the thread of every
import the interpreter has to look for: a module not yet in ``sys.modules``, found or
not (a failed ``import cupy`` searches the path too). While the loop runs, a ticker
sleeps 1 ms at a time and records how late it wakes (the loop lag a server would see),
and how much of that its thread spent on a run queue while other work held the cores.
One JSON object on stdout: the modules first imported on the loop's thread during
``warm_up``, and per load the modules first imported on the loop's thread,
those first imported elsewhere, the load's time and its lag (worst, p99).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.abc
import json
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any


class ImportRecorder(importlib.abc.MetaPathFinder):
    """Records ``(module, thread ident, phase)`` for every module the import system looks
    for; finds nothing itself, so the finders after it do the importing."""

    def __init__(self) -> None:
        self.phase = "start"
        self.records: list[tuple[str, int, str]] = []

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        self.records.append((fullname, threading.get_ident(), self.phase))
        return None


RECORDER = ImportRecorder()
sys.meta_path.insert(0, RECORDER)

# What the measurement itself uses, before the package, so that none of it is counted.
import warnings  # noqa: E402

warnings.simplefilter("ignore")  # a sim device's warnings are not the point here
began = time.perf_counter()
import aiogguf  # noqa: E402

IMPORT_S = time.perf_counter() - began
TICK_S = 0.001
LOOP = [0]  # the loop's thread, once it runs


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _run_queue_s() -> float:
    """How long this thread has waited on a run queue for a core, in all."""
    with open("/proc/thread-self/schedstat", encoding="ascii") as f:
        return int(f.read().split()[1]) / 1e9


async def _tick(lags: list[float], blocked: list[float]) -> None:
    while True:
        start, queued = time.perf_counter(), _run_queue_s()
        await asyncio.sleep(TICK_S)
        lag = max(0.0, time.perf_counter() - start - TICK_S)
        lags.append(lag)
        # The part of the lag not spent waiting for a core the machine's other work held.
        blocked.append(max(0.0, lag - (_run_queue_s() - queued)))


async def main(task: dict[str, Any]) -> list[dict[str, Any]]:
    path, overrides = task["path"], task.get("overrides", {})
    loop_thread = LOOP[0] = threading.get_ident()
    results: list[dict[str, Any]] = []
    if task.get("warm_up"):
        RECORDER.phase = "warm_up"
        await aiogguf.warm_up(**overrides)
        RECORDER.phase = "between"
    loads = int(task.get("loads", 1))
    for n in range(loads):
        phase = f"load{n}"
        lags: list[float] = []
        blocked: list[float] = []
        ticker = asyncio.create_task(_tick(lags, blocked))
        await asyncio.sleep(0)  # the ticker sleeps before the load starts
        RECORDER.phase = phase
        start = time.perf_counter()
        error, tensors = None, 0
        try:
            async with aiogguf.load(path, **overrides) as model:
                loaded = len(lags)
                tensors = len(model.tensors)
        except aiogguf.GGUFError as exc:  # a failed load's paths must not import either
            error = type(exc).__name__
        seconds = time.perf_counter() - start
        loaded = len(lags) if error else loaded
        RECORDER.phase = "between"
        ticker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await ticker
        on_loop = [m for m, t, p in RECORDER.records if p == phase and t == loop_thread]
        elsewhere = [m for m, t, p in RECORDER.records if p == phase and t != loop_thread]
        ms = [lag * 1e3 for lag in lags]
        results.append(
            {
                "load": n,
                "seconds": seconds,
                "tensors": tensors,
                "error": error,
                "imported_on_loop": on_loop,
                "imported_elsewhere": elsewhere,
                "lag_max_ms": max(ms, default=0.0),
                "lag_p99_ms": _percentile(ms, 0.99),
                "lag_max_loading_ms": max(ms[:loaded], default=0.0),
                "blocked_max_ms": max(blocked, default=0.0) * 1e3,
                "ticks": len(ms),
            }
        )
    return results


if __name__ == "__main__":
    loads = asyncio.run(main(json.loads(sys.argv[1])))
    warm_up_on_loop = [m for m, t, p in RECORDER.records if p == "warm_up" and t == LOOP[0]]
    print(json.dumps({"import_s": IMPORT_S, "loads": loads, "warm_up_on_loop": warm_up_on_loop}))
