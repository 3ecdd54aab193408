"""This machine's limits for reading one file into host memory, in GB/s.

No loader can beat ``preadv`` into memory that is already touched (warm cache: memory
bandwidth; cold: the disk), and ``O_DIRECT`` shows the disk without the page cache. The
measurements live in ``aiogguf.testing.baselines`` (the benchmarks measure them in the same run as
the loads); this script writes a test file and prints them all. Not part of the test run.

    python bench/baselines.py [--size 2GiB] [--dir /var/tmp] [--runs 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from aiogguf._units import parse_size
from aiogguf.testing import baselines


def write_test_file(path: Path, nbytes: int, seed: int = 0) -> None:
    """Random (incompressible) bytes, fsynced so the cache can be dropped afterwards."""
    block = np.random.default_rng(seed).integers(0, 256, 64 << 20, dtype=np.uint8)
    with open(path, "wb") as out:
        written = 0
        while written < nbytes:
            piece = block[: min(len(block), nbytes - written)]
            out.write(piece.data)
            written += len(piece)
        out.flush()
        os.fsync(out.fileno())


def measure_all(path: Path, *, threads: int, runs: int) -> dict[str, float]:
    """Every limit, in GB/s, keyed by name (``*_warm``: the file in the page cache)."""
    size = path.stat().st_size
    return {
        "preadv_fresh_warm": baselines.preadv_fresh_gbps(path, threads=threads, runs=runs),
        "preadv_touched_warm": baselines.preadv_touched_gbps(path, threads=threads, runs=runs),
        "preadv_fresh_cold": baselines.preadv_fresh_gbps(
            path, threads=threads, cold=True, runs=runs
        ),
        "direct": baselines.direct_gbps(path, threads=threads, runs=runs),
        "direct_fresh": baselines.direct_gbps(path, threads=threads, runs=runs, fresh=True),
        "memcpy": baselines.memcpy_gbps(size, threads=threads, runs=runs),
        "np_memmap_touch_warm": size / baselines.np_memmap_touch_s(path) / baselines.GB,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="2GiB", help="test file size (default 2GiB)")
    parser.add_argument("--dir", default="/var/tmp", help="where to write it (not tmpfs)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args()
    nbytes = parse_size(args.size)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="aiogguf-limits-") as tmp:
        path = Path(tmp) / "limits.bin"
        write_test_file(path, nbytes)
        results = measure_all(path, threads=args.threads, runs=args.runs)
    if args.json:
        print(json.dumps({"file_bytes": nbytes, "threads": args.threads, "gbps": results}))
        return
    print(f"file {args.size} in {args.dir}, {args.threads} threads, median of {args.runs}:")
    for name, rate in results.items():
        print(f"  {name:<22} {rate:6.2f} GB/s")


if __name__ == "__main__":
    main()
