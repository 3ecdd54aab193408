"""One process of the GPU benchmarks (``gpu_check.py``, ``gpu_sim.py``): load steps run
in order in a fresh interpreter, one JSON line out per step.

    python -P bench/gpu_driver.py '{"path": "m.gguf", "steps": [...], "expected": null}'

Steps, run in one event loop (uvloop when installed, as ``load_sync`` does):

- ``{"op": "warm_up", "overrides": {...}}``: ``await aiogguf.warm_up(**overrides)``;
- ``{"op": "load", "overrides": {...}, "verify": false, "label": "..."}``: ``async with
  aiogguf.load(path, **overrides)`` timed from the call to the model being ready, while a
  ticker task sleeps 1 ms at a time and records how late it wakes (the loop lag a server
  would see). ``verify`` compares every tensor's fingerprint, computed where the tensor
  lives (CuPy on a GPU, numpy on the host), with ``expected`` (a JSON file written by the
  parent from the file's bytes);
- ``{"op": "release"}``: ``aiogguf.release_staging()``;
- ``{"op": "sleep", "seconds": s}``: a pause between steps.

Every step is measured in its own ``try``: a failure is recorded in that step's line
(``"ok": false, "error": ...``) and the next step runs. API the library does not have
yet (``warm_up``, ``release_staging``, ``report.uploads``) is reported as ``missing``.
Lines are printed as steps finish, so a crash or a timeout keeps the earlier ones.

The parent side is ``run_driver``; ``fingerprint`` is shared with the parents.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import asdict, is_dataclass
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np

MiB = 1024**2
GB = 1e9
TICK_S = 0.001
DRIVER = os.path.abspath(__file__)
# Fingerprint: sum over 8-byte little-endian words w[i] of w[i] * (i mod P + 1), mod 2**64.
# Position weights make swapped, shifted or misplaced chunks show; P keeps weights small.
_P = 65521
_FP_CHUNK_BYTES = 64 * MiB


# --- shared with the parents ------------------------------------------------------------


def fingerprint(xp: Any, data: Any) -> int:
    """Fingerprint of a 1-D uint8 array of ``xp`` (numpy, numpy.memmap or cupy)."""
    n = int(data.size)
    body = n - n % 8
    total = 0
    for start in range(0, body, _FP_CHUNK_BYTES):
        part = data[start : min(start + _FP_CHUNK_BYTES, body)]
        if xp is not np and int(part.data.ptr) % 8:
            part = part.copy()  # 8-byte loads on a GPU must be aligned
        elif xp is np and part.ctypes.data % 8:
            part = part.copy()
        words = part.view(xp.uint64)
        index = xp.arange(start // 8, start // 8 + words.size, dtype=xp.uint64)
        weights = index % xp.uint64(_P) + xp.uint64(1)
        total += int((words * weights).sum())  # uint64 arithmetic wraps mod 2**64
    if body < n:
        tail_part = data[body:]
        tail = bytes(tail_part.get() if xp is not np else tail_part)
        total += int.from_bytes(tail, "little") * ((body // 8) % _P + 1)
    return total % 2**64


def error_text(exc: BaseException) -> str:
    """One line naming the exception, then the innermost frames (for the JSON). A task
    group's exception group is named by its first leaf: that is the one that happened."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    frames = traceback.format_exception(type(exc), exc, exc.__traceback__)
    tail = "".join(frames[-3:]).strip()
    return f"{type(exc).__name__}: {exc}"[:2000] + "\n" + tail[-2000:]


