"""``aiogguf.compat._reader.GGUFReader`` against gguf-py's ``GGUFReader``: open a model and read
every byte of every tensor.

Each run is a fresh process (this script with ``--worker``) that imports its reader, then
times ``GGUFReader(path)`` and a pass over ``reader.tensors`` that reads every byte of
each ``t.data`` (an XOR reduction, a few GB/s: what a consumer that copies each tensor
does, minus the copy). gguf-py maps the file and faults each page in when the pass
first touches it; aiogguf loads every tensor in the constructor (its ``"r"`` mode is
``mode="mmap"``: the mapped pages are populated by reader threads and checked) and the
pass finds them in memory. The readers alternate, the first one rotating run by run.
``warm``: the file is read whole before each run, so it is in the page cache; ``cold``:
it is dropped (``posix_fadvise(DONTNEED)``) before each run. The model is the benchmarks'
shared synthetic one (``ensure_bench_model``, Q4_K_M-like types).

Prints a table (medians, min-max) and the ratio gguf-py / aiogguf per case, and one
JSON object as the last line (also written to ``--json PATH``). Not part of the test run.

    python bench/compat_reader.py [--size 2GiB] [--runs 5] [--cases warm,cold]
                                  [--dir /var/tmp/aiogguf-compat] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

READERS = {
    "gguf-py": {},
    "aiogguf": {},
    "aiogguf, checks off": {"check_tensors": False},
}


def touch(data: Any) -> int:
    """Read every byte of ``data`` (a numpy array): XOR of its 8-byte words."""
    import numpy as np

    flat = data.reshape(-1).view(np.uint8)
    if flat.size % 8 == 0:
        flat = flat.view(np.uint64)
    return int(np.bitwise_xor.reduce(flat)) if flat.size else 0


def worker(reader: str, path: str) -> dict[str, Any]:
    import numpy  # noqa: F401 - imported before the clock, as every reader needs it

    if reader == "gguf-py":
        from gguf import GGUFReader as make
    else:
        from aiogguf.compat._reader import GGUFReader as make
    options = READERS[reader]
    start = time.perf_counter()
    opened = make(path, **options)
    open_s = time.perf_counter() - start
    checksum = 0
    for tensor in opened.tensors:
        checksum ^= touch(tensor.data)
    total_s = time.perf_counter() - start
    nbytes = sum(int(t.n_bytes) for t in opened.tensors)
    return {"open_s": open_s, "total_s": total_s, "nbytes": nbytes, "checksum": checksum}


def prepare(path: Path, case: str) -> None:
    if case == "warm":
        with open(path, "rb", buffering=0) as f:
            while f.read(64 << 20):
                pass
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run_worker(reader: str, path: Path) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, __file__, "--worker", reader, str(path)],
        capture_output=True,
        text=True,
        check=False,
        timeout=900,
    )
    if done.returncode != 0:
        raise SystemExit(f"{reader} failed: {done.stderr.strip().splitlines()[-1:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    totals = [s["total_s"] for s in samples]
    return {
        "total_s": statistics.median(totals),
        "min_s": min(totals),
        "max_s": max(totals),
        "open_s": statistics.median(s["open_s"] for s in samples),
        "gb_per_s": samples[0]["nbytes"] / statistics.median(totals) / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="2GiB", help="model size (default 2GiB)")
    parser.add_argument("--runs", type=int, default=5, help="runs per reader and case")
    parser.add_argument("--cases", default="warm,cold", help="warm, cold or both")
    parser.add_argument("--dir", default="/var/tmp/aiogguf-compat", help="where the model is")
    parser.add_argument("--json", type=Path, help="also write the JSON result here")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return
    from aiogguf.testing.synth_cache import ensure_bench_model

    Path(args.dir).mkdir(parents=True, exist_ok=True)
    path, written = ensure_bench_model(args.dir, args.size)
    print(f"model {path} ({'written' if written else 'reused'})", file=sys.stderr)
    cases = [c for c in args.cases.split(",") if c]
    names = list(READERS)
    result: dict[str, Any] = {"model": str(path), "file_bytes": path.stat().st_size}
    result["load_average"] = [round(x, 1) for x in os.getloadavg()]
    for case in cases:
        samples: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
        for i in range(args.runs):
            order = names[i % len(names) :] + names[: i % len(names)]
            for name in order:
                prepare(path, case)
                sample = run_worker(name, path)
                samples[name].append(sample)
                print(f"{case} run {i + 1} {name}: {sample['total_s']:.2f} s", file=sys.stderr)
        checksums = {s["checksum"] for ss in samples.values() for s in ss}
        assert len(checksums) == 1, "the readers read different bytes"
        stats = {n: summary(s) for n, s in samples.items()}
        for name in names:
            stats[name]["ratio"] = stats["gguf-py"]["total_s"] / stats[name]["total_s"]
        result[case] = stats
    result["load_average_after"] = [round(x, 1) for x in os.getloadavg()]
    print(format_table(result, cases))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


def format_table(result: dict[str, Any], cases: list[str]) -> str:
    lines = [
        "| page cache | reader | open + read every byte, median (min-max) | of it: open | GB/s "
        "| gguf-py / this |",
        "|---|---|---|---|---|---|",
    ]
    for case in cases:
        for name, s in result[case].items():
            lines.append(
                f"| {case} | {name} | {s['total_s']:.2f} s ({s['min_s']:.2f}-{s['max_s']:.2f}) "
                f"| {s['open_s']:.2f} s | {s['gb_per_s']:.2f} | {s['ratio']:.2f}x |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
