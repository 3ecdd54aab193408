"""Event-loop lag during the first load of a fresh process, with CuPy's start-up modelled.

On a GPU machine, importing CuPy and starting CUDA takes 0.5-1.1 s; the loader does it in
a worker thread, so the loop keeps answering as long as that start-up releases the GIL.
This script runs each load in a fresh process whose ``cupy`` is a stand-in: its import
sleeps ``--import-s`` (GIL released) and its device count sleeps then finds no device, as
CUDA does on a machine without one. A ticker task measures the loop's lag meanwhile. A
second row does the same without the stand-in (no CuPy at all).

    python bench/first_load_lag.py [--size 1GiB] [--dir DIR] [--runs 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from aiogguf.synth import ensure_synthetic_model

_STAND_IN = """\
import time
time.sleep({import_s})  # CuPy's import and CUDA's start-up, with the GIL released
class _Runtime:
    @staticmethod
    def getDeviceCount():
        time.sleep(0.15)
        raise RuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")
class cuda:
    runtime = _Runtime
"""

_DRIVER = """\
import json, sys, time, anyio, aiogguf
async def main():
    lags = []
    done = anyio.Event()
    async def ticker():
        while not done.is_set():
            t = time.perf_counter()
            await anyio.sleep(0.001)
            lags.append(time.perf_counter() - t - 0.001)
    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await anyio.sleep(0.05)
        t = time.perf_counter()
        async with aiogguf.load(sys.argv[1], mode="none") as model:
            seconds = time.perf_counter() - t
            nbytes = model.report.nbytes
        done.set()
    lags.sort()
    print(json.dumps({"seconds": seconds, "gbps": nbytes / seconds / 1e9,
                      "worst_lag_ms": lags[-1] * 1e3,
                      "p99_lag_ms": lags[int(len(lags) * 0.99)] * 1e3}))
anyio.run(main)
"""


def _run(path: Path, stand_in: Path | None) -> dict[str, Any]:
    env = dict(os.environ)
    if stand_in is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(stand_in), env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-c", _DRIVER, str(path)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--dir", default=os.path.expanduser("~/.cache/aiogguf"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--import-s", type=float, default=0.5)
    parser.add_argument("--json", action="store_true", help="print one JSON object only")
    args = parser.parse_args()
    path = Path(args.dir) / f"lag-{args.size}.gguf"
    model, _ = ensure_synthetic_model(path, size_bytes=args.size)
    with tempfile.TemporaryDirectory() as tmp:
        stand_in = Path(tmp)
        (stand_in / "cupy").mkdir()
        (stand_in / "cupy" / "__init__.py").write_text(_STAND_IN.format(import_s=args.import_s))
        rows: dict[str, list[dict[str, Any]]] = {"cupy stand-in": [], "no cupy": []}
        for _ in range(args.runs):  # alternated, so both see the same machine
            rows["cupy stand-in"].append(_run(model.path, stand_in))
            rows["no cupy"].append(_run(model.path, None))
    summary = {
        name: {
            key: statistics.median(r[key] for r in runs)
            for key in ("seconds", "gbps", "worst_lag_ms", "p99_lag_ms")
        }
        | {"worst_lag_ms_max": max(r["worst_lag_ms"] for r in runs)}
        for name, runs in rows.items()
    }
    if args.json:
        print(json.dumps({"size": args.size, "runs": args.runs, "results": summary}))
        return 0
    print(f"first load in a fresh process, {args.size}, mode none, medians of {args.runs}")
    for name, s in summary.items():
        print(
            f"  {name:14s} {s['gbps']:5.2f} GB/s  worst lag {s['worst_lag_ms']:5.1f} ms "
            f"(max {s['worst_lag_ms_max']:.1f})  p99 {s['p99_lag_ms']:.1f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