def run_driver(
    task: Mapping[str, Any], timeout_s: float, env: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Run ``task`` in a fresh interpreter (``env`` added to this process's environment);
    never raises. Returns ``{"steps": [...], "returncode", "wall_s", "stderr_tail",
    "error"}``: the steps that finished, even when the process crashed or ran out of
    time."""
    start = time.perf_counter()
    out: dict[str, Any] = {"steps": [], "returncode": None, "error": None, "stderr_tail": ""}
    stdout: str | bytes | None = ""
    stderr: str | bytes | None = ""
    try:
        # -P: never put the working directory on sys.path (a repository root holds a
        # folder named io that would shadow the standard library).
        proc = subprocess.run(
            [sys.executable, "-P", DRIVER, json.dumps(task)],
            capture_output=True,
            text=True,
            timeout=max(1.0, timeout_s),
            check=False,
            cwd=os.path.dirname(os.path.abspath(task["path"])),
            env={**os.environ, **env} if env else None,
        )
        stdout, stderr = proc.stdout, proc.stderr
        out["returncode"] = proc.returncode
        if proc.returncode != 0:
            out["error"] = f"driver exited with status {proc.returncode}"
    except subprocess.TimeoutExpired as exc:
        stdout, stderr = exc.stdout, exc.stderr
        out["error"] = f"driver timed out after {timeout_s:.0f} s (killed)"
    except Exception as exc:  # could not start the interpreter at all
        out["error"] = error_text(exc)
    if isinstance(stdout, bytes):
        stdout = stdout.decode(errors="replace")
    if isinstance(stderr, bytes):
        stderr = stderr.decode(errors="replace")
    for line in (stdout or "").splitlines():
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                out["steps"].append(json.loads(line))
    out["stderr_tail"] = "\n".join((stderr or "").strip().splitlines()[-15:])
    out["wall_s"] = time.perf_counter() - start
    return out


def summarise(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians (GB/s, seconds, lag p99) and worsts (lag) over load steps of ``run_driver``."""
    ok = [s for s in samples if s.get("ok") and "gbps" in s]
    lags = [s["lag_ms"] for s in ok if "lag_ms" in s]
    uploads = [s["report"].get("uploads") for s in ok if "report" in s]
    return {
        "runs": len(samples),
        "ok_runs": len(ok),
        "gbps": _median([s["gbps"] for s in ok]),
        "runs_gbps": [s["gbps"] for s in ok],
        "seconds": _median([s["seconds"] for s in ok]),
        "lag_p99_ms": _median([lag["p99"] for lag in lags]),
        "lag_p99_ms_worst": max((lag["p99"] for lag in lags), default=None),
        "lag_max_ms": max((lag["max"] for lag in lags), default=None),
        "device_bytes": [s["report"]["device_bytes"] for s in ok if "report" in s],
        "uploads": uploads[:2],
        "stages_first": ok[0]["report"]["stages"] if ok and "report" in ok[0] else None,
        "errors": [s.get("error", "") for s in samples if not s.get("ok")],
    }


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


# --- the driver itself --------------------------------------------------------------------


def _lag_ms(lags_s: Sequence[float]) -> dict[str, float]:
    if not lags_s:
        return {"p50": 0.0, "p99": 0.0, "max": 0.0, "samples": 0}
    ms = np.asarray(lags_s) * 1e3
    return {
        "p50": float(np.percentile(ms, 50)),
        "p99": float(np.percentile(ms, 99)),
        "max": float(ms.max()),
        "samples": len(lags_s),
    }


def _plain(value: Any) -> Any:
    """A report (frozen dataclasses, tuples) as JSON types."""
    if is_dataclass(value) and not isinstance(value, type):
        return {k: _plain(v) for k, v in asdict(value).items()}
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return repr(value)


def _report(model: Any) -> dict[str, Any]:
    report = model.report
    out: dict[str, Any] = {
        "mode": report.mode,
        "nbytes": report.nbytes,
        "n_tensors": report.n_tensors,
        "total_s": report.total_s,
        "validated": report.validated,
        "stages": [
            {"name": s.name, "wall_s": s.wall_s, "busy_s": s.busy_s, "items": s.items}
            for s in report.stages
        ],
        "buffers": [_plain(b) for b in report.buffers],
        "warnings": list(report.warnings),
        # Bytes the plan put on a device (not the CPU): 0 means nothing was offloaded.
        "device_bytes": sum(b.nbytes for b in report.buffers if b.device != "CPU"),
    }
    uploads = getattr(report, "uploads", None)
    out["uploads"] = "missing" if uploads is None else _plain(uploads)
    return out


def _verify(model: Any, expected: Mapping[str, int]) -> dict[str, Any]:
    """Every tensor's fingerprint where it lives, against the file's."""
    cupy: Any = None
    if "cupy" in sys.modules:  # only a load that offloaded to a GPU imported it
        cupy = sys.modules["cupy"]
    on_device = device_bytes = 0
    bad: list[str] = []
    missing: list[str] = []
    for entry in model.index.tensors:
        if entry.name not in expected:
            missing.append(entry.name)
            continue
        array = model.tensors[entry.name]
        if cupy is not None and isinstance(array, cupy.ndarray):
            on_device += 1
            device_bytes += entry.nbytes
            with cupy.cuda.Device(array.device.id):
                got = fingerprint(cupy, array.reshape(-1).view(cupy.uint8))
        elif isinstance(array, np.ndarray):
            got = fingerprint(np, array.reshape(-1).view(np.uint8))
        else:  # a simulated device holds numpy arrays; anything else: its host copy
            got = fingerprint(np, np.frombuffer(model.raw(entry.name), np.uint8))
        if got != expected[entry.name]:
            bad.append(entry.name)
    return {
        "tensors": len(model.index.tensors),
        "tensors_on_gpu": on_device,
        "bytes_on_gpu": device_bytes,
        "mismatched": bad,
        "not_in_file": missing,
        "ok": not bad and not missing,
    }


async def _tick(lags: list[float]) -> None:
    while True:
        start = time.perf_counter()
        await anyio.sleep(TICK_S)
        lags.append(max(0.0, time.perf_counter() - start - TICK_S))


async def _with_ticker(fn: Any) -> tuple[Any, float, dict[str, float]]:
    """``await fn()`` while the ticker runs: (its result, seconds, lag)."""
    lags: list[float] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(_tick, lags)
        await anyio.lowlevel.checkpoint()  # the ticker sleeps before the work starts
        start = time.perf_counter()
        try:
            result = await fn()
        finally:
            seconds = time.perf_counter() - start
            taken = list(lags)
            tg.cancel_scope.cancel()
    return result, seconds, _lag_ms(taken)


async def _load_step(aiogguf: Any, path: str, step: Mapping[str, Any], expected: Any) -> Any:
    overrides = dict(step.get("overrides", {}))
    out: dict[str, Any] = {}
    handle = aiogguf.load(path, **overrides)
    model: Any = None

    async def enter() -> Any:
        return await handle.__aenter__()

    try:
        model, seconds, lag = await _with_ticker(enter)
        out.update(seconds=seconds, lag_ms=lag)
        out["report"] = _report(model)
        out["gbps"] = model.report.nbytes / seconds / GB if seconds > 0 else 0.0
        if step.get("verify") and expected is not None:
            t = time.perf_counter()
            try:
                out["verified"] = _verify(model, expected)
            except Exception as exc:  # the check failed to run: say so, keep the load
                out["verified"] = {"ok": False, "error": error_text(exc)}
            out["verify_s"] = time.perf_counter() - t
    finally:
        if model is not None:
            t = time.perf_counter()
            await handle.__aexit__(None, None, None)
            out["close_s"] = time.perf_counter() - t
    return out


async def _warm_up_step(aiogguf: Any, step: Mapping[str, Any]) -> Any:
    warm_up = getattr(aiogguf, "warm_up", None)
    if warm_up is None:
        return {"ok": False, "error": "missing: aiogguf.warm_up"}

    async def call() -> Any:
        return await warm_up(None, **dict(step.get("overrides", {})))

    result, seconds, lag = await _with_ticker(call)
    return {"seconds": seconds, "lag_ms": lag, "warm_up": _plain(result)}


async def _release_step(aiogguf: Any) -> Any:
    release = getattr(aiogguf, "release_staging", None)
    if release is None:
        return {"ok": False, "error": "missing: aiogguf.release_staging"}
    start = time.perf_counter()
    await release()
    return {"seconds": time.perf_counter() - start}


def _emit(record: Mapping[str, Any]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def main(argv: Sequence[str]) -> int:
    task = json.loads(argv[0])
    path = task["path"]
    import warnings

    warnings.simplefilter("ignore")  # load warnings come back in the report instead
    start = time.perf_counter()
    import aiogguf

    import_s = time.perf_counter() - start
    expected = None
    if task.get("expected"):
        with open(task["expected"], encoding="utf-8") as f:
            expected = {k: int(v) for k, v in json.load(f).items()}

    async def run_steps() -> None:
        idle: list[float] = []
        with anyio.move_on_after(0.2):
            await _tick(idle)
        _emit({"op": "start", "ok": True, "import_s": import_s, "idle_lag_ms": _lag_ms(idle)})
        for i, step in enumerate(task["steps"]):
            op = step.get("op")
            record: dict[str, Any] = {"op": op, "index": i, "label": step.get("label", op)}
            try:
                if op == "load":
                    result = await _load_step(aiogguf, path, step, expected)
                elif op == "warm_up":
                    result = await _warm_up_step(aiogguf, step)
                elif op == "release":
                    result = await _release_step(aiogguf)
                elif op == "sleep":
                    await anyio.sleep(float(step["seconds"]))
                    result = {}
                else:
                    result = {"ok": False, "error": f"unknown op {op!r}"}
                record.update({"ok": True, **result})
            except Exception as exc:  # recorded; the next step still runs
                record.update(ok=False, error=error_text(exc))
            _emit(record)

    try:
        import uvloop  # noqa: F401
    except ImportError:
        anyio.run(run_steps)
        loop = "asyncio"
    else:
        anyio.run(run_steps, backend_options={"use_uvloop": True})
        loop = "uvloop"
    _emit({"op": "end", "ok": True, "loop": loop, "wall_s": time.perf_counter() - start})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
