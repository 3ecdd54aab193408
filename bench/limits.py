"""The machine's own limits for reading one file into host memory, in GB/s.

These are the numbers a load is compared with: no loader can beat ``preadv`` into
memory that is already touched (warm cache: memory bandwidth; cold: the disk), and
``O_DIRECT`` shows the disk without the page cache. Each function returns the median
of ``runs`` runs; ``main`` writes a test file and prints them all. Not part of the test
run.

    python bench/limits.py [--size 2GiB] [--dir /var/tmp] [--runs 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from aiogguf.io.buffers import HostBuffer
from aiogguf.io.files import align_up, open_file
from aiogguf.io.mapping import open_mapping
from aiogguf.io.pagecache import drop_from_cache
from aiogguf.units import parse_size

CHUNK_BYTES = 64 << 20
GB = 1e9


def write_test_file(path: Path, nbytes: int, seed: int = 0) -> None:
    """Random (incompressible) bytes, fsynced so the cache can be dropped afterwards."""
    rng = np.random.default_rng(seed)
    block = rng.integers(0, 256, 64 << 20, dtype=np.uint8)
    with open(path, "wb") as out:
        written = 0
        while written < nbytes:
            piece = block[: min(len(block), nbytes - written)]
            out.write(piece.data)
            written += len(piece)
        out.flush()
        os.fsync(out.fileno())


def _chunks(nbytes: int, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    for offset in range(0, nbytes, chunk_bytes):
        yield offset, min(chunk_bytes, nbytes - offset)


def _parallel(
    threads: int, work: Iterator[tuple[int, int]], step: Callable[[int, int], None]
) -> None:
    """Run ``step(offset, nbytes)`` for every chunk on ``threads`` threads."""
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker() -> None:
        while True:
            with lock:
                item = next(work, None)
            if item is None or errors:
                return
            try:
                step(*item)
            except BaseException as exc:
                errors.append(exc)
                return

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    if errors:
        raise errors[0]


def _median_gbps(
    runs: int, nbytes: int, prepare: Callable[[], None], run: Callable[[], None]
) -> float:
    rates = []
    for _ in range(runs):
        prepare()
        start = time.perf_counter()
        run()
        rates.append(nbytes / (time.perf_counter() - start) / GB)
    return statistics.median(rates)


def _prepare(path: Path, cold: bool) -> Callable[[], None]:
    def prepare() -> None:
        if cold:
            if not drop_from_cache(path):
                raise RuntimeError(f"{path}: cannot drop it from the page cache (tmpfs?)")
        else:
            with open(path, "rb") as warm:
                while warm.read(64 << 20):
                    pass

    return prepare


def preadv_fresh_gbps(
    path: Path,
    *,
    threads: int = 2,
    cold: bool = False,
    runs: int = 3,
    chunk_bytes: int = CHUNK_BYTES,
    huge_pages: bool = False,
) -> float:
    """``preadv`` into a new, never-touched page-aligned buffer each run (faults counted)."""
    nbytes = path.stat().st_size
    with open_file(path) as f:

        def run() -> None:
            with HostBuffer(nbytes, huge_pages=huge_pages) as buf:
                view = buf.memoryview
                _parallel(
                    threads,
                    _chunks(nbytes, chunk_bytes),
                    lambda off, n: f.read_into(view[off : off + n], off),
                )

        return _median_gbps(runs, nbytes, _prepare(path, cold), run)


def prefault_gbps(nbytes: int, *, runs: int = 3, huge_pages: bool = False) -> float:
    """How fast fresh anonymous memory gets backed (``HostBuffer.prefault``)."""

    def run() -> None:
        with HostBuffer(nbytes, huge_pages=huge_pages) as buf:
            buf.prefault()

    return _median_gbps(runs, nbytes, lambda: None, run)


def preadv_touched_gbps(
    path: Path,
    *,
    threads: int = 2,
    cold: bool = False,
    runs: int = 3,
    chunk_bytes: int = CHUNK_BYTES,
) -> float:
    """``preadv`` into a buffer whose pages are already backed (no page faults)."""
    nbytes = path.stat().st_size
    with open_file(path) as f, HostBuffer(nbytes, prefault=True) as buf:
        view = buf.memoryview

        def run() -> None:
            _parallel(
                threads,
                _chunks(nbytes, chunk_bytes),
                lambda off, n: f.read_into(view[off : off + n], off),
            )

        return _median_gbps(runs, nbytes, _prepare(path, cold), run)


def direct_gbps(
    path: Path, *, threads: int = 2, runs: int = 3, chunk_bytes: int = CHUNK_BYTES
) -> float:
    """``O_DIRECT`` reads of aligned chunks into touched memory (the disk, no cache)."""
    nbytes = path.stat().st_size
    with (
        open_file(path, direct=True) as f,
        HostBuffer(align_up(nbytes, chunk_bytes), prefault=True) as buf,
    ):
        if not f.direct_ok:
            raise RuntimeError(f"{path}: O_DIRECT refused: {f.direct_refusal}")
        view = buf.memoryview

        def run() -> None:
            _parallel(
                threads,
                _chunks(nbytes, chunk_bytes),
                lambda off, n: f.read_direct_into(view[off : off + align_up(n, 4096)], off),
            )

        return _median_gbps(runs, nbytes, _prepare(path, cold=True), run)


def mmap_touch_gbps(
    path: Path,
    *,
    threads: int = 2,
    cold: bool = False,
    runs: int = 3,
    chunk_bytes: int = CHUNK_BYTES,
) -> float:
    """Map the whole file and make it resident chunk by chunk (the mmap mode's work)."""
    nbytes = path.stat().st_size

    def run() -> None:
        with open_mapping(path, 0, nbytes) as m:
            _parallel(threads, _chunks(nbytes, chunk_bytes), lambda off, n: m.touch(off, off + n))

    return _median_gbps(runs, nbytes, _prepare(path, cold), run)


def measure_all(path: Path, *, threads: int = 2, runs: int = 3) -> dict[str, float]:
    """Every limit, in GB/s, keyed by name (``*_warm``: file in the page cache)."""
    size = path.stat().st_size
    return {
        "prefault_4k": prefault_gbps(size, runs=runs),
        "prefault_thp": prefault_gbps(size, runs=runs, huge_pages=True),
        "preadv_fresh_warm": preadv_fresh_gbps(path, threads=threads, runs=runs),
        "preadv_fresh_thp_warm": preadv_fresh_gbps(
            path, threads=threads, runs=runs, huge_pages=True
        ),
        "preadv_touched_warm": preadv_touched_gbps(path, threads=threads, runs=runs),
        "mmap_touch_warm": mmap_touch_gbps(path, threads=threads, runs=runs),
        "preadv_fresh_cold": preadv_fresh_gbps(path, threads=threads, cold=True, runs=runs),
        "preadv_touched_cold": preadv_touched_gbps(path, threads=threads, cold=True, runs=runs),
        "mmap_touch_cold": mmap_touch_gbps(path, threads=threads, cold=True, runs=runs),
        "direct": direct_gbps(path, threads=threads, runs=runs),
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
